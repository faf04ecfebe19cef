//! `keel build`: the native artifact serving from an empty directory with its agent's files
//! gone, the docker context run as its Dockerfile says in a root holding only the image's
//! files, and the agents each target refuses.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::json;

use crate::serve::{Served, client, read_sse};
use crate::support::{agent_dir, repo_root, served_keel_binary};

/// A mock agent with instructions in a file and a command tool of its own (a script beside it).
const SHOUTER: &[(&str, &str)] = &[
    (
        "agent.yaml",
        "name: shouter\nmodel: mock\nmock:\n  script:\n    - tool_calls: [{ name: shout, input: { text: ahoy } }]\n    - text: 'The tool said: {{last_tool_output}}'\n",
    ),
    ("instructions.md", "Shout back.\n"),
    (
        "tools/shout.toml",
        "description = \"Shouts\"\ncommand = [\"./tools/shout.sh\"]\n[input_schema]\ntype = \"object\"\nrequired = [\"text\"]\nproperties = { text = { type = \"string\" } }\n",
    ),
    ("tools/shout.sh", "#!/bin/sh\ntr a-z A-Z\n"),
];

fn make_executable(path: &Path) {
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
}

/// `keel build <agent> <args>`, run by the binary the serve tests use (the release build in CI).
fn keel_build(agent: &Path, args: &[&str], home: &Path) -> std::process::Output {
    Command::new(served_keel_binary())
        .arg("build")
        .arg(agent)
        .args(args)
        .env("HOME", home)
        .env_remove("XDG_CACHE_HOME")
        .env("KEEL_LOG", "error")
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The final text of a `POST /chat` turn.
async fn chat(served: &Served, token: Option<&str>, session: &str, input: &str) -> (u16, String) {
    let mut request = client().post(served.url("/chat")).json(&json!({"sessionId": session, "input": input}));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    if status != 200 {
        return (status, response.text().await.unwrap());
    }
    let events = read_sse(response).await;
    let done = events.iter().rev().map(|event| event.json()).find(|event| event["type"] == "run.done");
    (status, done.map(|event| event["text"].as_str().unwrap_or_default().to_owned()).unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_native_build_serves_its_agent_from_an_empty_directory_with_the_agent_gone() {
    let agent = agent_dir(SHOUTER);
    make_executable(&agent.path().join("tools/shout.sh"));
    let out = tempfile::tempdir().unwrap();
    let home = tempfile::tempdir().unwrap();
    let output = keel_build(agent.path(), &["--out", out.path().to_str().unwrap()], home.path());
    assert!(output.status.success(), "{output:?}");
    let artifact = out.path().join("shouter");
    let said = text(&output.stdout);
    assert!(said.starts_with(&format!("built {}", artifact.display())), "{said}");
    assert!(said.contains("agent `shouter`: 4 files"), "{said}");
    assert!(said.contains(&format!("{} run \"hello\"", artifact.display())), "how to run it: {said}");
    // Nothing of the agent's folder is left: the executable carries it.
    drop(agent);

    let empty = tempfile::tempdir().unwrap();
    let mut command = Command::new(&artifact);
    command.args(["--port", "0"]).current_dir(empty.path()).env("HOME", home.path()).env("KEEL_LOG", "error");
    for name in ["HOST", "PORT", "KEEL_STORE", "KEEL_API_TOKEN", "XDG_CACHE_HOME"] {
        command.env_remove(name);
    }
    let served = Served::spawn(command);
    let health = client().get(served.url("/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let (status, answer) = chat(&served, None, "s1", "shout ahoy").await;
    assert_eq!(
        (status, answer.as_str()),
        (200, r#"The tool said: {"TEXT":"AHOY"}"#),
        "the agent's own script ran"
    );
    drop(served);
    // Its state is where `keel serve` keeps it, in the directory it runs in.
    assert!(empty.path().join(".keel/keel.db").is_file());

    // `run` works on the carried agent too, and the unpacked copy of the first start is reused.
    let run = Command::new(&artifact)
        .args(["run", "again"])
        .current_dir(empty.path())
        .env("HOME", home.path())
        .env_remove("XDG_CACHE_HOME")
        .env("KEEL_LOG", "error")
        .output()
        .unwrap();
    assert!(run.status.success(), "{run:?}");
    assert!(text(&run.stdout).contains(r#"The tool said: {"TEXT":"AHOY"}"#), "{run:?}");
    let copies: Vec<_> = std::fs::read_dir(home.path().join(".cache/keel/agents")).unwrap().collect();
    assert_eq!(copies.len(), 1, "one unpacked copy, reused: {copies:?}");

    // A damaged artifact says so, with a fresh cache (nothing unpacked to fall back on).
    let bytes = std::fs::read(&artifact).unwrap();
    let damaged = out.path().join("damaged");
    let mut broken = bytes.clone();
    let at = broken.len() - 56 - 20;
    broken[at] ^= 0xff;
    std::fs::write(&damaged, broken).unwrap();
    make_executable(&damaged);
    let fresh = tempfile::tempdir().unwrap();
    let run = Command::new(&damaged)
        .args(["run", "hi"])
        .current_dir(empty.path())
        .env("HOME", fresh.path())
        .env_remove("XDG_CACHE_HOME")
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(1), "{run:?}");
    assert!(text(&run.stderr).contains("is damaged"), "{run:?}");
}

/// What a Dockerfile of `keel build --target docker` says, read as Docker would.
#[derive(Default, Debug)]
struct Image {
    /// (source in the context, destination, owner) of each `COPY`.
    copies: Vec<(String, String, Option<String>)>,
    user: Option<String>,
    workdir: Option<String>,
    env: Vec<(String, String)>,
    expose: Vec<String>,
    healthcheck: Vec<String>,
    entrypoint: Vec<String>,
}

fn read_dockerfile(text: &str) -> Image {
    let mut image = Image::default();
    let mut lines = text.lines().filter(|line| !line.trim().is_empty() && !line.starts_with('#'));
    assert_eq!(lines.next(), Some("FROM scratch"), "{text}");
    for line in lines {
        let (instruction, rest) = line.split_once(' ').unwrap();
        match instruction {
            "COPY" => {
                let mut words: Vec<&str> = rest.split_whitespace().collect();
                let owner = words.first().and_then(|w| w.strip_prefix("--chown=")).map(str::to_owned);
                if owner.is_some() {
                    words.remove(0);
                }
                assert_eq!(words.len(), 2, "{line}");
                image.copies.push((words[0].to_owned(), words[1].to_owned(), owner));
            }
            "USER" => image.user = Some(rest.to_owned()),
            "WORKDIR" => image.workdir = Some(rest.to_owned()),
            "ENV" => {
                for pair in rest.split_whitespace() {
                    let (key, value) = pair.split_once('=').unwrap();
                    image.env.push((key.to_owned(), value.to_owned()));
                }
            }
            "EXPOSE" => image.expose.push(rest.to_owned()),
            "HEALTHCHECK" => {
                let command = rest.split_once("CMD ").unwrap().1;
                image.healthcheck = serde_json::from_str(command).unwrap();
            }
            "ENTRYPOINT" => image.entrypoint = serde_json::from_str(rest).unwrap(),
            other => panic!("an instruction this test does not know: {other}"),
        }
    }
    image
}

/// Copies the context's `source` to `root`'s `destination` as `COPY` does (files hard-linked,
/// they are only read), owned by `owner` when given.
fn copy_into(source: &Path, destination: &Path, owner: Option<(u32, u32)>) {
    std::fs::create_dir_all(destination).unwrap();
    for item in walk(source) {
        let target = destination.join(item.strip_prefix(source).unwrap());
        if item.is_dir() {
            std::fs::create_dir_all(&target).unwrap();
        } else {
            std::fs::create_dir_all(target.parent().unwrap()).unwrap();
            std::fs::hard_link(&item, &target).unwrap();
        }
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(&target, Some(uid), Some(gid)).unwrap();
        }
    }
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(destination, Some(uid), Some(gid)).unwrap();
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for item in std::fs::read_dir(dir).unwrap() {
        let path = item.unwrap().path();
        found.push(path.clone());
        if path.is_dir() && !path.is_symlink() {
            found.extend(walk(&path));
        }
    }
    found
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn ids(text: &str) -> (u32, u32) {
    let (uid, gid) = text.split_once(':').unwrap();
    (uid.parse().unwrap(), gid.parse().unwrap())
}

/// `command` run as the image would run it: in `root` as the root directory, in `workdir`, as
/// `user`, with only `env` (a chroot: the process sees nothing but the image's files).
fn in_image(root: &Path, image: &Image, env: &[(String, String)], command: &[String]) -> Command {
    let (uid, gid) = ids(image.user.as_deref().unwrap());
    let mut run = Command::new("unshare");
    run.env_clear().envs(env.iter().map(|(k, v)| (k, v)));
    run.arg(format!("--root={}", root.display()));
    run.arg(format!("--wd={}", image.workdir.as_deref().unwrap()));
    run.args(["--setgid", &gid.to_string(), "--setuid", &uid.to_string()]);
    run.args(command);
    run
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_docker_build_runs_as_its_dockerfile_says_in_a_root_holding_only_the_image() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test makes a root directory for the image: run it as root"
    );
    let out = tempfile::tempdir().unwrap();
    let home = tempfile::tempdir().unwrap();
    let helpdesk = repo_root().join("examples/helpdesk");
    let output =
        keel_build(&helpdesk, &["--target", "docker", "--out", out.path().to_str().unwrap()], home.path());
    assert!(output.status.success(), "{output:?}");
    let said = text(&output.stdout);
    assert!(said.contains("docker build -t helpdesk"), "{said}");
    assert!(said.contains("-e KEEL_API_TOKEN="), "secrets go in with -e: {said}");

    let image = read_dockerfile(&std::fs::read_to_string(out.path().join("Dockerfile")).unwrap());
    assert_eq!(image.expose, ["3000"]);
    assert!(image.env.contains(&("HOST".into(), "0.0.0.0".into())), "{image:?}");
    assert!(image.env.contains(&("PORT".into(), "3000".into())), "{image:?}");
    let (uid, _) = ids(image.user.as_deref().unwrap());
    assert_ne!(uid, 0, "the image does not run as root");

    let root = tempfile::tempdir().unwrap();
    for (source, destination, owner) in &image.copies {
        let destination = root.path().join(destination.trim_start_matches('/'));
        copy_into(&out.path().join(source), &destination, owner.as_deref().map(ids));
    }
    // Docker gives every container these devices (a static keel reads /dev/random and
    // /dev/urandom for its first random numbers).
    std::fs::create_dir_all(root.path().join("dev")).unwrap();
    for (name, minor) in [("null", 3), ("random", 8), ("urandom", 9)] {
        let made = Command::new("mknod")
            .args(["-m", "666"])
            .arg(root.path().join("dev").join(name))
            .args(["c", "1", &minor.to_string()])
            .status()
            .unwrap();
        assert!(made.success(), "mknod /dev/{name}");
    }
    // Nothing but the executable, the libraries it loads, certificates and the user's files.
    let mut files: Vec<String> = walk(root.path())
        .into_iter()
        .filter(|path| path.is_file() && !path.starts_with(root.path().join("dev")))
        .map(|path| path.strip_prefix(root.path()).unwrap().display().to_string())
        .collect();
    files.sort();
    for file in &files {
        let allowed = file == "agent"
            || file == "etc/passwd"
            || file == "etc/group"
            || file == "etc/ssl/certs/ca-certificates.crt"
            || file.contains(".so");
        assert!(allowed, "the image holds {file}, which it does not need: {files:?}");
    }
    assert!(!files.iter().any(|file| file.ends_with("/sh") || file.contains("python")), "{files:?}");

    let token = "a-long-random-token-for-the-image-test";
    let port = free_port();
    let mut env = image.env.clone();
    env.retain(|(key, _)| key != "PORT");
    env.push(("PORT".into(), port.to_string()));
    env.push(("KEEL_API_TOKEN".into(), token.into()));
    env.push(("KEEL_LOG".into(), "error".into()));
    let served = Served::spawn(in_image(root.path(), &image, &env, &image.entrypoint));
    // HOST=0.0.0.0: listening on every address, so a token is required, and given.
    assert!(served.url("/").contains(&port.to_string()));
    let health = client().get(served.url("/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let (status, _) = chat(&served, None, "s1", "Can I return a gift card?").await;
    assert_eq!(status, 401, "no token, no chat");
    let (status, answer) = chat(&served, Some(token), "s1", "Can I return a gift card?").await;
    assert_eq!(status, 200, "{answer}");
    assert!(answer.starts_with("Gift cards cannot be returned (returns.md): "), "{answer}");
    assert!(
        answer.to_lowercase().contains("gift card"),
        "the passage read from the embedded documents: {answer}"
    );

    // The HEALTHCHECK's command, run inside the image as Docker would.
    let check = in_image(root.path(), &image, &env, &image.healthcheck).output().unwrap();
    assert!(check.status.success(), "{check:?}");
    let status = std::fs::read_to_string(format!("/proc/{}/status", served.child.id())).unwrap_or_default();
    let process_uid = status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .map(|ids| ids.split_whitespace().next().unwrap().to_owned());
    // `unshare` has become the agent (it execs it), so its uid is the image's user.
    assert_eq!(process_uid, Some(uid.to_string()), "{status}");
    drop(served);
    let data = root.path().join(image.workdir.as_deref().unwrap().trim_start_matches('/'));
    assert!(data.join(".keel/keel.db").is_file(), "the sessions are kept in the working directory");
    let after = in_image(root.path(), &image, &env, &image.healthcheck).output().unwrap();
    assert_eq!(after.status.code(), Some(1), "nothing serves now: {after:?}");

    docker_engine_builds_and_runs(out.path(), token).await;
}

/// Where a Docker engine runs, the context builds into an image that serves. (This machine
/// has the client without an engine; the check runs wherever one answers.)
#[allow(clippy::print_stderr, reason = "says, to whoever runs it, that a part did not run")]
async fn docker_engine_builds_and_runs(context: &Path, token: &str) {
    let engine = Command::new("docker").arg("info").output();
    if !engine.is_ok_and(|output| output.status.success()) {
        eprintln!("no Docker engine answers `docker info`: the image itself is not built here");
        return;
    }
    let tag = format!("keel-build-test-{}", std::process::id());
    let build = Command::new("docker").args(["build", "-q", "-t", &tag]).arg(context).output().unwrap();
    assert!(build.status.success(), "{build:?}");
    let port = free_port();
    let run = Command::new("docker")
        .args([
            "run",
            "-d",
            "--rm",
            "-p",
            &format!("127.0.0.1:{port}:3000"),
            "-e",
            &format!("KEEL_API_TOKEN={token}"),
            &tag,
        ])
        .output()
        .unwrap();
    assert!(run.status.success(), "{run:?}");
    let container = text(&run.stdout).trim().to_owned();
    let mut healthy = false;
    for _ in 0..50 {
        if let Ok(response) = client().get(format!("http://127.0.0.1:{port}/health")).send().await {
            healthy = response.status() == 200;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let _ = Command::new("docker").args(["rm", "-f", &container]).output();
    let _ = Command::new("docker").args(["rmi", "-f", &tag]).output();
    assert!(healthy, "the container answers /health");
}

#[test]
fn a_docker_build_refuses_what_the_image_cannot_run_and_names_the_target_that_can() {
    let agent = agent_dir(&[
        (
            "agent.yaml",
            "name: needs\nmodel: mock\ntools: [shell, browser]\nworkspace: { path: ./files }\nmcp:\n  - { name: files, command: [npx, -y, some-server] }\n",
        ),
        ("tools/convert.toml", "description = \"Converts\"\ncommand = [\"python3\", \"convert.py\"]\n"),
        ("tools/convert.py", "print('hi')\n"),
        ("files/notes.md", "notes\n"),
        ("tools/report.toml", "description = \"Reports\"\ncommand = [\"./tools/report.sh\"]\n"),
        ("tools/report.sh", "#!/usr/bin/env bash\necho report\n"),
    ]);
    make_executable(&agent.path().join("tools/report.sh"));
    let parent = tempfile::tempdir().unwrap();
    let out = parent.path().join("context");
    let home = tempfile::tempdir().unwrap();
    let output =
        keel_build(agent.path(), &["--target", "docker", "--out", out.to_str().unwrap()], home.path());
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let said = text(&output.stderr);
    for expected in [
        "error[KEEL_SPEC_INVALID]: the docker image",
        "the `shell` tool runs /bin/sh, and the image has no shell",
        "the `browser` tool runs Chromium, and the image has no browser",
        "the command tool `convert` (tools/convert.toml) runs `python3` (",
        "on this machine), which the image does not have",
        "the command tool `report` (tools/report.toml) is a script for `/usr/bin/env bash`",
        "the MCP server `files` runs `npx`",
        "--target native` can",
    ] {
        assert!(said.contains(expected), "missing {expected:?} in:\n{said}");
    }
    assert!(!out.exists(), "nothing is written, not even the folder");
    // The same agent builds natively: this machine has what it needs.
    let output = keel_build(agent.path(), &["--out", out.to_str().unwrap()], home.path());
    assert!(output.status.success(), "{output:?}");
    assert!(out.join("needs").is_file());
}

#[test]
fn an_invalid_agent_or_one_reading_outside_its_folder_builds_nothing() {
    let home = tempfile::tempdir().unwrap();
    let broken = agent_dir(&[("agent.yaml", "model: mock\nmodle: typo\n")]);
    let out = broken.path().join("out");
    let output = keel_build(broken.path(), &["--out", out.to_str().unwrap()], home.path());
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let said = text(&output.stderr);
    assert!(said.contains("modle"), "the check's error: {said}");
    assert!(said.contains("nothing built"), "{said}");
    assert!(!out.exists(), "no artifact, no folder");

    // The workspace is beside the agent's folder, not in it: the packed agent could not find it.
    let parent = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(parent.path().join("shared")).unwrap();
    std::fs::create_dir_all(parent.path().join("agent")).unwrap();
    std::fs::write(parent.path().join("agent/agent.yaml"), "model: mock\nworkspace: { path: ../shared }\n")
        .unwrap();
    let out = parent.path().join("out");
    let output = keel_build(&parent.path().join("agent"), &["--out", out.to_str().unwrap()], home.path());
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let said = text(&output.stderr);
    assert!(said.contains("does not load from its own folder alone"), "{said}");
    assert!(said.contains("workspace directory"), "the reason, from the packed copy: {said}");
    assert!(!out.exists(), "{:?}", std::fs::read_dir(&out).map(|d| d.count()));

    // An output folder that cannot be made is named.
    let agent = agent_dir(&[("agent.yaml", "model: mock\n")]);
    std::fs::write(parent.path().join("a-file"), "").unwrap();
    let out = parent.path().join("a-file/out");
    for target in ["native", "docker"] {
        let output =
            keel_build(agent.path(), &["--target", target, "--out", out.to_str().unwrap()], home.path());
        assert!(!output.status.success(), "{output:?}");
        let said = text(&output.stderr);
        assert!(said.contains(&format!("cannot create {}: ", out.display())), "{target}: {said}");
    }
}

#[test]
fn the_embedded_agent_answers_check_and_plain_keel_commands_stay_keel() {
    let agent = agent_dir(SHOUTER);
    make_executable(&agent.path().join("tools/shout.sh"));
    let out = tempfile::tempdir().unwrap();
    let home = tempfile::tempdir().unwrap();
    assert!(keel_build(agent.path(), &["--out", out.path().to_str().unwrap()], home.path()).status.success());
    let artifact = out.path().join("shouter");
    let run = |args: &[&str]| {
        Command::new(&artifact)
            .args(args)
            .env("HOME", home.path())
            .env_remove("XDG_CACHE_HOME")
            .output()
            .unwrap()
    };
    let check = run(&["check"]);
    assert!(check.status.success(), "{check:?}");
    assert!(text(&check.stdout).starts_with("ok: agent `shouter` (model mock; tools: shout)"), "{check:?}");
    let version = run(&["--version"]);
    assert!(text(&version.stdout).starts_with("keel "), "{version:?}");
    // `sessions` takes no agent: it is keel's own command.
    let store = format!("sqlite:{}", out.path().join("none.db").display());
    let sessions = run(&["sessions", "list", "--store", &store]);
    assert!(sessions.status.success(), "{sessions:?}");
}
