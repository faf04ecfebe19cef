//! The workspace tools: `read_file`, `list_files`, `stat`, `write_file`, `edit_file`,
//! `delete_file`, jailed in one directory (spec key `workspace`).
//!
//! The jail is a capability, not a string check: the workspace is opened once as a directory
//! handle (`cap_std::fs::Dir`) and every path is resolved beneath it by the kernel's `openat`
//! family, one component at a time. `..` that would climb out, absolute paths and symlinks that
//! point outside all fail at the moment of the access, so a symlink created after any check
//! changes nothing. Paths are also screened first, so that the model gets a clear reason: no
//! NUL or control characters, no `..`, and an absolute path only when it lies inside the
//! workspace (it is made relative).
//!
//! Only regular files are read, opened without blocking (a FIFO or a device is refused, never
//! waited on), and every tool is bounded in memory: `read_file` reads at most `max_bytes`,
//! `edit_file` refuses files over 10 MiB, `write_file` takes at most 10 MiB, `list_files` at
//! most 1000 entries.
//!
//! What no path jail can stop: a hard link is the file itself, so a hard link placed in the
//! workspace (by someone with access to both directories) to a file outside is read like any
//! workspace file. Writes replace files (a temporary file, then a rename) and so never write
//! through a hard link to the outside file.

use std::io::{self, Read};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use cap_std::fs::Dir;
use keel_core::error::ErrorCode;
use keel_core::{BoxFuture, Tool, ToolContext, ToolError, ToolOutcome, ToolSpec};
use serde_json::{Value, json};

/// The most a `read_file` returns when the call sets no `max_bytes`.
pub const DEFAULT_READ_BYTES: usize = 256 * 1024;
/// The largest `max_bytes` a read may ask for.
pub const MAX_READ_BYTES: usize = 10 * 1024 * 1024;
/// The largest file `write_file` and `edit_file` write.
pub const MAX_WRITE_BYTES: usize = 10 * 1024 * 1024;
/// The largest file `edit_file` reads (it holds the file and its edited copy in memory).
pub const MAX_EDIT_BYTES: usize = 10 * 1024 * 1024;
/// The most entries `list_files` returns.
pub const MAX_LIST_ENTRIES: usize = 1000;
/// How deep a recursive listing goes.
pub const MAX_LIST_DEPTH: usize = 12;

/// An open workspace: the directory handle every tool resolves paths under.
#[derive(Clone)]
pub struct Workspace {
    dir: Arc<Dir>,
    root: PathBuf,
}

impl Workspace {
    /// Opens `root` (which must be an existing directory).
    pub fn open(root: &Path) -> io::Result<Workspace> {
        let dir = Dir::open_ambient_dir(root, cap_std::ambient_authority())?;
        let root = std::fs::canonicalize(root)?;
        Ok(Workspace { dir: Arc::new(dir), root })
    }

    /// A model-given path as a relative path inside the workspace, or why it is refused.
    pub fn relative(&self, given: &str) -> Result<PathBuf, ToolError> {
        if given.contains('\0') {
            return Err(refused("the path contains a NUL byte"));
        }
        if let Some(c) = given.chars().find(|c| c.is_control()) {
            return Err(refused(&format!("the path contains the control character {:?}", c)));
        }
        let path = Path::new(given.trim());
        let path = if path.is_absolute() {
            match path.strip_prefix(&self.root) {
                Ok(inside) => inside.to_path_buf(),
                Err(_) => {
                    return Err(refused(&format!(
                        "{given} is outside the workspace; use a path relative to it (like `notes/todo.md`)"
                    )));
                }
            }
        } else {
            path.to_path_buf()
        };
        let mut clean = PathBuf::new();
        for component in path.components() {
            match component {
                Component::Normal(part) => clean.push(part),
                Component::CurDir => {}
                Component::ParentDir => {
                    return Err(refused(&format!(
                        "{given} goes up with `..`; paths stay inside the workspace"
                    )));
                }
                Component::RootDir | Component::Prefix(_) => {
                    return Err(refused(&format!("{given} is not a relative path")));
                }
            }
        }
        if clean.as_os_str().is_empty() {
            clean.push(".");
        }
        Ok(clean)
    }

