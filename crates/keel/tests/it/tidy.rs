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

/// `KEEL_...` strings in non-test code: error codes are `ErrorCode`s, environment variables come
/// from `keel_core::env`; no code names a variable by a string of its own.
#[test]
fn every_environment_variable_is_declared_once_and_documented() {
    let docs = std::fs::read_to_string(repo_root().join("docs/configuration.md")).unwrap();
    for var in keel_core::env::ALL {
        assert!(
            docs.contains(&format!("| `{}` |", var.name)),
            "docs/configuration.md has no row for {}",
            var.name
        );
    }
    for name in docs
        .split('`')
        .filter(|word| word.starts_with("KEEL_") && word.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
    {
        assert!(
            keel_core::env::find(name).is_some(),
            "docs/configuration.md lists {name}, which keel does not declare"
        );
    }
    let mut sources = Vec::new();
    for crate_dir in std::fs::read_dir(repo_root().join("crates")).unwrap() {
        let crate_dir = crate_dir.unwrap().path();
        for dir in ["src", "benches"] {
            if crate_dir.join(dir).is_dir() {
                rust_files(&crate_dir.join(dir), &mut sources);
            }
        }
    }
    let declared_in = repo_root().join("crates/core/src/env.rs");
    for path in sources.into_iter().filter(|path| *path != declared_in) {
        let text = std::fs::read_to_string(&path).unwrap();
        // Unit tests inside a source file may spell names out.
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        for literal in code.split('"').skip(1).step_by(2) {
            let is_name = literal.starts_with("KEEL_")
                && literal.len() > 5
                && literal.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
            if is_name && keel::ErrorCode::parse(literal).is_none() {
                panic!(
                    "{} names the environment variable {literal} by a string: use its constant in keel_core::env{}",
                    path.display(),
                    if keel_core::env::find(literal).is_none() { " (declare it there first)" } else { "" }
                );
            }
        }
    }
}

/// The keys and folders `KEEL_SPEC_UNSUPPORTED` refuses are the ones docs/errors.md lists.
#[test]
fn the_unsupported_spec_keys_are_the_documented_ones() {
    let docs = std::fs::read_to_string(repo_root().join("docs/errors.md")).unwrap();
    let section = docs.split("## KEEL_SPEC_UNSUPPORTED\n").nth(1).unwrap().split("\n## ").next().unwrap();
    let listed: Vec<&str> = section.split('`').skip(1).step_by(2).collect();
    let expected: Vec<String> = keel_spec::UNSUPPORTED_KEYS.iter().map(|k| (*k).to_owned()).collect();
    for item in &expected {
        assert!(
            listed.contains(&item.as_str()),
            "docs/errors.md does not list `{item}` under KEEL_SPEC_UNSUPPORTED"
        );
    }
    // The cargo features a spec can need are listed too (the others, `postgres` and `otlp`, are
    // not a spec's to ask for).
    let features: Vec<&str> = keel::features::FEATURES.iter().map(|(name, _)| *name).collect();
    for feature in ["mcp", "knowledge", "js"] {
        assert!(features.contains(&feature), "`{feature}` is no longer a cargo feature");
        assert!(
            listed.contains(&feature),
            "docs/errors.md does not list the feature `{feature}` under KEEL_SPEC_UNSUPPORTED"
        );
    }
    let other_words = ["approvals", "--no-default-features", "/mcp"];
    for item in listed.iter().filter(|i| !i.contains(' ') && !i.starts_with("KEEL")) {
        assert!(
            expected.iter().any(|e| e == item) || features.contains(item) || other_words.contains(item),
            "docs/errors.md lists `{item}` under KEEL_SPEC_UNSUPPORTED, which keel supports"
        );
    }
}
