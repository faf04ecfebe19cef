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

/// The `keel` binary, with logs quiet.
pub fn keel() -> Command {
    let mut command = Command::cargo_bin("keel").unwrap();
    command.env_remove("KEEL_STORE").env("KEEL_LOG", "error");
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
