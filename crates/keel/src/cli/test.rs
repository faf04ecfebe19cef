//! `keel test`: runs an agent's test cases (`tests/*.yaml`) and says, case by case, what
//! differs from what each expects; `--chaos` also kills each case's run at every step boundary
//! (a real SIGKILL of a worker process) and checks that the resumed run ends as the clean one
//! did, with no completed step run again.
//!
//! A chaos worker is this executable again (the hidden `keel chaos-worker`): it runs or resumes
//! one case on a SQLite store and reports each tool dispatch and step commit as a JSON line on
//! stdout; asked to stop after the k-th commit, it says so and waits there to be killed.

use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel::testing::{Mismatch, Observed, Probe, TestCase};
use keel::{Agent, AgentSpec};
use serde_json::{Value, json};
use tokio::io::AsyncBufReadExt;

use super::exit;
use super::run::load_spec;

/// The session each case runs in (every case has its own store).
const SESSION: &str = "test";
/// How long a chaos worker may go without saying anything before it is taken for stuck.
const WORKER_SILENCE: Duration = Duration::from_secs(120);

/// Arguments of `keel test`.
#[derive(clap::Args)]
pub(crate) struct TestArgs {
    /// The agent: a directory (its cases are tests/*.yaml) or a spec file (give its cases).
    pub(crate) agent: PathBuf,
    /// Case files to run instead of the agent directory's tests/*.yaml.
    pub(crate) cases: Vec<PathBuf>,
    /// Also kill each case's run at every step boundary (SIGKILL), resume it, and check that it
    /// ends as the clean run did with no completed step or tool call run again.
    #[arg(long)]
    pub(crate) chaos: bool,
    /// Run the cases that have no `mock` against the agent's own model, and write its replies
    /// into each case file as the case's `mock`: from then on the case plays them back, offline.
    #[arg(long, conflicts_with = "chaos")]
    pub(crate) record: bool,
    /// Print one JSON document on stdout: `{ok, agent, passed, failed, cases: [{name, file,
    /// passed, duration_ms, mismatches: [{what, expected, actual}], chaos, recorded}]}`.
    #[arg(long)]
    pub(crate) json: bool,
}

/// Arguments of the hidden `keel chaos-worker`.
#[derive(clap::Args)]
pub(crate) struct WorkerArgs {
    agent: PathBuf,
    case: PathBuf,
    #[arg(long)]
    store: String,
    /// Stop after this many step commits, and wait to be killed.
    #[arg(long)]
    kill_after: Option<usize>,
    /// Resume this run instead of starting the case.
    #[arg(long)]
    resume: Option<String>,
    /// The time the clock tools read (the same in every worker of a case).
    #[arg(long)]
    now: Option<jiff::ZonedDateTime>,
}

/// What one case gave.
struct CaseReport {
    name: String,
    file: PathBuf,
    duration: Duration,
    mismatches: Vec<Mismatch>,
    chaos: Option<ChaosReport>,
    /// With `--record`: what was recorded into the case file.
    recorded: Option<Recorded>,
}

/// What `--record` did with a case.
enum Recorded {
    /// This many model replies were written into the case file as its `mock`; the subagents on
    /// a real model whose calls are not in it.
    Replies(usize, Vec<String>),
    /// Nothing, and why (the case is scripted already, or the agent's model is the mock).
    Skipped(String),
}

impl CaseReport {
    fn passed(&self) -> bool {
        self.mismatches.is_empty() && self.chaos.as_ref().is_none_or(|chaos| chaos.problems.is_empty())
    }
}

/// What killing one case's run at each step boundary gave.
#[derive(Default)]
struct ChaosReport {
    /// The steps of the clean run, in commit order: a kill after each.
    boundaries: Vec<String>,
    /// What went wrong, each naming the boundary.
    problems: Vec<String>,
}

pub(crate) fn test(args: &TestArgs) -> std::io::Result<u8> {
    super::run_async(test_async(args))?
}

