//! The CLI: arguments (clap), settings, and the commands. The only place that prints.
#![allow(clippy::print_stdout, clippy::print_stderr, reason = "the CLI is where output belongs")]

mod approvals;
mod build;
mod bundle;
mod cancel;
mod chat;
mod check;
mod init;
mod input;
mod mcp;
mod memory;
mod render;
mod run;
mod secrets;
mod serve;
mod sessions;
mod telemetry;
mod test;
mod triggers;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Exit codes, documented in `--help`.
pub(crate) mod exit {
    pub const OK: u8 = 0;
    pub const INVALID_AGENT: u8 = 1;
    pub const USAGE: u8 = 2;
    pub const RUN_FAILED: u8 = 3;
    pub const STOPPED_AT_LIMIT: u8 = 4;
    pub const AWAITING_INPUT: u8 = 5;
    pub const BUSY: u8 = 6;
    pub const TESTS_FAILED: u8 = 7;
    pub const INTERRUPTED: u8 = 130;

    /// The exit code of a run that failed with `failure`.
    pub fn for_failure(failure: &keel::RunFailure) -> u8 {
        match failure.code {
            keel::ErrorCode::SessionIdInvalid => 2,
            keel::ErrorCode::SessionBusy | keel::ErrorCode::RunLeased => BUSY,
            _ => RUN_FAILED,
        }
    }
}

const EXIT_CODES: &str = "\
Exit codes:
  0    the run finished (or `check` found no error)
  1    the agent is invalid or cannot be set up
  2    bad command-line usage
  3    the run failed (run.error)
  4    the run stopped at a limit (max_turns, max_total_tokens, max_tool_calls)
  5    the run is paused, waiting for a human (an approval or a question)
  6    the session is busy: another run of it is in flight (here or in another process) or
       waits for a human
  130  interrupted (Ctrl-C), or the run was cancelled";

const TEST_EXIT_CODES: &str = "\
Exit codes:
  0  every case passed
  1  the agent or a test case is invalid (nothing was run)
  7  a case failed";

/// `keel --version`: the crate's version and the git revision it was built from (`unknown`
/// outside a git checkout, `-dirty` with uncommitted changes), set by `build.rs`.
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (", env!("BUILD_GIT_REVISION"), ")");

/// `keel --version` (not `-V`): the version, then the optional capabilities this build has.
fn long_version() -> &'static str {
    static LONG: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    LONG.get_or_init(|| {
        let built = keel::features::built();
        let built = if built.is_empty() { "none".to_owned() } else { built.join(", ") };
        format!("{VERSION}\nfeatures: {built}")
    })
}