    /// Writes `content` at `path` (relative, made by keel, not the model), creating its
    /// directory, replacing a file there atomically: where tools keep what they make (the
    /// browser's screenshots).
    pub async fn store(&self, path: PathBuf, content: Vec<u8>) -> Result<(), ToolError> {
        self.blocking(move |dir| write_atomically(dir, &path, &content)).await
    }

    async fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Dir) -> Result<T, ToolError> + Send + 'static,
    ) -> Result<T, ToolError> {
        let dir = self.dir.clone();
        tokio::task::spawn_blocking(move || work(&dir))
            .await
            .map_err(|e| ToolError::failed(format!("the file operation stopped: {e}")))?
    }
}

fn refused(why: &str) -> ToolError {
    ToolError::with_code(ErrorCode::ToolRefused, format!("refused: {why}"), false)
}

/// An I/O error as the model sees it; escapes of the jail are refusals.
fn io_error(path: &Path, error: &io::Error) -> ToolError {
    let shown = path.display();
    let text = error.to_string();
    if text.contains("outside of the filesystem") || text.contains("escape") {
        return refused(&format!("{shown} leads outside the workspace (through a symlink?)"));
    }
    let why = match error.kind() {
        io::ErrorKind::NotFound => "no such file or directory".to_owned(),
        io::ErrorKind::PermissionDenied => "permission denied".to_owned(),
        io::ErrorKind::AlreadyExists => "it already exists".to_owned(),
        _ => text,
    };
    ToolError::failed(format!("{shown}: {why}"))
}

/// Opens a file of the workspace to read it, never blocking in `open` or `read`: only a regular
/// file is read. A FIFO's `open` would wait for a writer forever (holding a thread that no
/// timeout can free, and keel's exit with it), and a device (`/dev/zero`) never ends.
fn open_regular(dir: &Dir, path: &Path) -> Result<(cap_std::fs::File, cap_std::fs::Metadata), ToolError> {
    use cap_std::fs::OpenOptionsExt;
    let mut options = cap_std::fs::OpenOptions::new();
    options.read(true);
    // O_NONBLOCK: opening a FIFO returns at once (then it is refused below); a regular file's
    // reads ignore the flag.
    options.custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY);
    let file = dir.open_with(path, &options).map_err(|e| io_error(path, &e))?;
    let meta = file.metadata().map_err(|e| io_error(path, &e))?;
    if meta.is_dir() {
        return Err(ToolError::failed(format!("{} is a directory; use list_files", path.display())));
    }
    if !meta.is_file() {
        return Err(refused(&format!(
            "{} is not a regular file (a FIFO, a socket or a device): only regular files are read",
            path.display()
        )));
    }
    Ok((file, meta))
}

fn spec(name: &str, description: &str, schema: Value) -> ToolSpec {
    ToolSpec { name: name.into(), description: description.into(), input_schema: schema }
}

/// `read_file`: a text file's content.
pub struct ReadFile {
    spec: ToolSpec,
    workspace: Workspace,
}

impl ReadFile {
    /// The tool, reading in `workspace`.
    pub fn new(workspace: Workspace) -> ReadFile {
        let spec = spec(
            "read_file",
            "Reads a text file of the workspace. Paths are relative to the workspace.",
            json!({
                "type": "object",
                "properties": {
                    "path": { "type": "string", "description": "The file, relative to the workspace" },
                    "max_bytes": { "type": "integer", "minimum": 1, "maximum": MAX_READ_BYTES, "description": "Default 262144" }
                },
                "required": ["path"],
                "additionalProperties": false
            }),
        );
        ReadFile { spec, workspace }
    }
}