async fn test_async(args: &TestArgs) -> std::io::Result<u8> {
    let mut stderr = std::io::stderr();
    let Some(spec) = load_spec(&args.agent)? else { return Ok(exit::INVALID_AGENT) };
    let files = if args.cases.is_empty() {
        if !args.agent.is_dir() {
            writeln!(
                stderr,
                "error: {} is a spec file: give its test case files (`keel test {} cases/*.yaml`), or put the agent in a directory with tests/",
                args.agent.display(),
                args.agent.display()
            )?;
            return Ok(exit::INVALID_AGENT);
        }
        keel_spec::test_files(&args.agent)?
    } else {
        args.cases.clone()
    };
    if files.is_empty() {
        writeln!(
            stderr,
            "error: {} has no test cases: add tests/<name>.yaml (docs/testing.md shows one), or run `keel init` for an agent that has one",
            args.agent.display()
        )?;
        return Ok(exit::INVALID_AGENT);
    }
    let Some(cases) = load_cases(&spec, &files).await? else { return Ok(exit::INVALID_AGENT) };

    if !args.json {
        let what = if args.chaos {
            " (with a kill at every step boundary)"
        } else if args.record {
            " (recording the model's replies of those without a `mock`)"
        } else {
            ""
        };
        println!("running {} of agent {}{what}", count(cases.len(), "case"), spec.name);
    }
    let mut reports = Vec::with_capacity(cases.len());
    for case in &cases {
        let report = run_case(&spec, case, args).await;
        if !args.json {
            print_report(&report);
        }
        reports.push(report);
    }
    let failed = reports.iter().filter(|r| !r.passed()).count();
    if args.json {
        let cases: Vec<Value> = reports.iter().map(report_json).collect();
        let document = json!({
            "ok": failed == 0,
            "agent": spec.name,
            "passed": reports.len() - failed,
            "failed": failed,
            "cases": cases,
        });
        println!("{document}");
    } else {
        println!("\n{}: {} passed, {failed} failed", count(reports.len(), "case"), reports.len() - failed);
    }
    Ok(if failed == 0 { exit::OK } else { exit::TESTS_FAILED })
}

/// The cases of `files`, checked against the agent's tools; their diagnostics printed, `None`
/// when one has an error.
async fn load_cases(spec: &AgentSpec, files: &[PathBuf]) -> std::io::Result<Option<Vec<TestCase>>> {
    let mut stderr = std::io::stderr();
    // The tools as the model sees them: built, so MCP servers' tools are known too.
    let tools: Option<Vec<String>> =
        match Agent::from_spec(spec.clone(), Arc::new(keel::MemoryStore::new())).await {
            Ok(agent) => Some(agent.definition().tools.names().map(str::to_owned).collect()),
            Err(error) => {
                writeln!(stderr, "error[{}]: {error}", error.code())?;
                return Ok(None);
            }
        };
    let loaded = keel_spec::load_tests(files, tools.as_deref(), keel_tools::tool_name);
    for diagnostic in &loaded.diagnostics {
        writeln!(stderr, "{diagnostic}")?;
    }
    if loaded.diagnostics.iter().any(keel::Diagnostic::is_error) {
        writeln!(stderr, "the test cases have errors; nothing was run")?;
        return Ok(None);
    }
    Ok(Some(loaded.cases))
}

/// The tools the model sees, as far as the spec tells (`None` when MCP servers add some only
/// known once connected): what `keel check` checks the test cases' tool names against.
pub(crate) fn spec_tool_names(spec: &AgentSpec) -> Option<Vec<String>> {
    if !spec.mcp.is_empty() {
        return None;
    }
    let mut names: Vec<String> =
        spec.builtin_tools.iter().map(|name| keel_tools::tool_name(name).to_owned()).collect();
    names.extend(spec.command_tools.iter().map(|tool| tool.def.name.clone()));
    names.extend(spec.subagents.iter().map(|sub| sub.name.clone()));
    if let Some(workspace) = &spec.workspace
        && workspace.mode != keel_core::WorkspaceMode::Disabled
    {
        names.extend(keel_tools::WORKSPACE_READ_TOOLS.iter().map(|name| (*name).to_owned()));
        if workspace.mode == keel_core::WorkspaceMode::Writable {
            names.extend(keel_tools::WORKSPACE_WRITE_TOOLS.iter().map(|name| (*name).to_owned()));
        }
    }
    names.extend(spec.memory.knowledge_tools());
    Some(names)
}