/// keel: run durable AI agents.
#[derive(Parser)]
#[command(
    name = "keel",
    version = VERSION,
    long_version = long_version(),
    about,
    after_help = EXIT_CODES,
    propagate_version = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Make a new agent directory from a template: commented, runs offline at once (the mock
    /// model), and says what to try next.
    Init(InitArgs),
    /// Run one turn of an agent and stream it to the terminal.
    #[command(after_help = EXIT_CODES)]
    Run(RunArgs),
    /// Chat with an agent: one turn per line, streamed, in one session.
    #[command(after_help = EXIT_CODES)]
    Chat(ChatArgs),
    /// Serve an agent over HTTP: chat with SSE streaming, live session events, approvals.
    Serve(ServeArgs),
    /// Serve an agent as an MCP server over stdio: one tool, `agent_<name>`, for any MCP client.
    Mcp(McpArgs),
    /// Run an agent's test cases (tests/*.yaml): each case's input, scripted model replies and
    /// decisions, then what the run must do; `--chaos` also kills each run at every step
    /// boundary and checks that it resumes the same.
    #[command(after_help = TEST_EXIT_CODES)]
    Test(test::TestArgs),
    /// Runs or resumes one test case for `keel test --chaos` (internal).
    #[command(hide = true)]
    ChaosWorker(test::WorkerArgs),
    /// Check an agent (spec file or directory) and print every problem.
    #[command(after_help = "Exit codes:\n  0  no error (warnings may be printed)\n  1  the agent has errors")]
    Check(CheckArgs),
    /// List, show and remove the sessions of a store.
    #[command(subcommand)]
    Sessions(SessionsCommand),
    /// List and decide the approvals and questions paused runs wait for.
    #[command(subcommand, after_help = EXIT_CODES)]
    Approvals(ApprovalsCommand),
    /// Cancel a session's unfinished run, wherever it is: in flight in any process sharing the
    /// store, paused for a human, or interrupted.
    #[command(after_help = CANCEL_EXIT_CODES)]
    Cancel(CancelArgs),
    /// Show an agent's cron schedules and when they fire next.
    #[command(subcommand)]
    Schedules(SchedulesCommand),
    /// Show and cancel runs, delayed ones among them (`keel run --after`, `POST /runs`).
    #[command(subcommand)]
    Runs(RunsCommand),
    /// Look at and erase what agents remember about their owners (episodes, entities,
    /// relations).
    #[command(subcommand)]
    Memory(MemoryCommand),
    /// Build an agent into something to deploy: one executable that serves it (`native`), or a
    /// Docker build context for an image holding that executable and nothing else (`docker`).
    Build(BuildArgs),
    /// Exit 0 when the `keel serve` that HOST and PORT name answers `/health` (the docker
    /// image's HEALTHCHECK).
    Health {
        /// Ask this URL instead (`http://127.0.0.1:3000/health`).
        #[arg(long)]
        url: Option<String>,
    },
    /// Print a shell completion script: `keel completions bash > /etc/bash_completion.d/keel`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print keel's manual page (roff): `keel man > ~/.local/share/man/man1/keel.1`.
    Man,
}

