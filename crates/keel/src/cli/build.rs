//! `keel build`: an agent as one executable (`native`) or as a Docker build context (`docker`),
//! and `keel health`, the probe the image's `HEALTHCHECK` runs.
//!
//! Both targets are the same artifact at heart: a copy of keel carrying the agent (see
//! [`super::bundle`]). Nothing is compiled: building takes as long as copying keel. The docker
//! context adds a `Dockerfile` for an image `FROM scratch` holding that executable, the shared
//! libraries it loads when it is not static (read from `ldd`, nothing else), CA certificates
//! for the providers' TLS, and a home for the non-root user; an agent that needs what such an
//! image cannot have (a shell, an interpreter, a program from the host) is refused, naming it.

use std::fmt::Write as _;
use std::io::Write;
use std::path::{Path, PathBuf};

use super::{BuildArgs, BuildTarget, bundle, exit};

/// The image's user: no name to resolve, not root.
const IMAGE_USER: &str = "10001:10001";
/// Where the image keeps its state (the SQLite store, the document index): the working
/// directory, owned by [`IMAGE_USER`]; mount a volume there to keep it.
const IMAGE_DATA: &str = "/data";
/// The CA bundle the providers' TLS reads (rustls' native roots look here first on Linux).
const CA_CERTIFICATES: &str = "/etc/ssl/certs/ca-certificates.crt";

pub(crate) fn build(args: &BuildArgs) -> std::io::Result<u8> {
    let mut stderr = std::io::stderr().lock();
    let Some(spec) = load(&args.agent, &mut stderr)? else {
        writeln!(
            stderr,
            "nothing built: fix the errors above (`keel check {}` lists them)",
            args.agent.display()
        )?;
        return Ok(exit::INVALID_AGENT);
    };
    let program = match &args.keel {
        Some(path) if !path.is_file() => {
            writeln!(
                stderr,
                "error: --keel {}: no such file (give the path of a keel executable)",
                path.display()
            )?;
            return Ok(2);
        }
        Some(path) => path.clone(),
        None => std::env::current_exe()?,
    };
    let (archive, files) = bundle::pack(&args.agent)?;
    // The packed copy must stand on its own: loaded from a fresh folder, it finds everything
    // it names (a spec naming `../shared.md` or a workspace outside its folder would not).
    let scratch = tempfile::tempdir()?;
    let unpacked = scratch.path().join("agent");
    let copy = bundle::unpack(&archive, &unpacked)?;
    let mut diagnostics = Vec::new();
    let Some(packed) = load(&copy, &mut diagnostics)? else {
        writeln!(
            stderr,
            "error[{}]: the agent does not load from its own folder alone, so it cannot be built:",
            keel_core::ErrorCode::SpecInvalid.as_str()
        )?;
        stderr.write_all(&diagnostics)?;
        writeln!(stderr, "keep every file the agent reads inside {}", agent_folder(&args.agent).display())?;
        return Ok(exit::INVALID_AGENT);
    };
    let out = args.out.clone().unwrap_or_else(|| PathBuf::from(".keel/build").join(args.target.name()));
    let summary =
        format!("{files} file{}, {}", if files == 1 { "" } else { "s" }, size(archive.len() as u64));
    match args.target {
        BuildTarget::Native => {
            std::fs::create_dir_all(&out).map_err(super::at_path("create", &out))?;
            let artifact = out.join(&spec.name);
            bundle::write_executable(&program, &archive, &artifact)
                .map_err(super::at_path("write", &artifact))?;
            let shown = shown(&artifact);
            let mut stdout = std::io::stdout().lock();
            writeln!(
                stdout,
                "built {} ({}; agent `{}`: {summary})",
                artifact.display(),
                size(std::fs::metadata(&artifact)?.len()),
                spec.name
            )?;
            writeln!(
                stdout,
                "\nIt needs no other file. Serve the agent (HOST and PORT change where, default 127.0.0.1:3000):"
            )?;
            writeln!(stdout, "  {shown}")?;
            writeln!(stdout, "or run one turn, or chat:\n  {shown} run \"hello\"\n  {shown} chat")?;
            Ok(exit::OK)
        }
        BuildTarget::Docker => docker(&args.agent, &program, &archive, (&packed, &unpacked), &out, &summary),
    }
}

