//! The workspace jail against hostile paths: `..`, absolute paths, symlinks out (also ones that
//! appear between calls, and one flipping while writes race through it), NUL bytes and odd
//! Unicode. Nothing outside the workspace is read, listed or written.

use std::os::unix::fs::symlink;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use keel_core::error::ErrorCode;
use keel_core::{SessionState, Tool, ToolContext, ToolError};
use keel_tools::workspace::{DeleteFile, EditFile, ListFiles, ReadFile, Stat, Workspace, WriteFile};
use serde_json::{Value, json};

const SECRET: &str = "TOP SECRET: the launch codes";

struct Fixture {
    _root: tempfile::TempDir,
    ws: std::path::PathBuf,
    outside: std::path::PathBuf,
    workspace: Workspace,
}

fn fixture() -> Fixture {
    let root = tempfile::tempdir().unwrap();
    let ws = root.path().join("ws");
    let outside = root.path().join("outside");
    std::fs::create_dir_all(ws.join("sub")).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("secret.txt"), SECRET).unwrap();
    std::fs::write(ws.join("notes.md"), "# Notes\nbuy tea\nbuy tea\n").unwrap();
    std::fs::write(ws.join("sub/deep.txt"), "deep").unwrap();
    symlink("../outside", ws.join("link-out")).unwrap();
    symlink("../outside/secret.txt", ws.join("link-secret")).unwrap();
    symlink(outside.join("secret.txt"), ws.join("abs-link")).unwrap();
    symlink("notes.md", ws.join("inner-link")).unwrap();
    let workspace = Workspace::open(&ws).unwrap();
    Fixture { _root: root, ws, outside, workspace }
}

fn ctx() -> ToolContext {
    ToolContext {
        run_id: keel_core::RunId::from_suffix("t"),
        session_id: keel_core::SessionId::new("s").unwrap(),
        call_id: "c".into(),
        idempotency_key: "k".into(),
        state: SessionState::new(Value::Null),
    }
}

async fn call(tool: &dyn Tool, input: Value) -> Result<Value, ToolError> {
    tool.call(input, &ctx()).await
}

fn no_leak(result: &Result<Value, ToolError>, what: &str) {
    let shown = match result {
        Ok(value) => value.to_string(),
        Err(error) => error.message.clone(),
    };
    assert!(!shown.contains("TOP SECRET"), "{what} leaked the secret: {shown}");
}

#[tokio::test]
async fn hostile_paths_never_reach_outside() {
    let f = fixture();
    let read = ReadFile::new(f.workspace.clone());
    let list = ListFiles::new(f.workspace.clone());
    let outside_abs = f.outside.join("secret.txt").display().to_string();
    let hostile: Vec<String> = [
        "../outside/secret.txt",
        "sub/../../outside/secret.txt",
        "./../outside/secret.txt",
        "..",
        "../",
        "sub/../..",
        "/etc/passwd",
        "/",
        "link-out/secret.txt",
        "link-secret",
        "abs-link",
        "link-out",
        "notes.md\0.txt",
        "\0",
        "notes\n.md",
        "..\\outside\\secret.txt",
        "%2e%2e/outside/secret.txt",
        "~/../outside/secret.txt",
        "sub/..\u{2215}..\u{2215}outside/secret.txt",
        "\u{202e}txt.terces/edistuo/..",
        "ＮＯＴＥＳ.md/../../outside/secret.txt",
    ]
    .into_iter()
    .map(str::to_owned)
    .chain([outside_abs.clone(), format!("{}/../outside/secret.txt", f.ws.display())])
    .collect();
    for path in &hostile {
        let result = call(&read, json!({ "path": path })).await;
        no_leak(&result, path);
        assert!(result.is_err(), "read_file {path:?} succeeded: {result:?}");
        let listed = call(&list, json!({ "path": path })).await;
        no_leak(&listed, path);
        if let Ok(value) = &listed {
            // Only a path that stays inside may list (none of these do).
            panic!("list_files {path:?} listed {value}");
        }
    }
    // The refusals say why.
    let up = call(&read, json!({"path": "../outside/secret.txt"})).await.unwrap_err();
    assert_eq!(up.code, ErrorCode::ToolRefused);
    assert!(up.message.contains("`..`"), "{}", up.message);
    let link = call(&read, json!({"path": "link-secret"})).await.unwrap_err();
    assert_eq!(link.code, ErrorCode::ToolRefused, "{}", link.message);
    assert!(link.message.contains("outside the workspace"), "{}", link.message);
    let absolute = call(&read, json!({"path": outside_abs})).await.unwrap_err();
    assert_eq!(absolute.code, ErrorCode::ToolRefused);
    let nul = call(&read, json!({"path": "notes.md\0.txt"})).await.unwrap_err();
    assert!(nul.message.contains("NUL"), "{}", nul.message);
}