/// `keel memory ...`
#[derive(Subcommand)]
pub(crate) enum MemoryCommand {
    /// List the owners with memory, most recently written first, with counts by kind.
    List {
        /// One JSON object per owner, one per line: `{owner, episodes, entities, relations,
        /// updatedAtMs}`.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Print an owner's memory, most recently written first.
    Show {
        /// The owner: `session:<id>` (a session without per-user auth), `user:<scope>` (as
        /// `list` prints it), or `sub:<JWT subject>`.
        owner: String,
        /// Only this kind: `episode`, `entity` or `relation`.
        #[arg(long)]
        kind: Option<String>,
        /// One JSON object per record, one per line.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Erase an owner's memory: all of it, one kind, or one record (a user can be forgotten).
    Rm {
        /// The owner (see `show`).
        owner: String,
        /// Only this kind: `episode`, `entity` or `relation`.
        #[arg(long)]
        kind: Option<String>,
        /// Only this record (its key, as `show` prints it); needs `--kind`.
        #[arg(long, requires = "kind")]
        key: Option<String>,
        #[command(flatten)]
        store: StoreArgs,
    },
}

/// `keel schedules ...`
#[derive(Subcommand)]
pub(crate) enum SchedulesCommand {
    /// List the agent's schedules with their next fire times, in their time zone and in UTC.
    List {
        /// The agent: a directory with agent.yaml, or a spec file (.yaml, .toml, .json).
        agent: PathBuf,
        /// How many fire times to show for each.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=100))]
        next: u16,
        /// One JSON object per schedule, one per line.
        #[arg(long)]
        json: bool,
    },
}

/// `keel runs ...`
#[derive(Subcommand)]
pub(crate) enum RunsCommand {
    /// Where a run is: a delayed run waiting or cancelled, or a run's state.
    Show {
        /// The run id (`run_...`).
        run: String,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Cancel a delayed run that has not started (a started run: `keel cancel <session>`).
    Cancel {
        /// The delayed run's id (`run_at_...`).
        run: String,
        #[command(flatten)]
        store: StoreArgs,
    },
}

const CANCEL_EXIT_CODES: &str = "\
Exit codes:
  0  the run is cancelled (or asked to stop, when another process drives it)
  1  the store or the agent cannot be opened
  2  bad command-line usage
  3  the session has no unfinished run (KEEL_RUN_NOT_FOUND), or the cancellation failed";

/// Arguments of `keel cancel`.
#[derive(clap::Args)]
pub(crate) struct CancelArgs {
    /// The session whose run to cancel.
    pub(crate) session: String,
    /// End the run here and now with this agent (a directory or spec file), when nobody drives
    /// it. Without it, a paused or interrupted run ends the next time a process drives the
    /// session; a run in flight in another process stops there either way.
    #[arg(long)]
    pub(crate) agent: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) store: StoreArgs,
}

/// `keel approvals ...`
#[derive(Subcommand)]
pub(crate) enum ApprovalsCommand {
    /// List what paused runs wait for, oldest first.
    List {
        /// Only this session's.
        #[arg(long)]
        session: Option<String>,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Approve a tool call: it runs, and the run goes on.
    Approve {
        /// The approval id (`ap_...`), from `keel approvals list` or the `approval.requested` event.
        #[arg(required_unless_present = "session")]
        id: Option<String>,
        /// Why, for the record.
        #[arg(long)]
        note: Option<String>,
        #[command(flatten)]
        target: approvals::DecisionTarget,
    },
    /// Reject a tool call: the model is told (with the note), and the run goes on.
    Reject {
        /// The approval id (`ap_...`).
        #[arg(required_unless_present = "session")]
        id: Option<String>,
        /// Why; the model sees it.
        #[arg(long)]
        note: Option<String>,
        #[command(flatten)]
        target: approvals::DecisionTarget,
    },
    /// Answer a question the agent asked (`ask_question`).
    Answer {
        /// The question id (`qu_...`); or `--session` and the answer alone.
        #[arg(required_unless_present = "session")]
        id: Option<String>,
        /// The answer.
        answer: Option<String>,
        #[command(flatten)]
        target: approvals::DecisionTarget,
    },
}

/// `keel sessions ...`
#[derive(Subcommand)]
pub(crate) enum SessionsCommand {
    /// List the sessions, most recently used first.
    List {
        /// One JSON object per session, one per line: `{sessionId, messages, runs, usage,
        /// updatedAtMs}`.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Print a session's transcript.
    Show {
        /// The session id.
        id: String,
        /// Print the transcript as one JSON document, as `GET /chat/:id` answers it (messages and
        /// pending inputs).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Remove a session with its runs and journals.
    Rm {
        /// The session id.
        id: String,
        #[command(flatten)]
        store: StoreArgs,
    },
    /// Remove the sessions not written to for a while (a time to live), with their runs, and/or
    /// compact the journals of finished runs.
    #[command(group(clap::ArgGroup::new("what").required(true).multiple(true).args(["older_than", "compact"])))]
    Prune {
        /// Remove sessions unused for longer than this, e.g. `30d`, `12h`.
        #[arg(long, value_parser = parse_duration)]
        older_than: Option<std::time::Duration>,
        /// Drop the journals of finished runs (their messages stay; they can no longer be
        /// replayed step by step).
        #[arg(long)]
        compact: bool,
        /// List what would be removed, remove nothing.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        store: StoreArgs,
    },
}

/// Keeps keel's memory and environment (its API token, JWT secret and provider keys) from the
/// tools it runs, which run as the same user: a non-dumpable process's `/proc/<pid>/environ`,
/// `mem` and friends belong to root, and it cannot be ptraced by its user's other processes.
/// Tools get a minimal environment of their own; this closes the way around it (`cat
/// /proc/$PPID/environ` from `shell`). The cost: no core dumps, and attaching a debugger to a
/// running keel needs root. (A tool running as root reads any process's files; for that case
/// [`secrets::scrub_environment_block`] has already blanked the secrets' original copies.)
fn hide_from_tools() {
    #[cfg(target_os = "linux")]
    if let Err(error) = nix::sys::prctl::set_dumpable(false) {
        tracing::warn!(%error, "could not make keel non-dumpable: its tools may read its environment");
    }
}

/// How long a command waits, once its work is done, for blocking work still going (a file
/// operation a tool's call gave up on) before it exits anyway.
pub(crate) const EXIT_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// Runs `work` to its end on a new runtime, then stops the runtime within [`EXIT_GRACE`]: a
/// blocking task left behind never holds up the exit (dropping a runtime would wait for it).
pub(crate) fn run_async<T>(work: impl std::future::Future<Output = T>) -> std::io::Result<T> {
    finish_on(tokio::runtime::Builder::new_multi_thread().enable_all().build()?, work)
}

/// [`run_async`] on this thread alone: for a command that drives one run, whose steps follow
/// one another, so that no step waits for another thread to wake up to run it. (Tools' blocking
/// work and the stores' own threads are unaffected.)
pub(crate) fn run_on_this_thread<T>(work: impl std::future::Future<Output = T>) -> std::io::Result<T> {
    finish_on(tokio::runtime::Builder::new_current_thread().enable_all().build()?, work)
}

fn finish_on<T>(
    runtime: tokio::runtime::Runtime,
    work: impl std::future::Future<Output = T>,
) -> std::io::Result<T> {
    let outcome = runtime.block_on(work);
    runtime.shutdown_timeout(EXIT_GRACE);
    Ok(outcome)
}

/// What the spec loader checks an agent against: keel's built-in tools and providers, and what
/// this build was compiled without.
pub(crate) fn load_options() -> keel_spec::LoadOptions<'static> {
    keel::load_options()
}

/// Opens a store, off the async threads (opening may block: the PostgreSQL driver runs its own
/// runtime), printing why it cannot.
pub(crate) async fn open_store(url: &str) -> Option<std::sync::Arc<dyn keel_core::Store>> {
    open_store_with(url, keel_store::open).await
}

/// [`open_store`] for a command that only looks at a store or tidies it
/// ([`keel_store::open_existing`]: a missing SQLite file is empty, and not created).
pub(crate) async fn open_store_to_inspect(url: &str) -> Option<std::sync::Arc<dyn keel_core::Store>> {
    open_store_with(url, keel_store::open_existing).await
}

async fn open_store_with(
    url: &str,
    open: fn(&str) -> Result<std::sync::Arc<dyn keel_core::Store>, keel_core::StoreError>,
) -> Option<std::sync::Arc<dyn keel_core::Store>> {
    let target = url.to_owned();
    match tokio::task::spawn_blocking(move || open(&target)).await {
        Ok(Ok(store)) => Some(store),
        Ok(Err(error)) => {
            eprintln!("error[{}]: {error}", error.code());
            None
        }
        Err(error) => {
            eprintln!("error: {error}");
            None
        }
    }
}

/// A file system error that names the path it happened at (`cannot create /x/y: Permission
/// denied`): what `keel init` and `keel build` say when they cannot write where they were told.
pub(crate) fn at_path(
    doing: &'static str,
    path: &std::path::Path,
) -> impl FnOnce(std::io::Error) -> std::io::Error {
    let path = path.display().to_string();
    move |error| std::io::Error::new(error.kind(), format!("cannot {doing} {path}: {error}"))
}

fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    humantime::parse_duration(text).map_err(|e| format!("{e} (write durations like `30d`, `12h`, `90m`)"))
}

/// Which store a command reads.
#[derive(clap::Args)]
pub(crate) struct StoreArgs {
    /// The store: `sqlite:<path>` or `postgres://user@host/database` (or `memory`, which is always
    /// empty here).
    #[arg(long, env = keel_core::env::STORE.name, default_value = "sqlite:.keel/keel.db")]
    pub(crate) store: String,
}

/// Arguments of `keel run`.
#[derive(clap::Args)]
pub(crate) struct RunArgs {
    /// The agent: a directory with agent.yaml, or a spec file (.yaml, .toml, .json).
    pub(crate) agent: PathBuf,
    /// What to ask the agent; `-` reads it from stdin, as does no input with stdin not a
    /// terminal (`echo hi | keel run agent`). With no input at all, only the session's
    /// unfinished run (interrupted, or paused and decided since) is continued.
    pub(crate) input: Option<String>,
    /// The session (conversation) id: 1-128 characters of A-Z, a-z, 0-9, `_`, `-`.
    #[arg(long, default_value = "default")]
    pub(crate) session: String,
    /// Where sessions and journals live: `sqlite:<path>` or `postgres://user@host/database` (a
    /// conversation continues across runs of the command with the same --session), or `memory`
    /// (gone when the command ends). Default: `sqlite:.keel/keel.db` when --session is given,
    /// else `memory`.
    #[arg(long, env = keel_core::env::STORE.name, default_value = "memory", hide_default_value = true)]
    pub(crate) store: String,
    /// Use this model instead of the spec's (`mock`, `openai/gpt-4o-mini`, ...).
    #[arg(long)]
    pub(crate) model: Option<String>,
    /// Print the run's events as JSON lines on stdout instead of text.
    #[arg(long)]
    pub(crate) json: bool,
    /// Do not run now: store the run to start after this long (`10m`, `2h`, `3d`), in a store
    /// that outlives the command; `keel serve` on that store starts it then.
    #[arg(long, conflicts_with = "at", requires = "input")]
    pub(crate) after: Option<String>,
    /// Like `--after`, at this time: RFC 3339 with an offset (`2026-12-24T09:00:00+01:00`).
    #[arg(long, requires = "input")]
    pub(crate) at: Option<String>,
}

/// Arguments of `keel chat`.
#[derive(clap::Args)]
pub(crate) struct ChatArgs {
    /// The agent: a directory with agent.yaml, or a spec file (.yaml, .toml, .json).
    pub(crate) agent: PathBuf,
    /// The session to chat in (default: a new one, `chat-<date>-<time>`); with a sqlite store,
    /// give an earlier session's id to go on with it.
    #[arg(long)]
    pub(crate) session: Option<String>,
    /// Where sessions and journals live: `memory`, `sqlite:<path>` or `postgres://user@host/database`.
    /// Default: `sqlite:.keel/keel.db` when --session is given, else `memory`.
    #[arg(long, env = keel_core::env::STORE.name, default_value = "memory", hide_default_value = true)]
    pub(crate) store: String,
    /// Use this model instead of the spec's (`mock`, `openai/gpt-4o-mini`, ...).
    #[arg(long)]
    pub(crate) model: Option<String>,
}

/// Arguments of `keel serve`.
#[derive(clap::Args)]
pub(crate) struct ServeArgs {
    /// The agent: a directory with agent.yaml, or a spec file (.yaml, .toml, .json).
    pub(crate) agent: PathBuf,
    /// The address to listen on. Anything but a loopback address needs KEEL_API_TOKEN.
    #[arg(long, env = "HOST", default_value = "127.0.0.1")]
    pub(crate) host: String,
    /// The port (0 picks a free one).
    #[arg(long, env = "PORT", default_value_t = 3000)]
    pub(crate) port: u16,
    /// Where sessions and journals live (`sqlite:<path>`, `postgres://user@host/database` or `memory`).
    #[arg(long, env = keel_core::env::STORE.name, default_value = "sqlite:.keel/keel.db")]
    pub(crate) store: String,
    /// Use this model instead of the spec's.
    #[arg(long)]
    pub(crate) model: Option<String>,
}

/// Arguments of `keel mcp`.
#[derive(clap::Args)]
pub(crate) struct McpArgs {
    /// The agent: a directory with agent.yaml, or a spec file (.yaml, .toml, .json).
    pub(crate) agent: PathBuf,
    /// Where sessions and journals live (`sqlite:<path>`, `postgres://user@host/database` or `memory`).
    #[arg(long, env = keel_core::env::STORE.name, default_value = "sqlite:.keel/keel.db")]
    pub(crate) store: String,
    /// Use this model instead of the spec's.
    #[arg(long)]
    pub(crate) model: Option<String>,
}

/// Arguments of `keel init`.
#[derive(clap::Args)]
pub(crate) struct InitArgs {
    /// The directory to make (default: this one, when it is empty).
    #[arg(default_value = ".")]
    pub(crate) dir: PathBuf,
    /// What the agent starts with.
    #[arg(long, value_enum, default_value = "assistant")]
    pub(crate) template: Template,
    /// Write into a directory that is not empty (the template's files are replaced, each named).
    #[arg(long)]
    pub(crate) force: bool,
}

/// The templates of `keel init`.
#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum Template {
    /// A built-in tool and instructions.
    Assistant,
    /// A command tool of its own (a Python script).
    Tools,
    /// A tool whose calls wait for a human's approval.
    Approvals,
    /// Tools from an MCP server (the official filesystem server, from npm).
    Mcp,
    /// An agent to serve over HTTP, with the commands to call it.
    Serve,
}

impl Template {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Template::Assistant => "assistant",
            Template::Tools => "tools",
            Template::Approvals => "approvals",
            Template::Mcp => "mcp",
            Template::Serve => "serve",
        }
    }
}

