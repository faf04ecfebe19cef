//! `keel chat`: an interactive session, one turn per line read, streamed like `keel run`.

use std::io::{IsTerminal, Write};

use keel::Agent;

use super::run::{Context, load_agent};
use super::{ChatArgs, RunArgs, exit};

pub(crate) fn chat(args: ChatArgs) -> std::io::Result<u8> {
    let session = args
        .session
        .clone()
        .unwrap_or_else(|| format!("chat-{}", jiff::Timestamp::now().strftime("%Y%m%d-%H%M%S")));
    let run_args = RunArgs {
        agent: args.agent.clone(),
        input: None,
        session,
        store: args.store.clone(),
        model: args.model.clone(),
        json: false,
        after: None,
        at: None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let code = runtime.block_on(async {
        let agent = match load_agent(&args.agent, args.model.as_deref(), &args.store).await? {
            Ok(agent) => agent,
            Err(code) => return Ok(code),
        };
        converse(&agent, &run_args).await
    });
    // A line read left pending at the prompt must not hold the exit up.
    runtime.shutdown_background();
    code
}

async fn converse(agent: &Agent, args: &RunArgs) -> std::io::Result<u8> {
    let terminal = std::io::stdin().is_terminal();
    let context = Context { agent, args, by: keel::who("keel chat") };
    // A turn nobody drives (its process died, or it was decided since) completes first, as
    // with `keel run`.
    if context.recover().await?.0 == 2 {
        return Ok(2);
    }
    let definition = agent.definition();
    eprintln!(
        "keel chat: agent `{}` ({}), session {}; /exit or Ctrl-D to leave, Ctrl-C stops a reply, /help",
        definition.name, definition.model, args.session
    );
    loop {
        if terminal {
            let mut stderr = std::io::stderr().lock();
            write!(stderr, "you> ")?;
            stderr.flush()?;
        }
        let ctrl_c = tokio::signal::ctrl_c();
        let line = tokio::select! {
            line = super::input::read_line() => line?,
            _ = ctrl_c => {
                eprintln!();
                return Ok(exit::INTERRUPTED);
            }
        };
        let Some(line) = line else {
            if terminal {
                eprintln!();
            }
            return Ok(exit::OK);
        };
        let line = line.trim();
        let line = match line {
            "" => continue,
            "/exit" | "/quit" => return Ok(exit::OK),
            "/help" => {
                eprintln!("{COMMANDS}");
                continue;
            }
            // `//...` sends the line from its second `/` on.
            _ if line.starts_with("//") => &line[1..],
            _ if is_command(line) => {
                eprintln!(
                    "unknown command {line}; /help lists them (begin a line with // to send it as text)"
                );
                continue;
            }
            _ => line,
        };
        let handle = match agent.run(&args.session, line) {
            Ok(handle) => handle,
            Err(failure) => {
                eprintln!("error[{}]: {}", failure.code, failure.message);
                continue;
            }
        };
        // Without a terminal nobody can decide a pause: the chat stops where `keel run` would.
        // A failed or stopped turn, or one cut with Ctrl-C, does not end the conversation.
        if context.follow_through(handle).await? == exit::AWAITING_INPUT {
            return Ok(exit::AWAITING_INPUT);
        }
    }
}

/// What `/help` prints.
const COMMANDS: &str = "/exit, /quit  leave (so does Ctrl-D)
/help        this list
Ctrl-C       stops the reply in progress
A line like /word is a command: begin it with // to send it as text.";

/// Whether a line is meant as a command (`/word`), not as text that happens to begin with a
/// slash (`/etc/hosts has what?`).
fn is_command(line: &str) -> bool {
    line.strip_prefix('/').is_some_and(|word| {
        !word.is_empty() && word.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    })
}