/// The agent as `case` runs it: its mock script and first state when the case gives them.
fn spec_for(spec: &AgentSpec, case: &TestCase) -> AgentSpec {
    let mut spec = spec.clone();
    if let Some(mock) = &case.mock {
        spec.model = "mock".to_owned();
        spec.mock = Some(mock.clone());
    }
    if let Some(state) = &case.state {
        spec.initial_state = Some(state.clone());
    }
    spec
}

async fn run_case(spec: &AgentSpec, case: &TestCase, args: &TestArgs) -> CaseReport {
    let started = Instant::now();
    let store = Arc::new(keel::MemoryStore::new());
    let mut recorded = None;
    let mut mismatches = match run_in_memory(spec, case, store.clone()).await {
        Ok(observed) => {
            if args.record {
                recorded = Some(record(spec, case, store.as_ref(), &observed).await);
            }
            keel::testing::check(&case.expect, &observed)
        }
        Err(failure) => vec![Mismatch {
            what: "setup".into(),
            expected: "the agent to start".into(),
            actual: format!("{}: {}", failure.code, failure.message),
        }],
    };
    if let Some(Err(problem)) = &recorded {
        mismatches.push(Mismatch {
            what: "record".into(),
            expected: "the model's replies written into the case".into(),
            actual: problem.clone(),
        });
    }
    let chaos =
        if args.chaos && mismatches.is_empty() { Some(chaos(&args.agent, spec, case).await) } else { None };
    CaseReport {
        name: case.name.clone(),
        file: case.file.clone(),
        duration: started.elapsed(),
        mismatches,
        chaos,
        recorded: recorded.and_then(Result::ok),
    }
}

async fn run_in_memory(
    spec: &AgentSpec,
    case: &TestCase,
    store: Arc<keel::MemoryStore>,
) -> Result<Observed, keel::RunFailure> {
    let setup = keel::testing::Setup { probe: None, now: case.now.clone() };
    let agent = Agent::from_spec_with(spec_for(spec, case), store, &setup)
        .await
        .map_err(|error| keel::RunFailure::new(error.code(), error.to_string()))?;
    keel::testing::drive_case(&agent, case, SESSION, None).await
}

/// `--record`: the model's replies of the case's run, written into its file as its `mock`.
async fn record(
    spec: &AgentSpec,
    case: &TestCase,
    store: &keel::MemoryStore,
    observed: &Observed,
) -> Result<Recorded, String> {
    if case.mock.is_some() {
        return Ok(Recorded::Skipped("scripted already (its `mock`)".into()));
    }
    if spec.model == "mock" {
        return Ok(Recorded::Skipped("the agent's model is `mock`: there is no real model to record".into()));
    }
    let Some(run) = &observed.run_id else {
        return Err("the run failed before any reply could be recorded".into());
    };
    let script = keel::testing::recorded_script(store, run).await.map_err(|error| error.to_string())?;
    if script.entries.is_empty() {
        return Err("the run made no model call".into());
    }
    let replies = script.entries.len() + script.compact.len();
    append_recording(&case.file, &script, &spec.model)
        .map_err(|error| format!("cannot write {}: {error}", case.file.display()))?;
    let unrecorded =
        spec.subagents.iter().filter(|sub| sub.model != "mock").map(|sub| sub.name.clone()).collect();
    Ok(Recorded::Replies(replies, unrecorded))
}

