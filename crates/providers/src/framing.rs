//! Byte-stream framing: server-sent events (OpenAI, Anthropic, OpenRouter) and newline-delimited
//! JSON (Ollama).
//!
//! Both decoders take the body in whatever pieces the network delivers and hand complete
//! frames to a callback. A piece may end anywhere (inside a line, inside a multi-byte UTF-8
//! character): bytes wait in the buffer until their line is complete, and only whole lines are
//! decoded as UTF-8. Frames are borrowed from the decoder's buffers, which are reused, so a
//! steady stream allocates nothing here.
//!
//! SSE follows the WHATWG parsing rules that matter for model APIs: `LF`, `CRLF` and `CR` line
//! ends, `data:` with or without the space, several `data` lines joined by `\n`, comments
//! (`: ping`) and unknown fields ignored, a leading byte-order mark skipped. A body that ends
//! without the blank line after its last event still delivers that event: servers that close
//! right after `data: [DONE]` are common.
//!
//! Why not a crate: SSE crates such as `eventsource-stream` hand out owned events (a `String`
//! per field, per event) and want the body as a `Stream`; these decoders are on the path of
//! every streamed token, take plain byte slices from any source, and `benches/decode.rs`
//! measures what they cost.

use std::fmt;

/// One server-sent event, borrowed from the decoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SseEvent<'a> {
    /// The `event:` field (`message` when absent).
    pub event: &'a str,
    /// The `data:` lines, joined by `\n`.
    pub data: &'a str,
}

/// The longest line a decoder holds while waiting for its end: far above any real event (a
/// whole tool input in one chunk), low enough that a server that never sends a line end cannot
/// exhaust memory.
pub const MAX_LINE: usize = 32 * 1024 * 1024;

/// Why a body cannot be framed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FramingError {
    /// Where the bad line starts, in bytes from the start of the body.
    pub offset: u64,
    /// What is wrong with it.
    pub problem: FramingProblem,
}

/// What is wrong with a line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FramingProblem {
    /// It is not valid UTF-8.
    NotUtf8,
    /// It is longer than [`MAX_LINE`].
    TooLong,
}

impl fmt::Display for FramingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.problem {
            FramingProblem::NotUtf8 => {
                write!(f, "the stream is not valid UTF-8 (line at byte {})", self.offset)
            }
            FramingProblem::TooLong => {
                write!(f, "the stream has a line over {MAX_LINE} bytes (from byte {})", self.offset)
            }
        }
    }
}

/// Splits a byte stream into lines, whatever the pieces it arrives in.
#[derive(Debug, Default)]
struct Lines {
    buf: Vec<u8>,
    /// Bytes of the body consumed before `buf[0]`.
    consumed: u64,
    /// The last line ended with `CR`: a `LF` right after it belongs to that line end.
    after_cr: bool,
    /// How much of `buf` is known to hold no line end: a long line arriving in many pieces is
    /// scanned once, not once per piece.
    scanned: usize,
}

impl Lines {
    /// Appends `chunk` and calls `line` with each complete line (without its end).
    fn feed<E: From<FramingError>>(
        &mut self,
        chunk: &[u8],
        mut line: impl FnMut(&str) -> Result<(), E>,
    ) -> Result<(), E> {
        self.buf.extend_from_slice(chunk);
        let mut start = 0;
        let mut from = self.scanned.min(self.buf.len());
        while let Some(found) = memchr::memchr2(b'\n', b'\r', &self.buf[from..]) {
            let end = from + found;
            if self.after_cr && end == start && self.buf[end] == b'\n' {
                // The LF of a CRLF split across two pieces.
                self.after_cr = false;
                start = end + 1;
                from = start;
                continue;
            }
            self.after_cr = false;
            let text = self.text(start, end)?;
            line(text)?;
            start = end + 1;
            if self.buf[end] == b'\r' {
                if self.buf.get(start) == Some(&b'\n') {
                    start += 1;
                } else if start == self.buf.len() {
                    self.after_cr = true;
                }
            }
            from = start;
        }
        self.consumed += start as u64;
        self.buf.drain(..start);
        self.scanned = self.buf.len();
        if self.buf.len() > MAX_LINE {
            return Err(FramingError { offset: self.consumed, problem: FramingProblem::TooLong }.into());
        }
        Ok(())
    }

