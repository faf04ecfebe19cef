//! An agent carried inside the keel executable (`keel build --target native | docker`).
//!
//! The artifact is a copy of keel with the agent's directory appended, as a gzipped tar, and a
//! fixed-size trailer that says where the archive starts and what its SHA-256 is. The loader
//! ignores bytes past the ELF's segments, so the program runs unchanged; at start keel reads
//! the trailer of its own file (one small read), and when an agent is there it unpacks it
//! once, into a cache folder named by the digest, and works on it as on any agent directory.
//! The agent's command tools need real files on disk, and the spec loader reads paths: an
//! unpacked copy keeps both exactly as `keel serve <dir>` has them.

use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// Ends every artifact: `[archive][archive length: u64 LE][SHA-256 of the archive][MAGIC]`.
const MAGIC: &[u8; 16] = b"keel-agent-tgz1\n";
const TRAILER_LEN: u64 = 8 + 32 + MAGIC.len() as u64;

/// Folders of an agent directory never packed: keel's own state (stores, indexes, earlier
/// builds) and version control.
const SKIPPED: &[&str] = &[".keel", ".git"];

/// In the archive: the agent's folder, and a file naming what to load inside it (the folder
/// itself, or a spec file of it).
const AGENT_DIR: &str = "agent";
const ENTRY_FILE: &str = "entry";

/// The agent an executable carries.
pub(crate) struct Embedded {
    /// Where the program ends and the archive starts.
    pub(crate) program_len: u64,
    archive_len: u64,
    digest: [u8; 32],
}

impl Embedded {
    /// The digest as 64 hex digits: the name of the unpacked copy.
    fn name(&self) -> String {
        self.digest.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// The commands whose first argument is an agent: an executable carrying one puts it there.
const AGENT_COMMANDS: &[&str] = &["serve", "run", "chat", "check", "mcp"];

/// The command line to parse: the process's own, or, for an executable carrying an agent,
/// the same with the (unpacked) agent where the command takes one: no arguments, or only
/// flags, serve it (`./agent --port 8080`); `./agent run "hi"` runs it; any other command
/// (`sessions`, `approvals`, `health`...) is keel's, unchanged.
pub(crate) fn command_line() -> io::Result<Vec<OsString>> {
    let mut args: Vec<OsString> = std::env::args_os().collect();
    // `/proc/self/exe`, else the path it was started by (a chroot without /proc).
    let exe = std::env::current_exe()
        .ok()
        .or_else(|| args.first().map(PathBuf::from).filter(|path| path.components().count() > 1));
    let Some(exe) = exe else { return Ok(args) };
    let embedded = match find(&exe) {
        Ok(found) => found,
        // A damaged trailer is an error; an executable keel cannot read carries nothing it can
        // use, so it is a plain keel.
        Err(error) if error.kind() == io::ErrorKind::InvalidData => return Err(error),
        Err(_) => None,
    };
    let Some(embedded) = embedded else { return Ok(args) };
    let agent = OsString::from(unpacked(&exe, &embedded)?);
    let first = args.get(1).and_then(|arg| arg.to_str()).map(str::to_owned);
    match first.as_deref() {
        None => args.extend(["serve".into(), agent]),
        Some(command) if AGENT_COMMANDS.contains(&command) => args.insert(2, agent),
        Some("-h" | "--help" | "-V" | "--version") => {}
        Some(flag) if flag.starts_with('-') => {
            args.splice(1..1, ["serve".into(), agent]);
        }
        Some(_) => {}
    }
    Ok(args)
}

/// Reads the trailer of `exe`; `None` for a plain keel (or a file too short to carry one).
pub(crate) fn find(exe: &Path) -> io::Result<Option<Embedded>> {
    let mut file = File::open(exe)?;
    let size = file.metadata()?.len();
    if size < TRAILER_LEN {
        return Ok(None);
    }
    file.seek(SeekFrom::Start(size - TRAILER_LEN))?;
    let mut trailer = [0u8; TRAILER_LEN as usize];
    file.read_exact(&mut trailer)?;
    if &trailer[40..] != MAGIC {
        return Ok(None);
    }
    let archive_len = u64::from_le_bytes(trailer[..8].try_into().unwrap_or_default());
    let Some(program_len) = size.checked_sub(TRAILER_LEN + archive_len) else {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "the embedded agent's trailer is damaged"));
    };
    let mut digest = [0u8; 32];
    digest.copy_from_slice(&trailer[8..40]);
    Ok(Some(Embedded { program_len, archive_len, digest }))
}