/// Appends `script` to the case file as its `mock`, with a comment saying where it came from;
/// the file is replaced at once (never left half written), its own lines kept as they were.
fn append_recording(file: &Path, script: &keel_core::MockScript, model: &str) -> std::io::Result<()> {
    let mut text = std::fs::read_to_string(file)?;
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    let today = jiff::ZonedDateTime::now().date();
    text.push_str(&format!(
        "\n# The model's replies, recorded from {model} by `keel test --record` on {today}: this case plays\n\
         # them back from now on, offline. Delete `mock` to record them again.\n"
    ));
    text.push_str(&keel_spec::mock_yaml(script));
    let dir = file.parent().filter(|dir| !dir.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let mut replacement = tempfile::NamedTempFile::new_in(dir)?;
    replacement.write_all(text.as_bytes())?;
    replacement.as_file().sync_all()?;
    replacement.persist(file).map_err(|error| error.error)?;
    Ok(())
}

/// `1 case`, `3 cases`, `2 step boundaries`.
fn count(n: usize, noun: &str) -> String {
    match (n, noun.strip_suffix('y')) {
        (1, _) => format!("1 {noun}"),
        (_, Some(stem)) => format!("{n} {stem}ies"),
        (_, None) => format!("{n} {noun}s"),
    }
}

fn print_report(report: &CaseReport) {
    let ms = report.duration.as_millis();
    match &report.recorded {
        Some(Recorded::Replies(n, unrecorded)) => {
            println!("  ● {}: recorded {} into {}", report.name, count(*n, "reply"), report.file.display());
            if !unrecorded.is_empty() {
                println!(
                    "      not recorded: the model calls of subagents {} (give them a `mock` script)",
                    unrecorded.join(", ")
                );
            }
        }
        Some(Recorded::Skipped(why)) => println!("  · {}: not recorded: {why}", report.name),
        None => {}
    }
    if report.passed() {
        match &report.chaos {
            Some(chaos) => println!(
                "  ✓ {} ({ms} ms): resumed the same after a kill at each of its {}",
                report.name,
                count(chaos.boundaries.len(), "step boundary")
            ),
            None => println!("  ✓ {} ({ms} ms)", report.name),
        }
        return;
    }
    println!("  ✗ {} ({ms} ms) {}", report.name, report.file.display());
    for mismatch in &report.mismatches {
        for line in mismatch.to_string().lines() {
            println!("      {line}");
        }
    }
    if let Some(chaos) = &report.chaos {
        for problem in &chaos.problems {
            for (index, line) in problem.lines().enumerate() {
                println!("      {}{line}", if index == 0 { "chaos: " } else { "  " });
            }
        }
    }
}

fn report_json(report: &CaseReport) -> Value {
    let mismatches: Vec<Value> = report
        .mismatches
        .iter()
        .map(|m| json!({"what": m.what, "expected": m.expected, "actual": m.actual}))
        .collect();
    json!({
        "name": report.name,
        "file": report.file.display().to_string(),
        "passed": report.passed(),
        "duration_ms": u64::try_from(report.duration.as_millis()).unwrap_or(u64::MAX),
        "mismatches": mismatches,
        "chaos": report.chaos.as_ref().map(|chaos| json!({
            "boundaries": chaos.boundaries,
            "problems": chaos.problems,
        })),
        "recorded": report.recorded.as_ref().map(|recorded| match recorded {
            Recorded::Replies(n, unrecorded) => json!({ "replies": n, "unrecorded_subagents": unrecorded }),
            Recorded::Skipped(why) => json!({ "skipped": why }),
        }),
    })
}

/// A tool call a worker really made.
struct Dispatched {
    run: String,
    tool: String,
    call_id: String,
}

/// What a chaos worker reported.
#[derive(Default)]
struct WorkerRun {
    run_id: Option<String>,
    dispatches: Vec<Dispatched>,
    /// `<run id> <step>`, in commit order.
    commits: Vec<String>,
    /// Whether it stopped at the boundary it was asked to (and was killed there).
    stopped_at_boundary: bool,
    observed: Option<Value>,
}

/// Runs `case` clean in a worker, then once per step boundary: killed there, resumed in a new
/// worker, compared with the clean run.
async fn chaos(agent: &Path, spec: &AgentSpec, case: &TestCase) -> ChaosReport {
    let mut report = ChaosReport::default();
    if spec_for(spec, case).model != "mock" {
        report.problems.push(
            "a chaos test needs the model's replies scripted: give the case a `mock` script (a real model answers differently each time)"
                .into(),
        );
        return report;
    }
    let dir = match tempfile::tempdir() {
        Ok(dir) => dir,
        Err(error) => {
            report.problems.push(format!("cannot make a temporary directory: {error}"));
            return report;
        }
    };
    let store = |name: &str| format!("sqlite:{}", dir.path().join(format!("{name}.db")).display());
    // Every run of the case reads one time: a clock tool answers the same before and after a kill.
    let now = case.now.clone().unwrap_or_else(jiff::ZonedDateTime::now);
    let clean = match worker(agent, case, &store("clean"), &now, None, None).await {
        Ok(run) => run,
        Err(problem) => {
            report.problems.push(format!("the clean run: {problem}"));
            return report;
        }
    };
    let Some(clean_observed) = clean.observed.clone() else {
        report.problems.push("the clean run ended without a result".into());
        return report;
    };
    report.boundaries = clean
        .commits
        .iter()
        .map(|c| c.split_once(' ').map_or(c.as_str(), |(_, step)| step).to_owned())
        .collect();
    for (index, boundary) in report.boundaries.clone().iter().enumerate() {
        let kill_after = index + 1;
        let at = format!("killed after step {kill_after} ({boundary})");
        let store = store(&format!("kill-{kill_after}"));
        let killed = match worker(agent, case, &store, &now, Some(kill_after), None).await {
            Ok(run) if run.stopped_at_boundary => run,
            Ok(_) => {
                report
                    .problems
                    .push(format!("{at}: the run ended before that step (it is not deterministic)"));
                continue;
            }
            Err(problem) => {
                report.problems.push(format!("{at}: {problem}"));
                continue;
            }
        };
        let Some(run_id) = killed.run_id.clone() else {
            report.problems.push(format!("{at}: the worker never said which run it started"));
            continue;
        };
        let resumed = match worker(agent, case, &store, &now, None, Some(&run_id)).await {
            Ok(run) => run,
            Err(problem) => {
                report.problems.push(format!("{at}, then resumed: {problem}"));
                continue;
            }
        };
        report.problems.extend(compare(&at, &clean_observed, &killed, &resumed));
    }
    report
}

/// What is wrong with a run resumed after a kill, beside the clean run.
fn compare(at: &str, clean: &Value, killed: &WorkerRun, resumed: &WorkerRun) -> Vec<String> {
    let mut problems = Vec::new();
    let done: HashSet<&str> = killed.commits.iter().map(String::as_str).collect();
    for step in &resumed.commits {
        if done.contains(step.as_str()) {
            let step = step.split_once(' ').map_or(step.as_str(), |(_, step)| step);
            problems.push(format!("{at}: step {step} ran again after the resume, though it had completed"));
        }
    }
    // A tool whose result was committed (`<run> tool:<name>:<call id>`) must not run again.
    let completed_calls: HashSet<(&str, &str)> = killed
        .commits
        .iter()
        .filter_map(|commit| {
            let (run, step) = commit.split_once(' ')?;
            let (_, call) = step.strip_prefix("tool:")?.split_once(':')?;
            Some((run, call))
        })
        .collect();
    for call in &resumed.dispatches {
        if completed_calls.contains(&(call.run.as_str(), call.call_id.as_str())) {
            problems.push(format!(
                "{at}: tool `{}` ran again for call {} after the resume, though its result was saved",
                call.tool, call.call_id
            ));
        }
    }
    let Some(observed) = &resumed.observed else {
        problems.push(format!("{at}: the resumed run ended without a result"));
        return problems;
    };
    for key in ["ended", "text", "state", "transcript"] {
        if observed[key] != clean[key] {
            let show = |value: &Value| match value {
                Value::String(text) => text.clone(),
                other => other.to_string(),
            };
            let mismatch =
                Mismatch { what: key.into(), expected: show(&clean[key]), actual: show(&observed[key]) };
            problems.push(format!("{at}: the resumed run differs from the clean one in its {mismatch}"));
        }
    }
    problems
}

/// Runs a chaos worker to its end (or to its boundary, where it is killed).
async fn worker(
    agent: &Path,
    case: &TestCase,
    store: &str,
    now: &jiff::ZonedDateTime,
    kill_after: Option<usize>,
    resume: Option<&str>,
) -> Result<WorkerRun, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find keel's own executable: {e}"))?;
    let mut command = tokio::process::Command::new(exe);
    command.arg("chaos-worker").arg(agent).arg(&case.file).arg("--store").arg(store);
    command.arg("--now").arg(now.to_string());
    if let Some(k) = kill_after {
        command.arg("--kill-after").arg(k.to_string());
    }
    if let Some(run) = resume {
        command.arg("--resume").arg(run);
    }
    command
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut child = command.spawn().map_err(|e| format!("cannot start a worker: {e}"))?;
    let stdout = child.stdout.take().ok_or("the worker has no stdout")?;
    let stderr = child.stderr.take().ok_or("the worker has no stderr")?;
    let errors = tokio::spawn(async move {
        let mut text = String::new();
        let _ =
            tokio::io::AsyncReadExt::read_to_string(&mut tokio::io::BufReader::new(stderr), &mut text).await;
        text
    });
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let mut run = WorkerRun::default();
    loop {
        let line = match tokio::time::timeout(WORKER_SILENCE, lines.next_line()).await {
            Ok(Ok(Some(line))) => line,
            Ok(Ok(None)) => break,
            Ok(Err(error)) => return Err(format!("cannot read the worker: {error}")),
            Err(_) => return Err(format!("the worker said nothing for {} s", WORKER_SILENCE.as_secs())),
        };
        let Ok(message) = serde_json::from_str::<Value>(&line) else { continue };
        if let Some(step) = message["commit"].as_str() {
            let run_id = message["run"].as_str().unwrap_or_default();
            run.commits.push(format!("{run_id} {step}"));
            // The case's own run commits first; a subagent's runs come after.
            if run.run_id.is_none() {
                run.run_id = Some(run_id.to_owned());
            }
        } else if let Some(dispatch) = message.get("dispatch") {
            let field = |key: &str| dispatch[key].as_str().unwrap_or_default().to_owned();
            run.dispatches.push(Dispatched {
                run: field("run"),
                tool: field("tool"),
                call_id: field("call_id"),
            });
        } else if message.get("boundary").is_some() {
            // The step is committed and nothing after it started: kill it as a crash would.
            run.stopped_at_boundary = true;
            child.start_kill().map_err(|e| format!("cannot kill the worker: {e}"))?;
            break;
        } else if let Some(observed) = message.get("observed") {
            run.observed = Some(observed.clone());
        }
    }
    let status = child.wait().await.map_err(|e| format!("cannot wait for the worker: {e}"))?;
    let errors = errors.await.unwrap_or_default();
    if !run.stopped_at_boundary && !status.success() {
        let errors = errors.trim();
        return Err(format!(
            "the worker failed ({status}){}",
            if errors.is_empty() { String::new() } else { format!(": {errors}") }
        ));
    }
    Ok(run)
}