impl Tool for ReadFile {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, input: Value, _ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        Box::pin(async move {
            let path = self.workspace.relative(input["path"].as_str().unwrap_or_default())?;
            let max =
                input["max_bytes"].as_u64().map_or(DEFAULT_READ_BYTES, |n| (n as usize).min(MAX_READ_BYTES));
            self.workspace
                .blocking(move |dir| {
                    let (file, meta) = open_regular(dir, &path)?;
                    let mut bytes = Vec::new();
                    file.take(max as u64 + 1).read_to_end(&mut bytes).map_err(|e| io_error(&path, &e))?;
                    let truncated = bytes.len() > max;
                    bytes.truncate(max);
                    let text = match String::from_utf8(bytes) {
                        Ok(text) => text,
                        Err(error) if truncated && error.utf8_error().error_len().is_none() => {
                            let valid = error.utf8_error().valid_up_to();
                            let mut bytes = error.into_bytes();
                            bytes.truncate(valid);
                            String::from_utf8(bytes).expect("cut at a character boundary")
                        }
                        Err(_) => {
                            return Err(ToolError::failed(format!(
                                "{} is not a text file (it is not UTF-8)",
                                path.display()
                            )));
                        }
                    };
                    let mut output =
                        json!({ "path": path.display().to_string(), "size": meta.len(), "content": text });
                    if truncated {
                        output["truncated"] = json!(format!("only the first {max} bytes are shown"));
                    }
                    Ok(output)
                })
                .await
        })
    }
}

/// `list_files`: a directory's entries.
pub struct ListFiles {
    spec: ToolSpec,
    workspace: Workspace,
}

impl ListFiles {
    /// The tool, listing in `workspace`.
    pub fn new(workspace: Workspace) -> ListFiles {
        let spec = spec(
            "list_files",
            "Lists the files and directories of a workspace directory (the workspace itself by default).",
            json!({
                "type": "object",
                "properties": {
                    "path": { "type": "string", "description": "A directory relative to the workspace; default: the workspace" },
                    "recursive": { "type": "boolean", "description": "Also list subdirectories; default false" }
                },
                "additionalProperties": false
            }),
        );
        ListFiles { spec, workspace }
    }
}

fn list(
    dir: &Dir,
    path: &Path,
    recursive: bool,
    depth: usize,
    out: &mut Vec<Value>,
) -> Result<bool, ToolError> {
    let entries = dir.read_dir(path).map_err(|e| io_error(path, &e))?;
    let mut entries: Vec<_> = entries.filter_map(Result::ok).collect();
    entries.sort_by_key(cap_std::fs::DirEntry::file_name);
    for entry in entries {
        if out.len() >= MAX_LIST_ENTRIES {
            return Ok(true);
        }
        let name = path.join(entry.file_name());
        let shown = name.strip_prefix(".").unwrap_or(&name).display().to_string();
        // Symlinks are listed as such and never followed.
        let kind = entry.file_type().map_err(|e| io_error(&name, &e))?;
        let (kind_name, size) = if kind.is_symlink() {
            ("symlink", None)
        } else if kind.is_dir() {
            ("dir", None)
        } else if kind.is_file() {
            ("file", entry.metadata().ok().map(|m| m.len()))
        } else {
            ("other", None)
        };
        let mut item = json!({ "path": shown, "type": kind_name });
        if let Some(size) = size {
            item["size"] = json!(size);
        }
        out.push(item);
        if recursive
            && kind.is_dir()
            && !kind.is_symlink()
            && depth < MAX_LIST_DEPTH
            && list(dir, &name, true, depth + 1, out)?
        {
            return Ok(true);
        }
    }
    Ok(false)
}