/// Packs the agent at `agent` (a directory, or a spec file with its directory) as a gzipped
/// tar. Returns the archive and how many files it holds.
pub(crate) fn pack(agent: &Path) -> io::Result<(Vec<u8>, usize)> {
    let (dir, entry) = if agent.is_dir() {
        (agent.to_path_buf(), AGENT_DIR.to_owned())
    } else {
        let name = agent.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, format!("{} is not a file name", agent.display()))
        })?;
        let parent = agent.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        (parent.to_path_buf(), format!("{AGENT_DIR}/{name}"))
    };
    let encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let mut archive = tar::Builder::new(encoder);
    // Symbolic links are followed: what the agent reads through one is what it gets.
    archive.follow_symlinks(true);
    let mut files = 0;
    for item in
        walkdir::WalkDir::new(&dir).follow_links(true).sort_by_file_name().into_iter().filter_entry(|item| {
            item.depth() == 0
                || !SKIPPED.iter().any(|skipped| item.file_name() == std::ffi::OsStr::new(skipped))
        })
    {
        let item = item.map_err(io::Error::other)?;
        let relative = item.path().strip_prefix(&dir).map_err(io::Error::other)?;
        let name = Path::new(AGENT_DIR).join(relative);
        if item.file_type().is_dir() {
            archive.append_dir(&name, item.path())?;
        } else if item.file_type().is_file() {
            archive.append_path_with_name(item.path(), &name)?;
            files += 1;
        }
    }
    let mut header = tar::Header::new_gnu();
    header.set_size(entry.len() as u64);
    header.set_mode(0o644);
    header.set_cksum();
    archive.append_data(&mut header, ENTRY_FILE, entry.as_bytes())?;
    Ok((archive.into_inner()?.finish()?, files))
}

/// Writes `out`: the program part of the executable `program` (without the agent it may carry
/// itself), then `archive` and the trailer; executable by its owner and everyone.
pub(crate) fn write_executable(program: &Path, archive: &[u8], out: &Path) -> io::Result<()> {
    let program_len = match find(program)? {
        Some(embedded) => embedded.program_len,
        None => std::fs::metadata(program)?.len(),
    };
    let mut partial = out.as_os_str().to_owned();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    {
        let mut writer = io::BufWriter::new(File::create(&partial)?);
        io::copy(&mut File::open(program)?.take(program_len), &mut writer)?;
        writer.write_all(archive)?;
        writer.write_all(&(archive.len() as u64).to_le_bytes())?;
        writer.write_all(&Sha256::digest(archive))?;
        writer.write_all(MAGIC)?;
        writer.into_inner().map_err(io::IntoInnerError::into_error)?.sync_all()?;
    }
    std::fs::set_permissions(&partial, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    std::fs::rename(&partial, out)
}

/// Unpacks `archive` into the folder `into` (which must not exist) and returns the path of
/// the agent to load there.
pub(crate) fn unpack(archive: &[u8], into: &Path) -> io::Result<PathBuf> {
    std::fs::create_dir_all(into)?;
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(archive));
    tar.set_preserve_permissions(true);
    tar.unpack(into)?;
    let entry = std::fs::read_to_string(into.join(ENTRY_FILE))?;
    Ok(into.join(entry.trim()))
}