#[tokio::test]
async fn inside_the_workspace_everything_works() {
    let f = fixture();
    let read = ReadFile::new(f.workspace.clone());
    let notes = call(&read, json!({"path": "notes.md"})).await.unwrap();
    assert_eq!(notes["content"], "# Notes\nbuy tea\nbuy tea\n");
    // A symlink that stays inside is followed; an absolute path inside is made relative.
    assert_eq!(call(&read, json!({"path": "inner-link"})).await.unwrap()["content"], notes["content"]);
    let absolute = f.ws.join("sub/deep.txt").display().to_string();
    assert_eq!(call(&read, json!({"path": absolute})).await.unwrap()["content"], "deep");
    let cut = call(&read, json!({"path": "notes.md", "max_bytes": 7})).await.unwrap();
    assert_eq!(cut["content"], "# Notes");
    assert!(cut["truncated"].is_string());

    let list = ListFiles::new(f.workspace.clone());
    let all = call(&list, json!({"recursive": true})).await.unwrap();
    let entries: Vec<(String, String)> = all["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["path"].as_str().unwrap().to_owned(), e["type"].as_str().unwrap().to_owned()))
        .collect();
    let expected = [
        ("abs-link", "symlink"),
        ("inner-link", "symlink"),
        ("link-out", "symlink"),
        ("link-secret", "symlink"),
        ("notes.md", "file"),
        ("sub", "dir"),
        ("sub/deep.txt", "file"),
    ];
    assert_eq!(
        entries,
        expected.map(|(p, t)| (p.to_owned(), t.to_owned())),
        "symlinks are listed, not followed"
    );

    let write = WriteFile::new(f.workspace.clone());
    let written = call(&write, json!({"path": "new/dir/todo.md", "content": "ship it"})).await.unwrap();
    assert_eq!(written["bytes"], 7);
    assert_eq!(std::fs::read_to_string(f.ws.join("new/dir/todo.md")).unwrap(), "ship it");

    let edit = EditFile::new(f.workspace.clone());
    let twice =
        call(&edit, json!({"path": "notes.md", "old_text": "buy tea", "new_text": "buy coffee"})).await;
    assert!(twice.unwrap_err().message.contains("occurs 2 times"));
    let missing = call(&edit, json!({"path": "notes.md", "old_text": "buy milk", "new_text": "x"})).await;
    assert!(missing.unwrap_err().message.contains("not found"));
    let all = call(
        &edit,
        json!({"path": "notes.md", "old_text": "buy tea", "new_text": "buy coffee", "replace_all": true}),
    )
    .await
    .unwrap();
    assert_eq!(all["replacements"], 2);
    assert_eq!(std::fs::read_to_string(f.ws.join("notes.md")).unwrap(), "# Notes\nbuy coffee\nbuy coffee\n");
    let leftovers: Vec<_> = std::fs::read_dir(&f.ws)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "no temporary files are left behind");
}

#[tokio::test]
async fn writes_through_links_and_upward_paths_are_refused() {
    let f = fixture();
    let write = WriteFile::new(f.workspace.clone());
    let edit = EditFile::new(f.workspace.clone());
    for path in
        ["../outside/pwned.txt", "link-out/pwned.txt", "/tmp/keel-pwned.txt", "link-secret", "abs-link"]
    {
        let edited = call(&edit, json!({"path": path, "old_text": "TOP", "new_text": "pwned"})).await;
        assert!(edited.is_err(), "edit_file {path} succeeded");
        no_leak(&edited, path);
    }
    for path in ["../outside/pwned.txt", "link-out/pwned.txt", "/tmp/keel-pwned.txt"] {
        let result = call(&write, json!({"path": path, "content": "pwned"})).await;
        let error = result.unwrap_err();
        assert_eq!(error.code, ErrorCode::ToolRefused, "write_file {path}: {}", error.message);
    }
    // Writing to a symlink replaces the link (a new file takes its place in the workspace);
    // its target outside is never opened.
    for path in ["link-secret", "abs-link"] {
        call(&write, json!({"path": path, "content": "replaced"})).await.unwrap();
        assert!(!std::fs::symlink_metadata(f.ws.join(path)).unwrap().file_type().is_symlink());
    }
    assert_eq!(std::fs::read_to_string(f.outside.join("secret.txt")).unwrap(), SECRET);
    assert!(!f.outside.join("pwned.txt").exists());
    assert!(!Path::new("/tmp/keel-pwned.txt").exists());

    // A symlink that appears after the workspace was opened (after any check a tool could
    // have made) leads nowhere either.
    symlink(&f.outside, f.ws.join("later")).unwrap();
    let later = call(&write, json!({"path": "later/pwned.txt", "content": "pwned"})).await.unwrap_err();
    assert_eq!(later.code, ErrorCode::ToolRefused, "{}", later.message);
    assert!(!f.outside.join("pwned.txt").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_flipping_to_a_symlink_while_writes_race_never_lets_one_out() {
    let f = fixture();
    let flip = f.ws.join("flip");
    std::fs::create_dir(&flip).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let flipper = {
        let (stop, flip, outside) = (stop.clone(), flip.clone(), f.outside.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let _ = std::fs::remove_dir_all(&flip);
                let _ = std::fs::remove_file(&flip);
                let _ = symlink(&outside, &flip);
                std::thread::yield_now();
                let _ = std::fs::remove_file(&flip);
                let _ = std::fs::create_dir(&flip);
            }
        })
    };
    let write = WriteFile::new(f.workspace.clone());
    let mut inside = 0;
    for i in 0..300 {
        if call(&write, json!({"path": format!("flip/f{i}.txt"), "content": "x"})).await.is_ok() {
            inside += 1;
        }
    }
    stop.store(true, Ordering::Relaxed);
    flipper.join().unwrap();
    let escaped: Vec<_> = std::fs::read_dir(&f.outside)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name != "secret.txt")
        .collect();
    assert!(escaped.is_empty(), "files escaped the workspace: {escaped:?} ({inside} writes landed inside)");
}