/// Writes the docker build context, or refuses when the image could not run the agent.
fn docker(
    agent: &Path,
    program: &Path,
    archive: &[u8],
    (packed, unpacked_root): (&keel_spec::AgentSpec, &Path),
    out: &Path,
    summary: &str,
) -> std::io::Result<u8> {
    let mut programs = vec![program.to_path_buf()];
    let mut problems = Vec::new();
    image_problems(packed, unpacked_root, &mut problems, &mut programs);
    let mut libraries = Vec::new();
    for path in &programs {
        match shared_libraries(path) {
            Ok(found) => libraries.extend(found),
            Err(message) => problems.push(message),
        }
    }
    if !problems.is_empty() {
        let mut stderr = std::io::stderr().lock();
        writeln!(
            stderr,
            "error[{}]: the docker image (FROM scratch: keel and the agent's own files, no shell, no interpreters) cannot run this agent:",
            keel_core::ErrorCode::SpecInvalid.as_str()
        )?;
        for problem in &problems {
            writeln!(stderr, "  - {problem}")?;
        }
        writeln!(
            stderr,
            "`keel build {} --target native` can: it runs where its tools are installed",
            shown(agent)
        )?;
        return Ok(exit::INVALID_AGENT);
    }
    libraries.sort();
    libraries.dedup();
    std::fs::create_dir_all(out).map_err(super::at_path("create", out))?;
    let rootfs = out.join("rootfs");
    let _ = std::fs::remove_dir_all(&rootfs);
    std::fs::create_dir_all(rootfs.join("etc/ssl/certs"))?;
    bundle::write_executable(program, archive, &rootfs.join("agent"))?;
    for library in &libraries {
        let inside = rootfs.join(library.strip_prefix("/").unwrap_or(library));
        if let Some(parent) = inside.parent() {
            std::fs::create_dir_all(parent)?;
        }
        // The file itself, under the name the program asks for (links resolved).
        std::fs::copy(library, &inside)?;
    }
    let certificates = Path::new(CA_CERTIFICATES).is_file();
    if certificates {
        std::fs::copy(CA_CERTIFICATES, rootfs.join(CA_CERTIFICATES.trim_start_matches('/')))?;
    }
    let (uid, gid) = IMAGE_USER.split_once(':').unwrap_or((IMAGE_USER, IMAGE_USER));
    std::fs::write(
        rootfs.join("etc/passwd"),
        format!("keel:x:{uid}:{gid}:keel:{IMAGE_DATA}:/nonexistent\n"),
    )?;
    std::fs::write(rootfs.join("etc/group"), format!("keel:x:{gid}:\n"))?;
    // Owned by the image's user once copied: its home, its state, its temporary files.
    let home = out.join("home");
    let _ = std::fs::remove_dir_all(&home);
    std::fs::create_dir_all(home.join("data"))?;
    std::fs::create_dir_all(home.join("tmp"))?;
    std::fs::write(out.join("Dockerfile"), dockerfile(&packed.name))?;
    std::fs::write(out.join(".dockerignore"), "*\n!rootfs\n!home\n")?;

    let name = &packed.name;
    let context = out.display();
    let mut stdout = std::io::stdout().lock();
    let mut contents = format!("the agent's executable ({summary})");
    if !libraries.is_empty() {
        let _ = write!(contents, ", the {} shared libraries it loads", libraries.len());
    }
    if certificates {
        contents.push_str(", CA certificates");
    }
    writeln!(stdout, "built a docker build context in {context}: an image FROM scratch with {contents}")?;
    writeln!(stdout, "\nBuild and run it (secrets only with -e; /data keeps the sessions):")?;
    writeln!(stdout, "  docker build -t {name} {context}")?;
    writeln!(
        stdout,
        "  docker run --rm -p 3000:3000 -v {name}-data:{IMAGE_DATA} -e KEEL_API_TOKEN=<a long random token> -e OPENAI_API_KEY {name}"
    )?;
    if !libraries.is_empty() {
        writeln!(
            stdout,
            "\n(keel is linked dynamically, so its C library goes in the image: a static keel makes it one file,\n see docs/deploy.md)"
        )?;
    }
    Ok(exit::OK)
}