/// Arguments of `keel build`.
#[derive(clap::Args)]
pub(crate) struct BuildArgs {
    /// The agent: a directory with agent.yaml, or a spec file (.yaml, .toml, .json), which is
    /// packed with the directory it is in.
    pub(crate) agent: PathBuf,
    /// What to build.
    #[arg(long, value_enum, default_value = "native")]
    pub(crate) target: BuildTarget,
    /// Where to write it (default `.keel/build/<target>`).
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
    /// The keel executable the artifact is made from (default: this one). Give a statically
    /// linked keel to make the docker image a single file.
    #[arg(long)]
    pub(crate) keel: Option<PathBuf>,
}

/// The targets of `keel build`.
#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum BuildTarget {
    /// One executable with the agent inside, for this kind of machine.
    Native,
    /// A Docker build context: an image FROM scratch, non-root, serving on 0.0.0.0:3000.
    Docker,
}

impl BuildTarget {
    pub(crate) fn name(self) -> &'static str {
        match self {
            BuildTarget::Native => "native",
            BuildTarget::Docker => "docker",
        }
    }
}

/// Arguments of `keel check`.
#[derive(clap::Args)]
pub(crate) struct CheckArgs {
    /// The agent: a directory with agent.yaml, or a spec file (.yaml, .toml, .json).
    pub(crate) agent: PathBuf,
    /// Do not start or reach the agent's MCP servers (by default each is connected and its
    /// tools listed).
    #[arg(long)]
    pub(crate) offline: bool,
    /// Print one JSON document on stdout: `{ok, agent, diagnostics: [{severity, code, message,
    /// file, line, column, hint}], documents, mcp}`.
    #[arg(long)]
    pub(crate) json: bool,
}

