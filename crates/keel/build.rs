//! Puts the git revision keel is built from into `keel --version` (`BUILD_GIT_REVISION`):
//! `unknown` when the source is not a git checkout (a crates.io package, a tarball); packs the
//! executable's relative relocations where this machine supports it; and lays out the code keel
//! runs while it starts together, where the linker takes `startup.ld`.

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
    pack_relative_relocations();
    lay_out_startup_code();
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

/// Packs the executable's relative relocations (`-z pack-relative-relocs`, glibc's DT_RELR)
/// when the linker and the C library of this machine support both: keel is a PIE, and its
/// table of about 74,000 relative relocations (1.8 MB in the `dist` build, read at every start
/// and resident after) becomes 24 KB. Supported only from GNU ld 2.38 and glibc 2.36; a binary using it refuses to start
/// on an older glibc (the loader names the missing `GLIBC_ABI_DT_RELR` version), so it is
/// asked for only after a probe built with the flag has run here. Not for a cross build: the
/// probe could not run.
fn pack_relative_relocations() {
    let var = |name: &str| std::env::var(name).unwrap_or_default();
    let packed = var("CARGO_CFG_TARGET_OS") == "linux"
        && var("CARGO_CFG_TARGET_ENV") == "gnu"
        && var("TARGET") == var("HOST")
        && probe_runs(&["-Wl,-z,pack-relative-relocs"]);
    if packed {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
    // For the test that checks the binary: whether this build asked for it.
    println!("cargo:rustc-env=KEEL_RELOCS_PACKED={}", if packed { "yes" } else { "no" });
}

/// Links the executable with `startup.ld` (see its header), which puts the functions keel runs
/// while it starts into one output section before the rest of its code: an idle `keel serve`
/// then holds about 9 MB RSS instead of 17 (docs/deploy.md). GNU ld and LLD both take such a
/// script (`INSERT BEFORE .text` adds to their default layout); it is used after the probe has
/// linked and run with it. Not for a cross build (the probe could not run) nor a path holding a
/// comma (the linker driver's `-Wl,` would split it).
fn lay_out_startup_code() {
    let var = |name: &str| std::env::var(name).unwrap_or_default();
    let script = std::path::Path::new(&var("CARGO_MANIFEST_DIR")).join("startup.ld");
    println!("cargo:rerun-if-changed={}", script.display());
    let arg = format!("-Wl,-T,{}", script.display());
    // `KEEL_STARTUP_LAYOUT=off`: scripts/startup-layout.sh profiles a binary laid out as the
    // compiler emits it (valgrind names no function in a code section not called `.text`).
    println!("cargo:rerun-if-env-changed=KEEL_STARTUP_LAYOUT");
    // Optimized builds only: a debug build has many more sections to match, and its link took
    // 84 s with the script instead of 5 (CI links it for the tests).
    let laid_out = var("KEEL_STARTUP_LAYOUT") != "off"
        && var("PROFILE") == "release"
        && var("CARGO_CFG_TARGET_OS") == "linux"
        && var("TARGET") == var("HOST")
        && script.is_file()
        && !script.to_string_lossy().contains(',')
        && probe_runs(&[&arg]);
    if laid_out {
        println!("cargo:rustc-link-arg-bins={arg}");
    }
    // For the test that checks the binary: whether this build asked for it.
    println!("cargo:rustc-env=KEEL_STARTUP_LAID_OUT={}", if laid_out { "yes" } else { "no" });
}

/// Whether a small position-independent program with a relative relocation links with `flags`
/// through the linker driver Cargo uses (and the link arguments of `RUSTFLAGS`, such as another
/// `-fuse-ld`), and then runs and reads that pointer right.
fn probe_runs(flags: &[&str]) -> bool {
    let Some(out) = std::env::var_os("OUT_DIR").map(std::path::PathBuf::from) else { return false };
    let source = out.join("relr-probe.c");
    let program = out.join("relr-probe");
    // `pointer` holds an address: in a PIE it is a relative relocation the loader applies.
    let code = "static int answer = 42;\nint *volatile pointer = &answer;\nint main(void) { return *pointer == 42 ? 0 : 1; }\n";
    if std::fs::write(&source, code).is_err() {
        return false;
    }
    let linker = std::env::var("RUSTC_LINKER").unwrap_or_else(|_| "cc".to_owned());
    // `CARGO_ENCODED_RUSTFLAGS`: the flags separated by 0x1f; a link argument is `-C link-arg=X`
    // or `-Clink-arg=X`.
    let rustflags = std::env::var("CARGO_ENCODED_RUSTFLAGS").unwrap_or_default();
    let rustflags: Vec<&str> = rustflags.split('\x1f').collect();
    let link_args = rustflags.iter().enumerate().filter_map(|(at, flag)| {
        let codegen = match flag.strip_prefix("-C") {
            Some("") => rustflags.get(at + 1).copied()?,
            Some(codegen) => codegen,
            None => return None,
        };
        codegen.strip_prefix("link-arg=")
    });
    let built = Command::new(linker)
        .args(["-fPIE", "-pie", "-o"])
        .arg(&program)
        .arg(&source)
        .args(link_args)
        .args(flags)
        .output()
        .is_ok_and(|output| output.status.success());
    built && Command::new(&program).status().is_ok_and(|status| status.success())
}
