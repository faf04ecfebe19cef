//! Puts the git revision keel is built from into `keel --version` (`BUILD_GIT_REVISION`):
//! `unknown` when the source is not a git checkout (a crates.io package, a tarball).

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git").args(args).output().ok()?;
    output.status.success().then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

fn main() {
    let revision = match git(&["rev-parse", "--short=12", "HEAD"]) {
        Some(revision) => {
            let dirty =
                git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
            if dirty { format!("{revision}-dirty") } else { revision }
        }
        None => "unknown".to_owned(),
    };
    println!("cargo:rustc-env=BUILD_GIT_REVISION={revision}");
    // Built again when HEAD moves (a commit, a checkout) or the index changes (dirty or not).
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        let dir = std::path::Path::new(&dir);
        for file in ["HEAD", "index"] {
            println!("cargo:rerun-if-changed={}", dir.join(file).display());
        }
        if let Some(reference) = git(&["symbolic-ref", "-q", "HEAD"]) {
            println!("cargo:rerun-if-changed={}", dir.join(reference).display());
        }
    }
}
