//! House rules, checked as tests: module docs everywhere, no ignored or should-panic tests, every
//! error code documented.

use std::path::{Path, PathBuf};

use crate::support::repo_root;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn all_rust_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    for crate_dir in std::fs::read_dir(repo_root().join("crates")).unwrap() {
        rust_files(&crate_dir.unwrap().path(), &mut files);
    }
    rust_files(&repo_root().join("examples"), &mut files);
    files
}

#[test]
fn every_module_says_what_it_is_for() {
    let missing: Vec<String> = all_rust_files()
        .into_iter()
        .filter(|path| !std::fs::read_to_string(path).unwrap().trim_start().starts_with("//!"))
        .map(|path| path.strip_prefix(repo_root()).unwrap().display().to_string())
        .collect();
    assert!(missing.is_empty(), "files without a `//!` module doc: {missing:#?}");
}

#[test]
fn no_ignored_or_should_panic_tests() {
    let banned = [concat!("#[", "ignore"), concat!("#[", "should_panic")];
    for path in all_rust_files() {
        let text = std::fs::read_to_string(&path).unwrap();
        for pattern in banned {
            assert!(
                !text.contains(pattern),
                "{} uses {pattern}]: assert today's behaviour instead",
                path.display()
            );
        }
    }
}

#[test]
fn every_error_code_is_documented() {
    let docs = std::fs::read_to_string(repo_root().join("docs/errors.md")).unwrap();
    for code in keel::ErrorCode::ALL {
        assert!(docs.contains(&format!("## {code}\n")), "docs/errors.md has no section for {code}");
    }
}