impl Tool for ListFiles {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, input: Value, _ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        Box::pin(async move {
            let path = self.workspace.relative(input["path"].as_str().unwrap_or("."))?;
            let recursive = input["recursive"].as_bool().unwrap_or(false);
            self.workspace
                .blocking(move |dir| {
                    let mut entries = Vec::new();
                    let truncated = list(dir, &path, recursive, 0, &mut entries)?;
                    let mut output = json!({ "path": path.display().to_string(), "entries": entries });
                    if truncated {
                        output["truncated"] =
                            json!(format!("only the first {MAX_LIST_ENTRIES} entries are shown"));
                    }
                    Ok(output)
                })
                .await
        })
    }
}

/// Replaces a file's content atomically: a temporary file beside it, then a rename, so a crash
/// never leaves half a file.
fn write_atomically(dir: &Dir, path: &Path, content: &[u8]) -> Result<(), ToolError> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        // `metadata` follows symlinks, beneath the workspace only: a link out is refused here.
        match dir.metadata(parent) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => return Err(ToolError::failed(format!("{} is not a directory", parent.display()))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                dir.create_dir_all(parent).map_err(|e| io_error(parent, &e))?;
            }
            Err(e) => return Err(io_error(parent, &e)),
        }
    }
    if dir.symlink_metadata(path).is_ok_and(|m| m.is_dir()) {
        return Err(ToolError::failed(format!("{} is a directory", path.display())));
    }
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let temp = path.with_file_name(format!(".{name}.keel-{}.tmp", std::process::id()));
    dir.write(&temp, content).map_err(|e| io_error(path, &e))?;
    dir.rename(&temp, dir, path).map_err(|e| {
        let _ = dir.remove_file(&temp);
        io_error(path, &e)
    })
}

/// `write_file`: creates or replaces a file.
pub struct WriteFile {
    spec: ToolSpec,
    workspace: Workspace,
}

impl WriteFile {
    /// The tool, writing in `workspace`.
    pub fn new(workspace: Workspace) -> WriteFile {
        let spec = spec(
            "write_file",
            "Creates or replaces a text file of the workspace (missing directories are created).",
            json!({
                "type": "object",
                "properties": {
                    "path": { "type": "string", "description": "The file, relative to the workspace" },
                    "content": { "type": "string", "description": "The whole new content" }
                },
                "required": ["path", "content"],
                "additionalProperties": false
            }),
        );
        WriteFile { spec, workspace }
    }
}

impl Tool for WriteFile {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, input: Value, _ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        Box::pin(async move {
            let path = self.workspace.relative(input["path"].as_str().unwrap_or_default())?;
            let content = input["content"].as_str().unwrap_or_default().to_owned();
            if content.len() > MAX_WRITE_BYTES {
                return Err(ToolError::failed(format!("the content is over {MAX_WRITE_BYTES} bytes")));
            }
            self.workspace
                .blocking(move |dir| {
                    write_atomically(dir, &path, content.as_bytes())?;
                    Ok(json!({ "path": path.display().to_string(), "bytes": content.len() }))
                })
                .await
        })
    }
}

/// `edit_file`: replaces an exact piece of a file's text.
pub struct EditFile {
    spec: ToolSpec,
    workspace: Workspace,
}

impl EditFile {
    /// The tool, editing in `workspace`.
    pub fn new(workspace: Workspace) -> EditFile {
        let spec = spec(
            "edit_file",
            "Replaces an exact piece of text in a workspace file. old_text must occur exactly once, unless replace_all is true.",
            json!({
                "type": "object",
                "properties": {
                    "path": { "type": "string", "description": "The file, relative to the workspace" },
                    "old_text": { "type": "string", "minLength": 1, "description": "The text to replace, exactly as it is in the file" },
                    "new_text": { "type": "string", "description": "The replacement" },
                    "replace_all": { "type": "boolean", "description": "Replace every occurrence; default false" }
                },
                "required": ["path", "old_text", "new_text"],
                "additionalProperties": false
            }),
        );
        EditFile { spec, workspace }
    }
}

