//! Bounding how deeply a page's elements nest before it is parsed into a tree.
//!
//! html5ever's tree builder checks the open elements' scope on most start tags, and readability's
//! heuristics walk ancestors and subtrees, so their time grows with the depth for every
//! element, and parts of both recurse: a web page of 20,000 nested tables (300 KB) overflowed
//! the stack and aborted the whole process, 8,000 nested `div`s (40 KB) took 12 s of CPU, and
//! 8,000 nested lists (64 KB) came out as 128 MB of indented Markdown. Any page an agent is
//! asked to read can be built that way. A page is tokenized first (linear, no tree), and what
//! lies past the nesting limit is left unread.

use std::cell::{Cell, RefCell};

use html5ever::tendril::StrTendril;
use html5ever::tokenizer::states::RawKind;
use html5ever::tokenizer::{
    BufferQueue, TagKind, Token, TokenSink, TokenSinkResult, Tokenizer, TokenizerOpts,
};
use html5ever::{LocalName, local_name};

/// How deeply elements may nest, counting those that need an end tag (`div`, `table`, `ul`,
/// `b`...). Blink caps its trees at 512 levels; an article nests a few dozen.
pub const MAX_NESTING: usize = 256;

/// How finely a page is cut: it is tokenized this many bytes at a time.
const CHUNK: usize = 1024;

/// `html` as far as its elements nest at most [`MAX_NESTING`] deep, and whether that is less
/// than all of it: then it ends before the kilobyte where the nesting passed the limit.
pub fn within_nesting(html: &str) -> (&str, bool) {
    let tokenizer = Tokenizer::new(Nesting::default(), TokenizerOpts::default());
    let queue = BufferQueue::default();
    let mut start = 0;
    while start < html.len() {
        let mut end = (start + CHUNK).min(html.len());
        while !html.is_char_boundary(end) {
            end += 1;
        }
        queue.push_back(StrTendril::from_slice(&html[start..end]));
        // The sink never asks to run a script, so a feed always reads the whole chunk.
        let _ = tokenizer.feed(&queue);
        if tokenizer.sink.too_deep.get() {
            return (&html[..start], true);
        }
        start = end;
    }
    (html, false)
}

/// The elements open at the current token, as a tree builder would hold them, counting only
/// those whose nesting can grow without end.
#[derive(Default)]
struct Nesting {
    open: RefCell<Vec<LocalName>>,
    /// The index in `open` of the outermost `svg` or `math`, inside which `<x/>` is closed.
    foreign_from: Cell<Option<usize>>,
    too_deep: Cell<bool>,
}

impl TokenSink for Nesting {
    type Handle = ();

    fn process_token(&self, token: Token, _line: u64) -> TokenSinkResult<()> {
        let Token::TagToken(tag) = token else { return TokenSinkResult::Continue };
        let mut open = self.open.borrow_mut();
        if tag.kind == TagKind::EndTag {
            if let Some(at) = open.iter().rposition(|name| *name == tag.name) {
                open.truncate(at);
                if self.foreign_from.get().is_some_and(|from| from >= at) {
                    self.foreign_from.set(None);
                }
            }
            return TokenSinkResult::Continue;
        }
        let foreign = self.foreign_from.get().is_some();
        if (tag.self_closing && foreign) || ends_by_itself(&tag.name) {
            return TokenSinkResult::Continue;
        }
        if !foreign && matches!(tag.name, local_name!("svg") | local_name!("math")) {
            self.foreign_from.set(Some(open.len()));
        }
        // These never nest in themselves: a second start tag closes the first (a link left
        // open before the next one is common in old pages).
        if !foreign
            && matches!(
                tag.name,
                local_name!("a") | local_name!("button") | local_name!("nobr") | local_name!("form")
            )
            && let Some(at) = open.iter().rposition(|name| *name == tag.name)
        {
            open.truncate(at);
        }
        open.push(tag.name.clone());
        if open.len() > MAX_NESTING {
            self.too_deep.set(true);
        }
        if foreign {
            return TokenSinkResult::Continue;
        }
        // What the tree builder tells the tokenizer, so that a script's or a style's text is
        // not read as tags.
        match tag.name {
            local_name!("script") => TokenSinkResult::RawData(RawKind::ScriptData),
            local_name!("style")
            | local_name!("xmp")
            | local_name!("iframe")
            | local_name!("noembed")
            | local_name!("noframes") => TokenSinkResult::RawData(RawKind::Rawtext),
            local_name!("title") | local_name!("textarea") => TokenSinkResult::RawData(RawKind::Rcdata),
            local_name!("plaintext") => TokenSinkResult::Plaintext,
            _ => TokenSinkResult::Continue,
        }
    }
}

/// Elements that never hold others (void elements) or whose end tag may be left out because
/// the next sibling or the parent's end closes them (`li`, `p`, `td`...): a page cannot nest
/// them into each other without an element of the other kind between each level, and those
/// are counted.
fn ends_by_itself(name: &LocalName) -> bool {
    matches!(
        *name,
        local_name!("area")
            | local_name!("base")
            | local_name!("br")
            | local_name!("col")
            | local_name!("embed")
            | local_name!("hr")
            | local_name!("img")
            | local_name!("input")
            | local_name!("link")
            | local_name!("meta")
            | local_name!("source")
            | local_name!("track")
            | local_name!("wbr")
            | local_name!("param")
            | local_name!("keygen")
            | local_name!("frame")
            | local_name!("html")
            | local_name!("head")
            | local_name!("body")
            | local_name!("li")
            | local_name!("p")
            | local_name!("dt")
            | local_name!("dd")
            | local_name!("option")
            | local_name!("optgroup")
            | local_name!("tr")
            | local_name!("td")
            | local_name!("th")
            | local_name!("thead")
            | local_name!("tbody")
            | local_name!("tfoot")
            | local_name!("colgroup")
            | local_name!("caption")
            | local_name!("rb")
            | local_name!("rt")
            | local_name!("rtc")
            | local_name!("rp")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_within_the_limit_is_read_whole() {
        let page = format!(
            "<html><body>{}<p>deep<ul><li>a<li>b</ul><br><img src=x>{}<svg><path/><g/></svg>\
             <script>if (a < b) {{ document.write('<div><div><div>') }}</script>{}</body></html>",
            "<div>".repeat(MAX_NESTING - 3),
            "</div>".repeat(MAX_NESTING - 3),
            "<p>unclosed paragraph<li>unclosed item<td>cell<a href=x>unclosed link".repeat(5_000),
        );
        assert_eq!(within_nesting(&page), (page.as_str(), false));
    }

    #[test]
    fn a_page_nested_past_the_limit_is_read_up_to_there() {
        let intro = "<html><body><h1>Title</h1><p>Some text é.</p>".repeat(100);
        // Each repetition opens `counted` elements that need an end tag.
        for (nest, counted) in [
            ("<div>", 1),
            ("<table><tr><td>", 1),
            ("<ul><li>", 1),
            ("<b><i>", 2),
            ("<svg><g>", 2),
            ("<div/>", 1),
        ] {
            let page = format!("{intro}{}deep text</body></html>", nest.repeat(20_000));
            let (read, cut) = within_nesting(&page);
            assert!(cut, "{nest}");
            assert!(read.starts_with(&intro), "{nest}");
            // Cut in the kilobyte where the limit was passed.
            let passed = intro.len() + MAX_NESTING.div_ceil(counted) * nest.len();
            assert!(
                read.len() <= passed && read.len() + CHUNK >= passed,
                "{nest}: {} bytes read",
                read.len()
            );
        }
    }
}