fn dockerfile(name: &str) -> String {
    format!(
        "# The agent `{name}`, built by `keel build --target docker`: nothing but keel with the agent\n\
         # embedded (and, for a dynamically linked keel, the libraries it loads).\n\
         FROM scratch\n\
         COPY rootfs/ /\n\
         COPY --chown={IMAGE_USER} home/data/ {IMAGE_DATA}/\n\
         COPY --chown={IMAGE_USER} home/tmp/ /tmp/\n\
         USER {IMAGE_USER}\n\
         WORKDIR {IMAGE_DATA}\n\
         ENV HOST=0.0.0.0 PORT=3000 HOME={IMAGE_DATA} TMPDIR=/tmp\n\
         EXPOSE 3000\n\
         HEALTHCHECK --interval=30s --timeout=5s --start-period=10s CMD [\"/agent\", \"health\"]\n\
         ENTRYPOINT [\"/agent\"]\n"
    )
}

/// What an image holding only keel and the agent's files cannot run, and the programs of the
/// agent's own (ELF executables in its folder) whose libraries the image needs too.
fn image_problems(
    spec: &keel_spec::AgentSpec,
    root: &Path,
    problems: &mut Vec<String>,
    programs: &mut Vec<PathBuf>,
) {
    let shell = keel_tools::shell::ShellTool::NAME;
    if spec.builtin_tools.iter().any(|tool| tool == shell) {
        problems.push(format!(
            "agent `{}`: the `{shell}` tool runs /bin/sh, and the image has no shell",
            spec.name
        ));
    }
    let browser = keel_tools::BROWSER_NAME;
    if spec.builtin_tools.iter().any(|tool| tool == browser) {
        problems.push(format!(
            "agent `{}`: the `{browser}` tool runs Chromium, and the image has no browser",
            spec.name
        ));
    }
    for tool in &spec.command_tools {
        let what = format!("the command tool `{}` ({})", tool.def.name, relative(&tool.file, root));
        program_problem(&tool.def.command, root, &what, problems, programs);
    }
    for server in &spec.mcp {
        if let keel_core::McpTransport::Stdio { command, .. } = &server.transport {
            let what = format!("the MCP server `{}`", server.name);
            program_problem(command, root, &what, problems, programs);
        }
    }
    for subagent in &spec.subagents {
        image_problems(subagent, root, problems, programs);
    }
}

fn program_problem(
    command: &[String],
    root: &Path,
    what: &str,
    problems: &mut Vec<String>,
    programs: &mut Vec<PathBuf>,
) {
    let Some(program) = command.first() else { return };
    let path = Path::new(program);
    if !path.is_absolute() {
        problems.push(format!("{what} runs `{program}`, which the image does not have"));
        return;
    }
    if !path.starts_with(root) {
        let name =
            path.file_name().map_or_else(|| program.clone(), |name| name.to_string_lossy().into_owned());
        problems
            .push(format!("{what} runs `{name}` ({program} on this machine), which the image does not have"));
        return;
    }
    let mut head = [0u8; 256];
    let read =
        std::fs::File::open(path).and_then(|mut file| std::io::Read::read(&mut file, &mut head)).unwrap_or(0);
    let head = &head[..read];
    if let Some(script) = head.strip_prefix(b"#!") {
        let line = script.split(|b| *b == b'\n').next().unwrap_or_default();
        let interpreter = String::from_utf8_lossy(line).trim().to_owned();
        problems.push(format!(
            "{what} is a script for `{interpreter}`, which the image does not have ({})",
            relative(path, root)
        ));
    } else if head.starts_with(b"\x7fELF") {
        programs.push(path.to_path_buf());
    } else {
        problems.push(format!(
            "{what} runs {}, which is neither an executable nor a script",
            relative(path, root)
        ));
    }
}