/// `keel chaos-worker`: one run of a case, reported line by line on stdout.
pub(crate) fn chaos_worker(args: &WorkerArgs) -> std::io::Result<u8> {
    // One thread: when the probe's hook waits at the boundary, nothing else of the run moves.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let code = runtime.block_on(worker_run(args));
    runtime.shutdown_timeout(super::EXIT_GRACE);
    code
}

fn say(line: &Value) {
    let mut stdout = std::io::stdout().lock();
    // The parent reads each line as it comes: a line must be out before the run goes on.
    let _ = writeln!(stdout, "{line}").and_then(|()| stdout.flush());
}

async fn worker_run(args: &WorkerArgs) -> std::io::Result<u8> {
    let Some(spec) = load_spec(&args.agent)? else { return Ok(exit::INVALID_AGENT) };
    let loaded = keel_spec::load_tests(std::slice::from_ref(&args.case), None, keel_tools::tool_name);
    let Some(case) = loaded.cases.into_iter().next() else {
        for diagnostic in &loaded.diagnostics {
            eprintln!("{diagnostic}");
        }
        return Ok(exit::INVALID_AGENT);
    };
    let Some(store) = super::open_store(&args.store).await else { return Ok(exit::INVALID_AGENT) };
    let kill_after = args.kill_after;
    let commits = std::sync::atomic::AtomicUsize::new(0);
    let probe = Probe::new()
        .on_dispatch(|dispatch| {
            let run = dispatch.run_id.as_str();
            say(&json!({"dispatch": {"run": run, "tool": dispatch.tool, "call_id": dispatch.call_id}}));
        })
        .on_commit(move |run, step| {
            say(&json!({"commit": step.to_string(), "run": run.as_str()}));
            let n = commits.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            if Some(n) == kill_after {
                say(&json!({"boundary": n}));
                // Wait here to be killed: this is the only thread of the runtime.
                loop {
                    std::thread::park();
                }
            }
        });
    let setup = keel::testing::Setup { probe: Some(probe), now: args.now.clone() };
    let agent = match Agent::from_spec_with(spec_for(&spec, &case), store, &setup).await {
        Ok(agent) => agent,
        Err(error) => {
            eprintln!("error[{}]: {error}", error.code());
            return Ok(exit::INVALID_AGENT);
        }
    };
    let resume = match args.resume.as_deref().map(|id| keel::RunId::parse(id).ok_or(id)) {
        None => None,
        Some(Ok(run)) => Some(run),
        Some(Err(id)) => {
            eprintln!("error: not a run id: {id:?}");
            return Ok(2);
        }
    };
    let observed = keel::testing::drive_case(&agent, &case, SESSION, resume.as_ref()).await;
    match observed {
        Ok(observed) => {
            say(&json!({"observed": observed_json(&observed)}));
            Ok(exit::OK)
        }
        Err(failure) => {
            eprintln!("error[{}]: {}", failure.code, failure.message);
            Ok(exit::RUN_FAILED)
        }
    }
}