/// Runs a file tool call with a deadline: a call that blocks is a failure, not a hung test.
async fn call_within(tool: &dyn Tool, input: Value) -> Result<Value, ToolError> {
    tokio::time::timeout(std::time::Duration::from_secs(5), call(tool, input))
        .await
        .expect("the file tool blocked instead of answering")
}

#[tokio::test]
async fn a_fifo_or_a_device_is_refused_at_once_and_never_waited_on() {
    let f = fixture();
    assert!(std::process::Command::new("mkfifo").arg(f.ws.join("pipe")).status().unwrap().success());
    let read = call_within(&ReadFile::new(f.workspace.clone()), json!({"path": "pipe"})).await.unwrap_err();
    assert_eq!(read.code, ErrorCode::ToolRefused, "{}", read.message);
    assert!(read.message.contains("pipe is not a regular file"), "{}", read.message);
    let edit = call_within(
        &EditFile::new(f.workspace.clone()),
        json!({"path": "pipe", "old_text": "a", "new_text": "b"}),
    )
    .await
    .unwrap_err();
    assert_eq!(edit.code, ErrorCode::ToolRefused, "{}", edit.message);
    // A listing shows it for what it is, without opening it.
    let listed = call_within(&ListFiles::new(f.workspace.clone()), json!({})).await.unwrap();
    assert!(
        listed["entries"].as_array().unwrap().contains(&json!({"path": "pipe", "type": "other"})),
        "{listed}"
    );
    // A Unix socket too.
    let _socket = std::os::unix::net::UnixListener::bind(f.ws.join("sock")).unwrap();
    let read = call_within(&ReadFile::new(f.workspace.clone()), json!({"path": "sock"})).await.unwrap_err();
    assert!(
        read.message.contains("not a regular file") || read.message.contains("sock:"),
        "{}",
        read.message
    );
}

#[tokio::test]
async fn edit_file_refuses_a_huge_file_without_reading_it() {
    let f = fixture();
    // 600 MB that take no disk: a sparse file.
    let huge = std::fs::File::create(f.ws.join("huge.log")).unwrap();
    huge.set_len(600 * 1024 * 1024).unwrap();
    let started = std::time::Instant::now();
    let error = call_within(
        &EditFile::new(f.workspace.clone()),
        json!({"path": "huge.log", "old_text": "x", "new_text": "y"}),
    )
    .await
    .unwrap_err();
    assert_eq!(
        error.message,
        "huge.log is 629145600 bytes; edit_file edits files up to 10485760 bytes (10 MiB): use write_file for \
         the whole content, or shell"
    );
    // Refused from its size: reading 600 MB of zeros would take far longer than this.
    assert!(started.elapsed() < std::time::Duration::from_secs(2), "{:?}", started.elapsed());
    // read_file reads only what it returns.
    let read = call_within(&ReadFile::new(f.workspace.clone()), json!({"path": "huge.log", "max_bytes": 16}))
        .await
        .unwrap();
    assert_eq!(read["size"], 629_145_600);
    assert_eq!(read["content"].as_str().unwrap().len(), 16);
}