/// The whole text of a file to edit, refused above [`MAX_EDIT_BYTES`] before it is read (a
/// sparse file can claim any size at no disk cost) and read with that cap (it may grow).
fn read_for_edit(dir: &Dir, path: &Path) -> Result<String, ToolError> {
    let (file, meta) = open_regular(dir, path)?;
    let too_large = |size: u64| {
        ToolError::failed(format!(
            "{} is {size} bytes; edit_file edits files up to {MAX_EDIT_BYTES} bytes (10 MiB): use write_file \
             for the whole content, or shell",
            path.display()
        ))
    };
    if meta.len() > MAX_EDIT_BYTES as u64 {
        return Err(too_large(meta.len()));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(MAX_EDIT_BYTES as u64 + 1).read_to_end(&mut bytes).map_err(|e| io_error(path, &e))?;
    if bytes.len() > MAX_EDIT_BYTES {
        return Err(too_large(bytes.len() as u64));
    }
    String::from_utf8(bytes)
        .map_err(|_| ToolError::failed(format!("{} is not a text file (it is not UTF-8)", path.display())))
}

impl Tool for EditFile {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, input: Value, _ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        Box::pin(async move {
            let path = self.workspace.relative(input["path"].as_str().unwrap_or_default())?;
            let old = input["old_text"].as_str().unwrap_or_default().to_owned();
            let new = input["new_text"].as_str().unwrap_or_default().to_owned();
            let all = input["replace_all"].as_bool().unwrap_or(false);
            self.workspace
                .blocking(move |dir| {
                    let text = read_for_edit(dir, &path)?;
                    let count = text.matches(old.as_str()).count();
                    if count == 0 {
                        return Err(ToolError::failed(format!(
                            "old_text was not found in {}; read the file and copy the text exactly",
                            path.display()
                        )));
                    }
                    if count > 1 && !all {
                        return Err(ToolError::failed(format!(
                            "old_text occurs {count} times in {}; give more context to make it unique, or set replace_all",
                            path.display()
                        )));
                    }
                    let edited = if all { text.replace(&old, &new) } else { text.replacen(&old, &new, 1) };
                    if edited.len() > MAX_WRITE_BYTES {
                        return Err(ToolError::failed(format!("the result is over {MAX_WRITE_BYTES} bytes")));
                    }
                    write_atomically(dir, &path, edited.as_bytes())?;
                    Ok(json!({ "path": path.display().to_string(), "replacements": if all { count } else { 1 } }))
                })
                .await
        })
    }
}

/// `stat`: what is at a path of the workspace, without reading it.
pub struct Stat {
    spec: ToolSpec,
    workspace: Workspace,
}

impl Stat {
    /// The tool, looking in `workspace`.
    pub fn new(workspace: Workspace) -> Stat {
        let spec = spec(
            "stat",
            "Says whether a path of the workspace exists and what it is: a file (its size), a directory (its number of entries) or a symlink (where it points), and when it last changed.",
            json!({
                "type": "object",
                "properties": {
                    "path": { "type": "string", "description": "A file or directory relative to the workspace" }
                },
                "required": ["path"],
                "additionalProperties": false
            }),
        );
        Stat { spec, workspace }
    }
}

/// `meta`'s modification time in RFC 3339, UTC.
fn modified(meta: &cap_std::fs::Metadata) -> Option<String> {
    let time = meta.modified().ok()?.into_std();
    let since = time.duration_since(std::time::UNIX_EPOCH).ok()?;
    let at = jiff::Timestamp::from_second(i64::try_from(since.as_secs()).ok()?).ok()?;
    Some(at.to_string())
}