/// The agent `exe` carries, unpacked: the copy made by an earlier start when there is one,
/// else a new one (written beside it and renamed, so two processes starting at once never
/// see half an agent). Returns the path of the agent to load.
pub(crate) fn unpacked(exe: &Path, embedded: &Embedded) -> io::Result<PathBuf> {
    let root = cache_root()?;
    let name = embedded.name();
    let target = root.join(&name);
    if let Ok(entry) = std::fs::read_to_string(target.join(ENTRY_FILE)) {
        return Ok(target.join(entry.trim()));
    }
    let mut archive = Vec::with_capacity(usize::try_from(embedded.archive_len).unwrap_or(0));
    let mut file = File::open(exe)?;
    file.seek(SeekFrom::Start(embedded.program_len))?;
    file.take(embedded.archive_len).read_to_end(&mut archive)?;
    if Sha256::digest(&archive).as_slice() != embedded.digest {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("the agent embedded in {} is damaged (its digest does not match)", exe.display()),
        ));
    }
    let partial = root.join(format!("{name}.partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&partial);
    unpack(&archive, &partial)?;
    match std::fs::rename(&partial, &target) {
        Ok(()) => {}
        // Another process unpacked the same agent first: use its copy.
        Err(_) if target.join(ENTRY_FILE).is_file() => {
            let _ = std::fs::remove_dir_all(&partial);
        }
        Err(error) => return Err(error),
    }
    let entry = std::fs::read_to_string(target.join(ENTRY_FILE))?;
    Ok(target.join(entry.trim()))
}

/// Where unpacked agents live: `$XDG_CACHE_HOME/keel/agents`, else `~/.cache/keel/agents`,
/// else a folder of the temporary directory; the first that can be created, private to the
/// user. A folder someone else owns, or may write to, is never used: in a shared `/tmp`
/// another user could have made it first and put an agent of their own in it.
fn cache_root() -> io::Result<PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    let candidates = [
        var("XDG_CACHE_HOME").map(|dir| dir.join("keel/agents")),
        var("HOME").map(|home| home.join(".cache/keel/agents")),
        Some(std::env::temp_dir().join(format!("keel-agents-{}", nix::unistd::geteuid()))),
    ];
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no folder to unpack the agent into");
    for dir in candidates.into_iter().flatten() {
        match std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir) {
            Ok(()) => match private(&dir) {
                Ok(()) => return Ok(dir),
                Err(error) => last = error,
            },
            Err(error) => {
                last = super::at_path("create", &dir)(error);
            }
        }
    }
    Err(last)
}

/// Whether `dir` is a real folder (not a link) of this user's that nobody else may write to.
fn private(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let metadata = std::fs::symlink_metadata(dir)?;
    let mine = metadata.is_dir() && metadata.uid() == nix::unistd::geteuid().as_raw();
    if mine && metadata.mode() & 0o022 == 0 {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("{} is not a folder only you can write to: not unpacking an agent there", dir.display()),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_survives_the_round_trip_with_its_executable_bits() {
        let agent = tempfile::tempdir().unwrap();
        std::fs::write(agent.path().join("agent.yaml"), "model: mock\n").unwrap();
        std::fs::create_dir_all(agent.path().join("tools")).unwrap();
        std::fs::write(agent.path().join("tools/run.sh"), "#!/bin/sh\necho hi\n").unwrap();
        std::fs::set_permissions(
            agent.path().join("tools/run.sh"),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        std::fs::create_dir_all(agent.path().join(".keel")).unwrap();
        std::fs::write(agent.path().join(".keel/keel.db"), "state").unwrap();

        let (archive, files) = pack(agent.path()).unwrap();
        assert_eq!(files, 2, "the spec and the tool; .keel is left out");
        let into = tempfile::tempdir().unwrap();
        let loaded = unpack(&archive, &into.path().join("copy")).unwrap();
        assert_eq!(std::fs::read_to_string(loaded.join("agent.yaml")).unwrap(), "model: mock\n");
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(loaded.join("tools/run.sh")).unwrap().permissions(),
        );
        assert_eq!(mode & 0o111, 0o111, "the tool stays executable");
        assert!(!loaded.join(".keel").exists());
    }

    #[test]
    fn a_cache_folder_others_may_write_to_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let shared = dir.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
        assert!(private(&shared).unwrap_err().to_string().contains("not a folder only you can write to"));
        std::fs::set_permissions(&shared, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
        assert!(private(&shared).is_ok());
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&shared, &link).unwrap();
        assert!(private(&link).is_err(), "a link could point anywhere");
    }

    #[test]
    fn the_trailer_is_found_and_a_rebuild_replaces_the_agent_it_carries() {
        let dir = tempfile::tempdir().unwrap();
        let program = dir.path().join("program");
        std::fs::write(&program, b"\x7fELF not really a program").unwrap();
        assert!(find(&program).unwrap().is_none());
        let first = dir.path().join("first");
        write_executable(&program, b"archive one", &first).unwrap();
        let found = find(&first).unwrap().unwrap();
        assert_eq!(found.program_len, 25);
        assert_eq!(found.archive_len, 11);
        // Built from a built artifact: its own agent is dropped, not nested.
        let second = dir.path().join("second");
        write_executable(&first, b"two", &second).unwrap();
        let found = find(&second).unwrap().unwrap();
        assert_eq!((found.program_len, found.archive_len), (25, 3));
        let bytes = std::fs::read(&second).unwrap();
        assert!(bytes.starts_with(b"\x7fELF not really a program"));
    }
}