/// Parses the command line, runs the command, and returns its exit code.
pub(crate) fn main() -> ExitCode {
    // First, while keel has one thread: the environment may be changed safely only then.
    #[cfg(target_os = "linux")]
    secrets::scrub_environment_block();
    let arguments = match bundle::command_line() {
        Ok(arguments) => arguments,
        Err(error) => {
            eprintln!("error: cannot open the agent this executable carries: {error}");
            return ExitCode::from(exit::INVALID_AGENT);
        }
    };
    let matches = <Cli as clap::CommandFactory>::command().get_matches_from(arguments);
    let mut cli = match <Cli as clap::FromArgMatches>::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(error) => error.exit(),
    };
    persist_named_sessions(&mut cli, &matches);
    init_logging(if matches!(cli.command, Command::Serve(_)) { "info" } else { "warn" });
    hide_from_tools();
    if let Err(error) =
        keel_providers::ca_bundle().map(drop).and_then(|()| keel_providers::check_proxy_environment())
    {
        eprintln!("error[{}]: {error}", keel_core::ErrorCode::ConfigInvalid.as_str());
        return ExitCode::from(exit::INVALID_AGENT);
    }
    // Held to the end of the command: dropping it sends the last spans.
    let _telemetry = match telemetry::start() {
        Ok(telemetry) => telemetry,
        Err(message) => {
            eprintln!("error[{}]: {message}", keel_core::ErrorCode::ConfigInvalid.as_str());
            return ExitCode::from(exit::INVALID_AGENT);
        }
    };
    let code = match cli.command {
        Command::Init(args) => init::init(&args),
        Command::Run(args) => run::run(args),
        Command::Chat(args) => chat::chat(args),
        Command::Serve(args) => serve::serve(args),
        Command::Check(args) => check::check(&args),
        Command::Test(args) => test::test(&args),
        Command::ChaosWorker(args) => test::chaos_worker(&args),
        Command::Mcp(args) => mcp::mcp(&args),
        Command::Sessions(command) => sessions::sessions(command),
        Command::Approvals(command) => approvals::approvals(command),
        Command::Cancel(args) => cancel::cancel(&args),
        Command::Schedules(command) => triggers::schedules(command),
        Command::Runs(command) => triggers::runs(command),
        Command::Memory(command) => memory::memory(command),
        Command::Build(args) => build::build(&args),
        Command::Health { url } => build::health(url.as_deref()),
        Command::Completions { shell } => {
            // Into a buffer first: the generator panics when its writer fails (`| head`).
            let mut command = <Cli as clap::CommandFactory>::command();
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut command, "keel", &mut script);
            std::io::Write::write_all(&mut std::io::stdout(), &script).map(|()| exit::OK)
        }
        Command::Man => {
            let command = <Cli as clap::CommandFactory>::command();
            clap_mangen::Man::new(command).render(&mut std::io::stdout()).map(|()| exit::OK)
        }
    };
    match code {
        Ok(code) => ExitCode::from(code),
        // A closed pipe (`keel run ... | head`) is not an error.
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::from(exit::RUN_FAILED)
        }
    }
}