impl Tool for Stat {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, input: Value, _ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        Box::pin(async move {
            let path = self.workspace.relative(input["path"].as_str().unwrap_or_default())?;
            self.workspace
                .blocking(move |dir| {
                    let shown = path.display().to_string();
                    // The path itself, a symlink not followed: what it points to may be outside.
                    let meta = match dir.symlink_metadata(&path) {
                        Ok(meta) => meta,
                        Err(e) if e.kind() == io::ErrorKind::NotFound => {
                            return Ok(json!({ "path": shown, "exists": false }));
                        }
                        Err(e) => return Err(io_error(&path, &e)),
                    };
                    let kind = meta.file_type();
                    let mut output = json!({ "path": shown, "exists": true });
                    if kind.is_symlink() {
                        output["type"] = json!("symlink");
                        if let Ok(target) = dir.read_link(&path) {
                            output["target"] = json!(target.display().to_string());
                        }
                    } else if kind.is_dir() {
                        output["type"] = json!("dir");
                        let entries = dir.read_dir(&path).map_err(|e| io_error(&path, &e))?;
                        output["entries"] = json!(entries.take(100_000).count());
                    } else if kind.is_file() {
                        output["type"] = json!("file");
                        output["size"] = json!(meta.len());
                    } else {
                        output["type"] = json!("other");
                    }
                    if let Some(at) = modified(&meta) {
                        output["modified"] = json!(at);
                    }
                    Ok(output)
                })
                .await
        })
    }
}

/// `delete_file`: removes a file, a symlink or a directory of the workspace.
pub struct DeleteFile {
    spec: ToolSpec,
    workspace: Workspace,
}

impl DeleteFile {
    /// The tool, deleting in `workspace`.
    pub fn new(workspace: Workspace) -> DeleteFile {
        let spec = spec(
            "delete_file",
            "Deletes a file or a symlink of the workspace, or a directory: an empty one, or with everything in it when `recursive` is true.",
            json!({
                "type": "object",
                "properties": {
                    "path": { "type": "string", "description": "The file or directory, relative to the workspace" },
                    "recursive": { "type": "boolean", "description": "Delete a directory that is not empty, with its content; default false" }
                },
                "required": ["path"],
                "additionalProperties": false
            }),
        );
        DeleteFile { spec, workspace }
    }
}

impl Tool for DeleteFile {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, input: Value, _ctx: &'a ToolContext) -> BoxFuture<'a, ToolOutcome> {
        Box::pin(async move {
            let path = self.workspace.relative(input["path"].as_str().unwrap_or_default())?;
            if path == Path::new(".") {
                return Err(refused("the workspace itself cannot be deleted; name what is in it"));
            }
            let recursive = input["recursive"].as_bool().unwrap_or(false);
            self.workspace
                .blocking(move |dir| {
                    let shown = path.display().to_string();
                    let meta = match dir.symlink_metadata(&path) {
                        Ok(meta) => meta,
                        // Nothing there is no error: a delete replayed after a crash (it ran,
                        // and keel died before it was journaled) finds what it left.
                        Err(e) if e.kind() == io::ErrorKind::NotFound => {
                            return Ok(json!({ "path": shown, "deleted": false, "note": "nothing was there" }));
                        }
                        Err(e) => return Err(io_error(&path, &e)),
                    };
                    // A symlink is removed itself, never what it points to.
                    let kind = meta.file_type();
                    let kind_name = if kind.is_dir() {
                        if recursive {
                            dir.remove_dir_all(&path).map_err(|e| io_error(&path, &e))?;
                        } else {
                            dir.remove_dir(&path).map_err(|e| {
                                if e.kind() == io::ErrorKind::DirectoryNotEmpty {
                                    ToolError::failed(format!(
                                        "{shown} is a directory that is not empty: pass `recursive: true` to delete it with its content"
                                    ))
                                } else {
                                    io_error(&path, &e)
                                }
                            })?;
                        }
                        "dir"
                    } else {
                        dir.remove_file(&path).map_err(|e| io_error(&path, &e))?;
                        if kind.is_symlink() { "symlink" } else { "file" }
                    };
                    Ok(json!({ "path": shown, "deleted": true, "type": kind_name }))
                })
                .await
        })
    }
}