/// What a worker's run did, as the parent compares it.
fn observed_json(observed: &Observed) -> Value {
    let ended = match &observed.ended {
        keel::testing::Ended::Stopped(reason) => reason.as_str().to_owned(),
        keel::testing::Ended::Failed(failure) => format!("failed: {}: {}", failure.code, failure.message),
    };
    json!({
        "ended": ended,
        "text": observed.text,
        "state": observed.state,
        "transcript": keel::testing::describe_transcript(&observed.transcript),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(commits: &[&str], dispatches: &[(&str, &str, &str)], observed: Option<Value>) -> WorkerRun {
        WorkerRun {
            run_id: Some("run_a".into()),
            dispatches: dispatches
                .iter()
                .map(|(run, tool, call_id)| Dispatched {
                    run: (*run).into(),
                    tool: (*tool).into(),
                    call_id: (*call_id).into(),
                })
                .collect(),
            commits: commits.iter().map(|c| (*c).to_owned()).collect(),
            stopped_at_boundary: false,
            observed,
        }
    }

    #[test]
    fn a_completed_step_or_tool_run_again_after_a_resume_is_reported() {
        let clean = json!({"ended": "final", "text": "4", "state": null, "transcript": "user: \"hi\"\n"});
        let killed =
            run(&["run_a llm:turn:0", "run_a tool:count:call_0_0"], &[("run_a", "count", "call_0_0")], None);
        let good = run(&["run_a llm:turn:1"], &[], Some(clean.clone()));
        assert_eq!(compare("at", &clean, &killed, &good), Vec::<String>::new());

        let rerun = run(
            &["run_a tool:count:call_0_0", "run_a llm:turn:1"],
            &[("run_a", "count", "call_0_0"), ("run_sub", "count", "call_0_0")],
            Some(clean.clone()),
        );
        let problems = compare("at", &clean, &killed, &rerun);
        assert_eq!(
            problems,
            [
                "at: step tool:count:call_0_0 ran again after the resume, though it had completed",
                "at: tool `count` ran again for call call_0_0 after the resume, though its result was saved",
            ],
            "a subagent's call of the same id in its own run is not a re-run"
        );

        let mut other = clean.clone();
        other["text"] = json!("5");
        let differs = compare("at", &clean, &killed, &run(&[], &[], Some(other)));
        assert_eq!(
            differs,
            [
                "at: the resumed run differs from the clean one in its text:\n    expected: 4\n    actual:   5\n"
            ]
        );
    }
}