/// `keel run --session ID` and `keel chat --session ID` without a store keep the session where
/// every other command looks for it (`sqlite:.keel/keel.db`): naming a session means wanting it
/// back. Without `--session`, a turn is a one-off and the store stays `memory`.
fn persist_named_sessions(cli: &mut Cli, matches: &clap::ArgMatches) {
    let given = |name: &str, id: &str| {
        matches.subcommand_matches(name).and_then(|m| m.value_source(id))
            == Some(clap::parser::ValueSource::CommandLine)
    };
    let defaulted = |name: &str| {
        matches.subcommand_matches(name).and_then(|m| m.value_source("store"))
            == Some(clap::parser::ValueSource::DefaultValue)
    };
    match &mut cli.command {
        Command::Run(args) if given("run", "session") && defaulted("run") => {
            args.store = PERSISTENT_STORE.to_owned()
        }
        Command::Chat(args) if given("chat", "session") && defaulted("chat") => {
            args.store = PERSISTENT_STORE.to_owned();
        }
        _ => {}
    }
}

/// The store of every command that keeps sessions by default.
const PERSISTENT_STORE: &str = "sqlite:.keel/keel.db";

/// Logs go to stderr, filtered by `KEEL_LOG` (default: warnings; `keel serve`: info), as
/// text, or as one JSON object per line with `KEEL_LOG_FORMAT=json` (for log collectors).
fn init_logging(default: &str) {
    // rmcp logs, as errors, what keel reports itself with a code (an MCP server that did not
    // start, a line it dropped), as the PDF parser (lopdf) logs the broken objects of a document
    // keel skips with a warning of its own: unless asked for (`KEEL_LOG=rmcp=debug`), they stay
    // quiet.
    let variable = keel_core::env::LOG.name;
    let filter = tracing_subscriber::EnvFilter::try_from_env(variable).unwrap_or_else(|error| {
        // Unset is the default; a value that does not parse is said, not silently dropped.
        if let Ok(value) = std::env::var(variable) {
            eprintln!(
                "warning: {variable}={value:?} is not a log filter ({error}); logging at `{default}` \
                 (write a level, `debug`, or targets, `keel_runtime=debug,info`)"
            );
        }
        tracing_subscriber::EnvFilter::new(format!("{default},rmcp=off,lopdf=off"))
    });
    // Colours only for a terminal: `keel serve 2> serve.log` writes plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    let _ = if std::env::var(keel_core::env::LOG_FORMAT.name).is_ok_and(|f| f == "json") {
        builder.json().with_current_span(true).with_span_list(false).try_init()
    } else {
        builder.without_time().try_init()
    };
}
