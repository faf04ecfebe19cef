//! Reading a knowledge folder: which files are documents, and their text.
//!
//! Markdown (`.md`, `.markdown`), text (`.txt`, `.text`, `.rst`), HTML (`.html`, `.htm`,
//! `.xhtml`: the page's text as Markdown) and PDF (`.pdf`: the text of each page). Anything
//! else, and what cannot be read (a file over [`MAX_FILE_BYTES`], bytes that are not UTF-8 text,
//! a PDF that does not parse, a copy of another file), is skipped with a warning naming it:
//! a bad file never stops an agent from starting.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// The largest document read, in bytes.
pub const MAX_FILE_BYTES: u64 = 32 * 1024 * 1024;
/// The most files a folder may hold (documents or not); the rest are skipped.
pub const MAX_FILES: usize = 100_000;
/// How deep folders are followed.
const MAX_DEPTH: usize = 16;

/// What kind of document a file is, by its extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DocKind {
    /// Markdown: headings title the passages under them.
    Markdown,
    /// Plain text.
    Text,
    /// HTML, read as Markdown.
    Html,
    /// PDF, read page by page.
    Pdf,
}

impl DocKind {
    fn of(path: &Path) -> Option<DocKind> {
        let extension = path.extension()?.to_str()?.to_ascii_lowercase();
        Some(match extension.as_str() {
            "md" | "markdown" | "mdx" => DocKind::Markdown,
            "txt" | "text" | "rst" => DocKind::Text,
            "html" | "htm" | "xhtml" => DocKind::Html,
            "pdf" => DocKind::Pdf,
            _ => return None,
        })
    }
}

/// A file of the folder that will be read: found by [`scan`], not read yet beyond its hash.
#[derive(Clone, Debug)]
pub struct Found {
    /// Its path under the folder, `/`-separated.
    pub path: String,
    /// Where it is.
    pub file: PathBuf,
    /// Its kind.
    pub kind: DocKind,
    /// The SHA-256 of its bytes, in hex.
    pub sha256: String,
    /// Its bytes.
    pub bytes: Vec<u8>,
}

/// A document's text.
#[derive(Clone, Debug, PartialEq)]
pub struct Document {
    /// Its path under the folder, `/`-separated.
    pub path: String,
    /// Its kind.
    pub kind: DocKind,
    /// Its title (an HTML page's `<title>`), when it has one apart from its headings.
    pub title: Option<String>,
    /// Its text, pages one after another for a PDF.
    pub text: String,
    /// For a PDF, the line (from 1) each page starts on.
    pub page_lines: Vec<usize>,
}

/// Something skipped, and why.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Warning {
    /// The file, under the folder.
    pub path: String,
    /// Why it was skipped.
    pub message: String,
}

impl std::fmt::Display for Warning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// The folder's documents (sorted by path, each read and hashed), and what was skipped. An error
/// only when the folder itself cannot be read.
pub fn scan(folder: &Path) -> Result<(Vec<Found>, Vec<Warning>), String> {
    let mut found = Vec::new();
    let mut warnings = Vec::new();
    let mut seen = 0usize;
    walk(folder, folder, 0, &mut seen, &mut found, &mut warnings)
        .map_err(|error| format!("cannot read the folder {}: {error}", folder.display()))?;
    found.sort_by(|a, b| a.path.cmp(&b.path));
    // Copies are indexed once: the first path in order keeps the content.
    let mut by_hash: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    found.retain(|file| match by_hash.get(&file.sha256) {
        Some(first) => {
            warnings.push(Warning {
                path: file.path.clone(),
                message: format!("has the same content as {first}: indexed once, as {first}"),
            });
            false
        }
        None => {
            by_hash.insert(file.sha256.clone(), file.path.clone());
            true
        }
    });
    warnings.sort_by(|a, b| a.path.cmp(&b.path));
    Ok((found, warnings))
}