#[tokio::test]
async fn a_hard_link_is_read_as_the_file_it_is_but_never_written_through() {
    // docs/tools.md says so: no path jail can tell a hard link from the file.
    let f = fixture();
    std::fs::hard_link(f.outside.join("secret.txt"), f.ws.join("linked.txt")).unwrap();
    let read = call(&ReadFile::new(f.workspace.clone()), json!({"path": "linked.txt"})).await.unwrap();
    assert_eq!(read["content"], SECRET);
    call(&WriteFile::new(f.workspace.clone()), json!({"path": "linked.txt", "content": "replaced"}))
        .await
        .unwrap();
    call(
        &EditFile::new(f.workspace.clone()),
        json!({"path": "linked.txt", "old_text": "replaced", "new_text": "edited"}),
    )
    .await
    .unwrap();
    assert_eq!(std::fs::read_to_string(f.ws.join("linked.txt")).unwrap(), "edited");
    assert_eq!(
        std::fs::read_to_string(f.outside.join("secret.txt")).unwrap(),
        SECRET,
        "written through the link"
    );
}

#[tokio::test]
async fn stat_and_delete_stay_inside_and_never_follow_a_link_out() {
    let f = fixture();
    let stat = Stat::new(f.workspace.clone());
    let delete = DeleteFile::new(f.workspace.clone());

    let notes = call(&stat, json!({ "path": "notes.md" })).await.unwrap();
    assert_eq!((notes["type"].as_str(), notes["size"].as_u64()), (Some("file"), Some(24)), "{notes}");
    assert!(notes["modified"].as_str().unwrap().ends_with('Z'), "{notes}");
    let sub = call(&stat, json!({ "path": "sub" })).await.unwrap();
    assert_eq!((sub["type"].as_str(), sub["entries"].as_u64()), (Some("dir"), Some(1)), "{sub}");
    // A link out is described, not followed: no size, nothing of the file behind it.
    let link = call(&stat, json!({ "path": "link-secret" })).await.unwrap();
    assert_eq!(link["type"], "symlink", "{link}");
    assert!(link.get("size").is_none(), "{link}");
    assert_eq!(
        call(&stat, json!({ "path": "gone.txt" })).await.unwrap(),
        json!({ "path": "gone.txt", "exists": false })
    );
    for path in ["../outside/secret.txt", "link-out/secret.txt", "/etc/passwd", "sub/../../outside"] {
        let result = call(&stat, json!({ "path": path })).await;
        assert!(result.is_err(), "stat {path:?}: {result:?}");
    }

    // Deleting: never outside, never through a link, never the workspace itself.
    for path in ["../outside/secret.txt", "link-out/secret.txt", "/", ".", "", "sub/../.."] {
        let result = call(&delete, json!({ "path": path, "recursive": true })).await;
        assert!(result.is_err(), "delete_file {path:?}: {result:?}");
    }
    let root = call(&delete, json!({ "path": "." })).await.unwrap_err();
    assert_eq!(root.code, ErrorCode::ToolRefused);
    assert!(f.outside.join("secret.txt").exists() && f.ws.exists());
    // A link is removed itself; what it points to stays.
    let removed = call(&delete, json!({ "path": "link-out" })).await.unwrap();
    assert_eq!(removed, json!({ "path": "link-out", "deleted": true, "type": "symlink" }));
    assert!(f.outside.join("secret.txt").exists());
    assert!(std::fs::symlink_metadata(f.ws.join("link-out")).is_err());

    // A directory with content needs `recursive`.
    let full = call(&delete, json!({ "path": "sub" })).await.unwrap_err();
    assert!(full.message.contains("recursive: true"), "{}", full.message);
    assert!(f.ws.join("sub/deep.txt").exists());
    let gone = call(&delete, json!({ "path": "sub", "recursive": true })).await.unwrap();
    assert_eq!(gone["type"], "dir");
    assert!(!f.ws.join("sub").exists());
    // A file, then the same delete again (a replay after a crash): no error, nothing there.
    assert_eq!(call(&delete, json!({ "path": "notes.md" })).await.unwrap()["deleted"], true);
    let again = call(&delete, json!({ "path": "notes.md" })).await.unwrap();
    assert_eq!(again["deleted"], false, "{again}");
}

#[tokio::test]
async fn a_recursive_delete_does_not_follow_a_link_inside_the_tree() {
    let f = fixture();
    // sub/escape -> ../outside: deleting sub with its content removes the link, not outside.
    symlink("../../outside", f.ws.join("sub/escape")).unwrap();
    let delete = DeleteFile::new(f.workspace.clone());
    call(&delete, json!({ "path": "sub", "recursive": true })).await.unwrap();
    assert_eq!(std::fs::read_to_string(f.outside.join("secret.txt")).unwrap(), SECRET);
}