/// The shared libraries `program` loads (its dynamic loader among them), as `ldd` resolves
/// them; none for a static program.
fn shared_libraries(program: &Path) -> Result<Vec<PathBuf>, String> {
    let output = std::process::Command::new("ldd").arg(program).output().map_err(|error| {
        format!("cannot run `ldd` to find the libraries {} loads: {error}", program.display())
    })?;
    let text = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        let said = format!("{text}{}", String::from_utf8_lossy(&output.stderr));
        return if said.contains("not a dynamic executable") || said.contains("statically linked") {
            Ok(Vec::new())
        } else {
            Err(format!("`ldd {}` failed: {}", program.display(), said.trim()))
        };
    }
    let mut libraries = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.contains("statically linked") {
            return Ok(Vec::new());
        }
        // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)`, `/lib64/ld-linux-x86-64.so.2 (0x...)`,
        // and `linux-vdso.so.1 (0x...)`, which the kernel provides.
        let path = match line.split_once("=>") {
            Some((name, rest)) => {
                let target = rest.trim().split(" (").next().unwrap_or_default().trim();
                if target == "not found" {
                    return Err(format!(
                        "{} needs {}, which is not installed here",
                        program.display(),
                        name.trim()
                    ));
                }
                target
            }
            None => line.split(" (").next().unwrap_or_default().trim(),
        };
        if path.starts_with('/') {
            libraries.push(PathBuf::from(path));
        }
    }
    Ok(libraries)
}

/// Loads an agent, writing its diagnostics to `report`; `None` when it has errors.
fn load(agent: &Path, report: &mut dyn Write) -> std::io::Result<Option<keel_spec::AgentSpec>> {
    let options = super::load_options();
    let loaded = keel_spec::load(agent, &options);
    for diagnostic in &loaded.diagnostics {
        writeln!(report, "{diagnostic}")?;
    }
    Ok(loaded.spec)
}

/// The folder `keel build` packs for `agent`: itself, or a spec file's folder.
fn agent_folder(agent: &Path) -> PathBuf {
    if agent.is_dir() {
        agent.to_path_buf()
    } else {
        agent.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf()
    }
}

fn relative(path: &Path, root: &Path) -> String {
    let inside = path.strip_prefix(root).unwrap_or(path);
    let inside = inside.strip_prefix("agent").unwrap_or(inside);
    inside.display().to_string()
}

/// A path as a user types it in a shell: a relative one starts with `./` to run.
fn shown(path: &Path) -> String {
    if path.is_absolute() || path.starts_with(".") || path.starts_with("..") {
        path.display().to_string()
    } else {
        format!("./{}", path.display())
    }
}

fn size(bytes: u64) -> String {
    #[allow(clippy::cast_precision_loss, reason = "a size to read, to one decimal")]
    let megabytes = bytes as f64 / 1_000_000.0;
    if bytes >= 1_000_000 { format!("{megabytes:.1} MB") } else { format!("{:.1} KB", bytes as f64 / 1000.0) }
}

/// `keel health`: asks the server this environment describes (`HOST`, `PORT`, as `keel serve`
/// reads them; an unspecified address means this machine) for `/health`. Exit 0 when it
/// answers 200.
pub(crate) fn health(url: Option<&str>) -> std::io::Result<u8> {
    let url = url.map_or_else(
        || {
            let host = std::env::var("HOST")
                .ok()
                .filter(|h| !h.trim().is_empty())
                .unwrap_or_else(|| "127.0.0.1".into());
            let port =
                std::env::var("PORT").ok().filter(|p| !p.trim().is_empty()).unwrap_or_else(|| "3000".into());
            let host = match host.trim().trim_start_matches('[').trim_end_matches(']') {
                "0.0.0.0" | "" => "127.0.0.1".to_owned(),
                "::" => "[::1]".to_owned(),
                other if other.contains(':') => format!("[{other}]"),
                other => other.to_owned(),
            };
            format!("http://{host}:{port}/health")
        },
        str::to_owned,
    );
    super::run_async(async move {
        // A probe of this machine's server: never through a proxy.
        let client = reqwest::Client::builder().no_proxy().timeout(std::time::Duration::from_secs(5)).build();
        let outcome = match client {
            Ok(client) => client.get(&url).send().await,
            Err(error) => Err(error),
        };
        match outcome {
            Ok(response) if response.status().is_success() => Ok(exit::OK),
            Ok(response) => {
                eprintln!("unhealthy: {url} answered {}", response.status());
                Ok(exit::INVALID_AGENT)
            }
            Err(error) => {
                eprintln!("unhealthy: {url}: {error}");
                Ok(exit::INVALID_AGENT)
            }
        }
    })?
}
