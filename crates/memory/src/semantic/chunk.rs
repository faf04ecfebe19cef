//! Cutting documents into passages: what is ranked, shown and read.
//!
//! Paragraphs (text between blank lines) are gathered into passages of about
//! [`TARGET_CHARS`]; a paragraph longer than [`MAX_CHARS`] is cut at sentence ends (else at
//! spaces). A Markdown heading starts a new passage and titles the passages under it
//! (`Refunds › Deadlines`), as does a PDF page. Each passage knows the lines it spans.

use super::documents::{DocKind, Document};

/// The length passages are gathered up to, in characters.
pub const TARGET_CHARS: usize = 1_000;
/// The longest passage, in characters.
pub const MAX_CHARS: usize = 1_600;

/// A passage of a document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// The headings it is under (or the document's title), `›`-separated; empty when none.
    pub title: String,
    /// Its text.
    pub text: String,
    /// The first line of the document it covers (from 1).
    pub start_line: usize,
    /// The last line it covers.
    pub end_line: usize,
    /// For a PDF, the page it starts on (from 1).
    pub page: Option<usize>,
}

/// The passages of a document, in order.
pub fn chunks(document: &Document) -> Vec<Chunk> {
    let mut out = Vec::new();
    let mut headings: Vec<(usize, String)> = Vec::new();
    let base_title = document.title.clone().unwrap_or_default();
    let title_of = |headings: &[(usize, String)]| {
        let mut parts: Vec<&str> = Vec::new();
        if !base_title.is_empty() {
            parts.push(&base_title);
        }
        parts.extend(headings.iter().map(|(_, h)| h.as_str()));
        parts.join(" › ")
    };
    let mut current = Pending::default();
    let mut paragraph = Pending::default();
    let mut page = 0usize;
    let mut in_fence = false;
    for (index, line) in document.text.lines().enumerate() {
        let number = index + 1;
        if document.page_lines.get(page).is_some_and(|&start| start <= number) {
            // A new page starts a new passage.
            current.take_paragraph(&mut paragraph);
            current.flush(&title_of(&headings), document_page(document, page), &mut out);
            while document.page_lines.get(page).is_some_and(|&start| start <= number) {
                page += 1;
            }
        }
        let trimmed = line.trim();
        if document.kind != DocKind::Text && trimmed.starts_with("```") {
            in_fence = !in_fence;
        }
        let heading = (document.kind != DocKind::Text && !in_fence).then(|| heading(trimmed)).flatten();
        if let Some((level, text)) = heading {
            current.take_paragraph(&mut paragraph);
            current.flush(&title_of(&headings), document_page(document, page), &mut out);
            headings.retain(|(l, _)| *l < level);
            headings.push((level, text));
            continue;
        }
        if trimmed.is_empty() && !in_fence {
            if current.len() + paragraph.len() > TARGET_CHARS {
                current.flush(&title_of(&headings), document_page(document, page), &mut out);
            }
            current.take_paragraph(&mut paragraph);
            continue;
        }
        paragraph.push_line(line.trim_end(), number);
        if paragraph.len() > MAX_CHARS {
            // One long paragraph: cut it at sentence ends into passages of its own.
            current.flush(&title_of(&headings), document_page(document, page), &mut out);
            for piece in split_long(&paragraph.text) {
                let chunk = Chunk {
                    title: title_of(&headings),
                    text: piece,
                    start_line: paragraph.start,
                    end_line: paragraph.end,
                    page: document_page(document, page),
                };
                out.push(chunk);
            }
            paragraph = Pending::default();
        }
    }
    if current.len() + paragraph.len() > MAX_CHARS {
        current.flush(&title_of(&headings), document_page(document, page), &mut out);
    }
    current.take_paragraph(&mut paragraph);
    current.flush(&title_of(&headings), document_page(document, page), &mut out);
    out
}

fn document_page(document: &Document, pages_started: usize) -> Option<usize> {
    (!document.page_lines.is_empty()).then_some(pages_started.max(1))
}

/// A Markdown ATX heading's level and text (`## Refunds` → 2, "Refunds").
fn heading(line: &str) -> Option<(usize, String)> {
    let level = line.bytes().take_while(|&b| b == b'#').count();
    if level == 0 || level > 6 {
        return None;
    }
    let rest = &line[level..];
    if !rest.is_empty() && !rest.starts_with(' ') {
        return None;
    }
    let text = rest.trim().trim_end_matches('#').trim();
    (!text.is_empty()).then(|| (level, text.to_owned()))
}

/// Text being gathered, with the lines it spans.
#[derive(Default)]
struct Pending {
    text: String,
    start: usize,
    end: usize,
}

impl Pending {
    fn len(&self) -> usize {
        self.text.len()
    }

    fn push_line(&mut self, line: &str, number: usize) {
        if self.text.is_empty() {
            self.start = number;
        } else {
            self.text.push('\n');
        }
        self.text.push_str(line);
        self.end = number;
    }

    /// Appends a finished paragraph (a blank line between).
    fn take_paragraph(&mut self, paragraph: &mut Pending) {
        if paragraph.text.is_empty() {
            return;
        }
        if self.text.is_empty() {
            self.start = paragraph.start;
        } else {
            self.text.push_str("\n\n");
        }
        self.text.push_str(&paragraph.text);
        self.end = paragraph.end;
        *paragraph = Pending::default();
    }