    /// Delivers the last line when the body ended without a line end.
    fn finish<E: From<FramingError>>(
        &mut self,
        mut line: impl FnMut(&str) -> Result<(), E>,
    ) -> Result<(), E> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let end = self.buf.len();
        let text = self.text(0, end)?;
        line(text)?;
        self.buf.clear();
        self.scanned = 0;
        Ok(())
    }

    fn text(&self, start: usize, end: usize) -> Result<&str, FramingError> {
        std::str::from_utf8(&self.buf[start..end]).map_err(|_| FramingError {
            offset: self.consumed + start as u64,
            problem: FramingProblem::NotUtf8,
        })
    }
}

/// Decodes a `text/event-stream` body.
#[derive(Debug, Default)]
pub struct SseDecoder {
    lines: Lines,
    event: String,
    data: String,
    has_data: bool,
    started: bool,
}

impl SseDecoder {
    /// A decoder at the start of a body.
    pub fn new() -> SseDecoder {
        SseDecoder::default()
    }

    /// Feeds the next piece of the body; `on_event` gets each event it completes.
    pub fn feed<E: From<FramingError>>(
        &mut self,
        chunk: &[u8],
        mut on_event: impl FnMut(SseEvent<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        let Self { lines, event, data, has_data, started } = self;
        lines.feed(chunk, |line| field(line, event, data, has_data, started, &mut on_event))
    }

    /// Ends the body: an event that was not followed by a blank line is delivered too.
    pub fn finish<E: From<FramingError>>(
        &mut self,
        mut on_event: impl FnMut(SseEvent<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        let Self { lines, event, data, has_data, started } = self;
        lines.finish(|line| field(line, event, data, has_data, started, &mut on_event))?;
        field("", event, data, has_data, started, &mut on_event)
    }
}

/// Handles one line of an event stream.
fn field<E>(
    mut line: &str,
    event: &mut String,
    data: &mut String,
    has_data: &mut bool,
    started: &mut bool,
    on_event: &mut impl FnMut(SseEvent<'_>) -> Result<(), E>,
) -> Result<(), E> {
    if !*started {
        *started = true;
        line = line.strip_prefix('\u{feff}').unwrap_or(line);
    }
    if line.is_empty() {
        let result = if *has_data {
            let name = if event.is_empty() { "message" } else { event.as_str() };
            on_event(SseEvent { event: name, data })
        } else {
            Ok(())
        };
        event.clear();
        data.clear();
        *has_data = false;
        return result;
    }
    let (name, value) = match line.split_once(':') {
        Some((name, value)) => (name, value.strip_prefix(' ').unwrap_or(value)),
        None => (line, ""),
    };
    match name {
        "data" => {
            if *has_data {
                data.push('\n');
            }
            data.push_str(value);
            *has_data = true;
        }
        "event" => {
            event.clear();
            event.push_str(value);
        }
        // Comments (empty name), `id`, `retry` and unknown fields mean nothing to a model stream.
        _ => {}
    }
    Ok(())
}

/// Decodes a newline-delimited JSON body (one JSON value per line; blank lines skipped).
#[derive(Debug, Default)]
pub struct NdjsonDecoder {
    lines: Lines,
}

impl NdjsonDecoder {
    /// A decoder at the start of a body.
    pub fn new() -> NdjsonDecoder {
        NdjsonDecoder::default()
    }

    /// Feeds the next piece of the body; `on_line` gets each complete, non-blank line.
    pub fn feed<E: From<FramingError>>(
        &mut self,
        chunk: &[u8],
        mut on_line: impl FnMut(&str) -> Result<(), E>,
    ) -> Result<(), E> {
        self.lines.feed(chunk, |line| if line.trim().is_empty() { Ok(()) } else { on_line(line) })
    }

    /// Ends the body: a last line without its newline is delivered too.
    pub fn finish<E: From<FramingError>>(
        &mut self,
        mut on_line: impl FnMut(&str) -> Result<(), E>,
    ) -> Result<(), E> {
        self.lines.finish(|line| if line.trim().is_empty() { Ok(()) } else { on_line(line) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events_of(pieces: &[&[u8]]) -> Result<Vec<(String, String)>, FramingError> {
        let mut decoder = SseDecoder::new();
        let mut out = Vec::new();
        for piece in pieces {
            decoder.feed(piece, |e: SseEvent<'_>| {
                out.push((e.event.to_owned(), e.data.to_owned()));
                Ok::<_, FramingError>(())
            })?;
        }
        decoder.finish(|e: SseEvent<'_>| {
            out.push((e.event.to_owned(), e.data.to_owned()));
            Ok::<_, FramingError>(())
        })?;
        Ok(out)
    }

    /// Every way of cutting `body` in two gives the same events as the whole body.
    fn same_at_every_split(body: &[u8]) -> Vec<(String, String)> {
        let whole = events_of(&[body]).unwrap();
        for cut in 0..=body.len() {
            assert_eq!(events_of(&[&body[..cut], &body[cut..]]).unwrap(), whole, "cut at {cut}");
        }
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(events_of(&bytes).unwrap(), whole, "byte by byte");
        whole
    }

    #[test]
    fn line_ends_fields_and_comments() {
        let body = "\u{feff}: ping\r\nevent: message_start\r\ndata: {\"a\":1}\r\n\r\ndata:x\rdata: y\r\r\
                    id: 7\nretry: 10\nunknown: z\ndata: [DONE]\n\n"
            .as_bytes();
        let events = same_at_every_split(body);
        assert_eq!(
            events,
            [
                ("message_start".to_owned(), "{\"a\":1}".to_owned()),
                ("message".to_owned(), "x\ny".to_owned()),
                ("message".to_owned(), "[DONE]".to_owned()),
            ]
        );
    }

    #[test]
    fn a_multibyte_character_split_across_pieces_survives() {
        let body = "data: {\"content\":\"héllo 👋 世界\"}\n\n".as_bytes();
        let events = same_at_every_split(body);
        assert_eq!(events[0].1, "{\"content\":\"héllo 👋 世界\"}");
    }

    #[test]
    fn an_event_without_its_blank_line_at_the_end_is_delivered() {
        assert_eq!(events_of(&[b"data: [DONE]"]).unwrap(), [("message".to_owned(), "[DONE]".to_owned())]);
        assert_eq!(events_of(&[b"data: a\n"]).unwrap(), [("message".to_owned(), "a".to_owned())]);
        assert!(events_of(&[b": only a comment\n\n"]).unwrap().is_empty());
    }

    #[test]
    fn invalid_utf8_is_an_error_with_its_offset() {
        let error = events_of(&[b"data: ok\n\n", b"data: \xff\xfe\n\n"]).unwrap_err();
        assert_eq!(error, FramingError { offset: 10, problem: FramingProblem::NotUtf8 });
    }

    #[test]
    fn a_line_that_never_ends_is_refused_before_it_exhausts_memory() {
        let mut decoder = SseDecoder::new();
        let piece = vec![b'x'; 1024 * 1024];
        let mut result = Ok(());
        for _ in 0..40 {
            result = decoder.feed(&piece, |_| Ok::<_, FramingError>(()));
            if result.is_err() {
                break;
            }
        }
        assert_eq!(result, Err(FramingError { offset: 0, problem: FramingProblem::TooLong }));
    }

    #[test]
    fn ndjson_lines_at_every_split() {
        let body = "{\"a\":\"é\"}\n\n{\"b\":2}\r\n{\"c\":3}".as_bytes();
        let run = |pieces: &[&[u8]]| {
            let mut decoder = NdjsonDecoder::new();
            let mut out = Vec::new();
            for piece in pieces {
                decoder
                    .feed(piece, |line| {
                        out.push(line.to_owned());
                        Ok::<_, FramingError>(())
                    })
                    .unwrap();
            }
            decoder
                .finish(|line| {
                    out.push(line.to_owned());
                    Ok::<_, FramingError>(())
                })
                .unwrap();
            out
        };
        for cut in 0..=body.len() {
            assert_eq!(
                run(&[&body[..cut], &body[cut..]]),
                ["{\"a\":\"é\"}", "{\"b\":2}", "{\"c\":3}"],
                "cut {cut}"
            );
        }
    }
}
