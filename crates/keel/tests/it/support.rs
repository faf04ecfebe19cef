//! Shared helpers: agent directories in temporary folders, the binary, today's weekday.

use std::path::Path;

use assert_cmd::Command;

/// Writes `files` (relative path, content) under a fresh temporary directory.
pub fn agent_dir(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (path, content) in files {
        let path = dir.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, content).unwrap();
    }
    dir
}

/// Shell that sets `$keel` to the pid of the keel running a command tool (the tool's parent is
/// keel's supervisor of its process group; keel is that one's parent).
pub const KEEL_PID: &str = "read -r _ _ _ keel _ < /proc/$PPID/stat";

/// The `keel` binary, with logs quiet.
/// The `keel` binary the CLI tests run: the debug build cargo made for the tests, whose fault
/// points (`KEEL_FAULT`) the crash tests use.
pub fn keel_binary() -> std::path::PathBuf {
    assert_cmd::cargo::cargo_bin("keel")
}

/// The `keel` binary the `keel serve` tests run: `KEEL_TEST_BINARY` (the release build, say: the
/// binary that ships) or the debug build.
pub fn served_keel_binary() -> std::path::PathBuf {
    match std::env::var_os(keel_core::env::TEST_BINARY.name).filter(|path| !path.is_empty()) {
        Some(path) => {
            let path = std::path::PathBuf::from(path);
            assert!(path.is_file(), "KEEL_TEST_BINARY names {}, which is not a file", path.display());
            path
        }
        None => keel_binary(),
    }
}

pub fn keel() -> Command {
    let mut command = Command::new(keel_binary());
    command.env_remove("KEEL_STORE").env("KEEL_LOG", "error");
    command
}

/// `keel <args> --store sqlite:<dir>/keel.db`, run in `dir`: logs quiet, stdin closed, no
/// fault injected, no store or lease from the environment.
pub fn keel_on_store(dir: &Path, args: &[&str]) -> std::process::Command {
    keel_with_store(dir, args, &format!("sqlite:{}", dir.join("keel.db").display()))
}

/// [`keel_on_store`] with another store (`postgres://...`).
pub fn keel_with_store(dir: &Path, args: &[&str], store: &str) -> std::process::Command {
    let mut command = std::process::Command::new(crate::support::keel_binary());
    command
        .current_dir(dir)
        .env_remove("KEEL_FAULT")
        .env_remove("KEEL_STORE")
        .env_remove("KEEL_RUN_LEASE")
        .env("KEEL_LOG", "error")
        .args(args)
        .arg("--store")
        .arg(store)
        .stdin(std::process::Stdio::null());
    command
}

/// The repository's root (for the examples).
pub fn repo_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().parent().unwrap()
}

/// The weekdays a test running now may see (two around midnight).
pub fn weekdays_now() -> Vec<String> {
    let now = jiff::ZonedDateTime::now();
    let before = now.strftime("%A").to_string();
    let after = jiff::ZonedDateTime::now()
        .checked_add(jiff::Span::new().seconds(5))
        .unwrap()
        .strftime("%A")
        .to_string();
    vec![before, after]
}