    fn flush(&mut self, title: &str, page: Option<usize>, out: &mut Vec<Chunk>) {
        let text = std::mem::take(&mut self.text);
        if !text.trim().is_empty() {
            out.push(Chunk {
                title: title.to_owned(),
                text: text.trim().to_owned(),
                start_line: self.start,
                end_line: self.end,
                page,
            });
        }
        *self = Pending::default();
    }
}

/// A long paragraph cut into pieces of about [`TARGET_CHARS`]: at a sentence's end when one is
/// near, else at a space, else anywhere (on a character boundary).
fn split_long(text: &str) -> Vec<String> {
    let mut pieces = Vec::new();
    let mut rest = text.trim();
    while rest.len() > MAX_CHARS {
        let window = floor_boundary(rest, TARGET_CHARS);
        let head = &rest[..window];
        let sentence = [". ", "! ", "? ", ".\n", ".\u{201d} ", ".\" "]
            .iter()
            .filter_map(|end| head.rfind(end).map(|at| at + end.len()))
            .max()
            .filter(|&at| at > TARGET_CHARS / 2);
        let cut = sentence.or_else(|| head.rfind(' ').filter(|&at| at > TARGET_CHARS / 2)).unwrap_or(window);
        pieces.push(rest[..cut].trim().to_owned());
        rest = rest[cut..].trim_start();
    }
    if !rest.is_empty() {
        pieces.push(rest.to_owned());
    }
    pieces
}

/// The largest character boundary of `text` at or below `at`.
fn floor_boundary(text: &str, at: usize) -> usize {
    let mut at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(kind: DocKind, text: &str) -> Document {
        Document { path: "a.md".into(), kind, title: None, text: text.into(), page_lines: Vec::new() }
    }

    #[test]
    fn headings_title_the_passages_under_them_and_lines_are_kept() {
        let text = "# Refunds\n\nWithin 30 days.\n\n## Deadlines\n\nAsk by email.\nWe answer in a day.\n\n# Shipping\nFree over 50 EUR.\n";
        let got = chunks(&doc(DocKind::Markdown, text));
        let summary: Vec<(String, String, usize, usize)> =
            got.into_iter().map(|c| (c.title, c.text, c.start_line, c.end_line)).collect();
        assert_eq!(
            summary,
            vec![
                ("Refunds".into(), "Within 30 days.".into(), 3, 3),
                ("Refunds › Deadlines".into(), "Ask by email.\nWe answer in a day.".into(), 7, 8),
                ("Shipping".into(), "Free over 50 EUR.".into(), 11, 11),
            ]
        );
    }

    #[test]
    fn a_hash_in_plain_text_or_code_is_no_heading() {
        let text = "#1 on the list\n\n```\n# a comment\n```\n";
        assert_eq!(chunks(&doc(DocKind::Text, text)).len(), 1);
        let code = "Intro.\n\n```sh\n# install\nmake\n```\n";
        let got = chunks(&doc(DocKind::Markdown, code));
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(got[0].text.contains("# install"));
    }

    #[test]
    fn paragraphs_gather_up_to_the_target_and_long_ones_are_cut_at_sentences() {
        let sentence = "The committee met on Tuesday and agreed on the budget. ";
        let long = sentence.repeat(100);
        let got = chunks(&doc(DocKind::Text, &long));
        assert!(got.len() >= 4, "{}", got.len());
        for chunk in &got {
            assert!(chunk.text.len() <= MAX_CHARS, "{}", chunk.text.len());
            assert!(chunk.text.ends_with("budget."), "{:?}", &chunk.text[chunk.text.len() - 20..]);
        }
        let short: String = (0..100).map(|i| format!("Paragraph {i} is short.\n\n")).collect();
        let got = chunks(&doc(DocKind::Text, &short));
        assert_eq!(got.len(), 3, "{got:?}");
        assert_eq!(got[0].start_line, 1);
        assert_eq!(got[1].start_line, got[0].end_line + 2);
        assert!(got.iter().all(|c| c.text.len() <= TARGET_CHARS), "{got:?}");
    }

    #[test]
    fn text_without_spaces_or_in_many_scripts_is_cut_on_character_boundaries() {
        let text = "日本語のテキスト".repeat(400);
        let got = chunks(&doc(DocKind::Text, &text));
        assert!(got.len() > 1);
        assert_eq!(got.iter().map(|c| c.text.as_str()).collect::<String>(), text);
    }

    #[test]
    fn pdf_pages_start_passages_and_are_numbered() {
        let document = Document {
            path: "a.pdf".into(),
            kind: DocKind::Pdf,
            title: None,
            text: "First page.\n\nSecond page.\n\n".into(),
            page_lines: vec![1, 3],
        };
        let got = chunks(&document);
        assert_eq!(
            got.iter().map(|c| (c.text.as_str(), c.page)).collect::<Vec<_>>(),
            vec![("First page.", Some(1)), ("Second page.", Some(2))]
        );
    }
}