fn walk(
    root: &Path,
    dir: &Path,
    depth: usize,
    seen: &mut usize,
    found: &mut Vec<Found>,
    warnings: &mut Vec<Warning>,
) -> std::io::Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)?.filter_map(Result::ok).collect();
    entries.sort_by_key(|entry| entry.file_name());
    for entry in entries {
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            let path = relative(root, &entry.path());
            warnings.push(Warning { path, message: "has a name that is not UTF-8: skipped".into() });
            continue;
        };
        // Hidden files (.git, .DS_Store, editors' swap files) are no documents.
        if name.starts_with('.') {
            continue;
        }
        let path = entry.path();
        let shown = relative(root, &path);
        *seen += 1;
        if *seen > MAX_FILES {
            warnings.push(Warning {
                path: shown,
                message: format!(
                    "the folder holds more than {MAX_FILES} files: this one and the rest are skipped"
                ),
            });
            return Ok(());
        }
        let Ok(file_type) = entry.file_type() else { continue };
        if file_type.is_symlink() {
            // A link could lead out of the folder: the index holds what the folder holds.
            warnings
                .push(Warning { path: shown, message: "is a symbolic link, which is not followed".into() });
            continue;
        }
        if file_type.is_dir() {
            if depth + 1 >= MAX_DEPTH {
                warnings.push(Warning {
                    path: shown,
                    message: format!("is more than {MAX_DEPTH} folders deep: skipped"),
                });
                continue;
            }
            walk(root, &path, depth + 1, seen, found, warnings)?;
            continue;
        }
        if !file_type.is_file() {
            continue;
        }
        let Some(kind) = DocKind::of(&path) else {
            warnings.push(Warning {
                path: shown,
                message: "is not a document keel reads (Markdown, text, HTML or PDF): skipped".into(),
            });
            continue;
        };
        let size = entry.metadata().map(|m| m.len()).unwrap_or(0);
        if size > MAX_FILE_BYTES {
            warnings.push(Warning {
                path: shown,
                message: format!(
                    "is {} MB, over the {} MB a document may have: skipped (split it into smaller files)",
                    size / (1024 * 1024),
                    MAX_FILE_BYTES / (1024 * 1024)
                ),
            });
            continue;
        }
        match std::fs::read(&path) {
            Ok(bytes) => {
                let sha256 = hex::encode(Sha256::digest(&bytes));
                found.push(Found { path: shown, file: path, kind, sha256, bytes });
            }
            Err(error) => warnings.push(Warning { path: shown, message: format!("cannot be read: {error}") }),
        }
    }
    Ok(())
}

fn relative(root: &Path, path: &Path) -> String {
    let relative = path.strip_prefix(root).unwrap_or(path);
    relative.components().map(|c| c.as_os_str().to_string_lossy()).collect::<Vec<_>>().join("/")
}

/// The text of a found file, or why it has none.
pub fn read(found: &Found) -> Result<Document, String> {
    let document = |text: String, title: Option<String>, page_lines: Vec<usize>| Document {
        path: found.path.clone(),
        kind: found.kind,
        title,
        text,
        page_lines,
    };
    let doc = match found.kind {
        DocKind::Markdown | DocKind::Text => document(utf8_text(&found.bytes)?, None, Vec::new()),
        DocKind::Html => {
            let (title, text) = html_text(&utf8_text(&found.bytes)?)?;
            document(text, (!title.trim().is_empty()).then(|| title.trim().to_owned()), Vec::new())
        }
        DocKind::Pdf => {
            let pages = pdf_pages(&found.bytes)?;
            let mut text = String::new();
            let mut page_lines = Vec::with_capacity(pages.len());
            for page in pages {
                page_lines.push(text.lines().count() + 1);
                text.push_str(page.trim_end());
                text.push_str("\n\n");
            }
            document(text, None, page_lines)
        }
    };
    if doc.text.trim().is_empty() {
        return Err(match found.kind {
            // pdf-extract gives empty pages for both: they cannot be told apart.
            DocKind::Pdf => {
                "has no text to read (a scanned PDF holds only images, or its pages could not be read): \
                 skipped"
                    .into()
            }
            _ => "is empty: skipped".into(),
        });
    }
    Ok(doc)
}

/// The bytes as text: UTF-8 (a byte-order mark dropped), without NUL bytes.
fn utf8_text(bytes: &[u8]) -> Result<String, String> {
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    if bytes.contains(&0) {
        return Err("holds binary data (NUL bytes), not text: skipped".into());
    }
    match std::str::from_utf8(bytes) {
        Ok(text) => Ok(text.replace("\r\n", "\n")),
        Err(error) => Err(format!(
            "is not UTF-8 text (invalid byte at offset {}): skipped (save it as UTF-8)",
            error.valid_up_to()
        )),
    }
}

/// An HTML page's title and its whole text as Markdown (every part of the page: a document
/// is not an article with navigation around it).
fn html_text(html: &str) -> Result<(String, String), String> {
    use dom_smoothie::{Config, ParsePolicy, Readability, TextMode};
    // A page nested that deep costs the parser minutes, or its stack (see `keel_tools::html`).
    if keel_tools::html::within_nesting(html).1 {
        return Err(format!(
            "nests its elements more than {} levels deep, which no document needs: skipped",
            keel_tools::html::MAX_NESTING
        ));
    }
    let config =
        Config { text_mode: TextMode::Markdown, max_elements_to_parse: 200_000, ..Config::default() };
    let mut readability = Readability::new(html, None, Some(config))
        .map_err(|e| format!("is HTML that cannot be read ({e}): skipped"))?;
    let article = readability
        .parse_with_policy(ParsePolicy::Raw)
        .map_err(|e| format!("is HTML that cannot be read ({e}): skipped"))?;
    Ok((article.title, article.text_content.to_string()))
}

/// A PDF's text, page by page. The PDF parser panics on some broken files: a panic is a file
/// that does not parse, never a crash.
fn pdf_pages(bytes: &[u8]) -> Result<Vec<String>, String> {
    let parsed = std::panic::catch_unwind(|| pdf_extract::extract_text_from_mem_by_pages(bytes));
    match parsed {
        Ok(Ok(pages)) => Ok(pages),
        Ok(Err(error)) => Err(format!("is a PDF that does not parse ({error}): skipped")),
        Err(_) => Err("is a PDF that does not parse (the PDF reader gave up on it): skipped".into()),
    }
}
