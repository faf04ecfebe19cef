//! Lines from stdin, read by one thread for the whole process.
//!
//! A prompt may be abandoned (its approval was decided in another process while it waited):
//! with a blocking read per prompt, the abandoned read would still swallow the next line the
//! person types. One reader feeding a channel lets a prompt stop waiting without losing
//! anything, and tells the lines typed before a given moment from those typed after.

use std::sync::OnceLock;

use tokio::sync::mpsc;

type Lines = mpsc::UnboundedReceiver<std::io::Result<String>>;

fn lines() -> &'static tokio::sync::Mutex<Lines> {
    static LINES: OnceLock<tokio::sync::Mutex<Lines>> = OnceLock::new();
    LINES.get_or_init(|| {
        let (sender, receiver) = mpsc::unbounded_channel();
        // Detached: it ends with the process, or at the end of stdin.
        let spawned = std::thread::Builder::new().name("keel-stdin".into()).spawn(move || {
            let stdin = std::io::stdin();
            loop {
                let mut line = String::new();
                match stdin.read_line(&mut line) {
                    Ok(0) => break,
                    Ok(_) => {
                        if sender.send(Ok(line)).is_err() {
                            break;
                        }
                    }
                    Err(error) => {
                        let _ = sender.send(Err(error));
                        break;
                    }
                }
            }
        });
        if let Err(error) = spawned {
            let (sender, receiver) = mpsc::unbounded_channel();
            let _ = sender.send(Err(error));
            return tokio::sync::Mutex::new(receiver);
        }
        tokio::sync::Mutex::new(receiver)
    })
}

/// The next line of stdin (with its line ending); `None` at its end.
pub(crate) async fn read_line() -> std::io::Result<Option<String>> {
    lines().lock().await.recv().await.transpose()
}

/// The lines already typed and not read yet: what a person typed before now.
pub(crate) async fn typed_already() -> Vec<String> {
    let mut receiver = lines().lock().await;
    let mut typed = Vec::new();
    while let Ok(Ok(line)) = receiver.try_recv() {
        typed.push(line);
    }
    typed
}
