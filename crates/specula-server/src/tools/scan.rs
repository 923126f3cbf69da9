//! Building blocks shared by the dialect parsers (and the reasoning splitter): an exact-marker
//! matcher, a string- and escape-aware JSON value scanner, the incremental parser of a
//! `{"name": ..., "arguments": ...}` call object, and event output that merges adjacent pieces.
//!
//! Everything here consumes one `char` at a time and decides only from what it has seen, so the
//! events of a text do not depend on how the text was cut into chunks (after merging adjacent
//! content and argument pieces).

use std::collections::HashSet;
use std::sync::Arc;

use super::ToolEvent;

/// Matches exact markers in a char stream. Chars that can no longer begin a marker are released;
/// a possible marker prefix is held until it completes or fails.
#[derive(Debug, Default, Clone)]
pub(crate) struct Markers {
    pending: String,
}

impl Markers {
    /// Push `c`. Released chars are appended to `released`; returns the index of the marker that
    /// `c` completed.
    pub fn push(&mut self, c: char, markers: &[&str], released: &mut String) -> Option<usize> {
        self.pending.push(c);
        loop {
            if let Some(i) = markers.iter().position(|m| *m == self.pending) {
                self.pending.clear();
                return Some(i);
            }
            if markers.iter().any(|m| m.starts_with(self.pending.as_str())) {
                return None;
            }
            let first = self.pending.chars().next()?;
            released.push(first);
            self.pending.drain(..first.len_utf8());
            if self.pending.is_empty() {
                return None;
            }
        }
    }

    /// The held prefix (cleared).
    pub fn take(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}

/// What [`JsonScan::push`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// The char belongs to the value; the value goes on.
    More,
    /// The char ends the value (a closing bracket or quote).
    Done,
    /// The value (a bare number or literal) ended *before* this char, which is not part of it.
    DoneBefore,
    /// The char cannot start a JSON value.
    Invalid,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ScanKind {
    Init,
    Container,
    Str,
    Primitive,
}

/// A lexical scanner of one JSON value: brackets are balanced outside strings, string escapes
/// are honoured, so `"})]"` inside a string does not end anything. It is lenient: any closing
/// bracket closes the innermost open one, and the inside of containers is not validated.
#[derive(Debug, Clone)]
pub(crate) struct JsonScan {
    kind: ScanKind,
    depth: usize,
    in_str: bool,
    escaped: bool,
}

impl JsonScan {
    pub fn new() -> Self {
        Self {
            kind: ScanKind::Init,
            depth: 0,
            in_str: false,
            escaped: false,
        }
    }

    /// A scanner already inside an object (for skipping the rest of one).
    pub fn inside_object() -> Self {
        Self {
            kind: ScanKind::Container,
            depth: 1,
            in_str: false,
            escaped: false,
        }
    }

    pub fn push(&mut self, c: char) -> Step {
        match self.kind {
            ScanKind::Init => match c {
                '{' | '[' => {
                    self.kind = ScanKind::Container;
                    self.depth = 1;
                    Step::More
                }
                '"' => {
                    self.kind = ScanKind::Str;
                    Step::More
                }
                '-' | '0'..='9' | 't' | 'f' | 'n' => {
                    self.kind = ScanKind::Primitive;
                    Step::More
                }
                _ => Step::Invalid,
            },
            ScanKind::Str => {
                if self.escaped {
                    self.escaped = false;
                    Step::More
                } else if c == '\\' {
                    self.escaped = true;
                    Step::More
                } else if c == '"' {
                    Step::Done
                } else {
                    Step::More
                }
            }
            ScanKind::Primitive => {
                if c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.') {
                    Step::More
                } else {
                    Step::DoneBefore
                }
            }
            ScanKind::Container => {
                if self.in_str {
                    if self.escaped {
                        self.escaped = false;
                    } else if c == '\\' {
                        self.escaped = true;
                    } else if c == '"' {
                        self.in_str = false;
                    }
                    return Step::More;
                }
                match c {
                    '"' => {
                        self.in_str = true;
                        Step::More
                    }
                    '{' | '[' => {
                        self.depth += 1;
                        Step::More
                    }
                    '}' | ']' => {
                        self.depth = self.depth.saturating_sub(1);
                        if self.depth == 0 {
                            Step::Done
                        } else {
                            Step::More
                        }
                    }
                    _ => Step::More,
                }
            }
        }
    }
}

/// Append content, merging with a preceding content event.
pub(crate) fn push_content(out: &mut Vec<ToolEvent>, text: &str) {
    if text.is_empty() {
        return;
    }
    if let Some(ToolEvent::Content(s)) = out.last_mut() {
        s.push_str(text);
    } else {
        out.push(ToolEvent::Content(text.to_string()));
    }
}

/// Append an argument fragment, merging with a preceding fragment of the same call.
pub(crate) fn push_args(out: &mut Vec<ToolEvent>, index: usize, fragment: &str) {
    if fragment.is_empty() {
        return;
    }
    if let Some(ToolEvent::Args { index: i, fragment: f }) = out.last_mut() {
        if *i == index {
            f.push_str(fragment);
            return;
        }
    }
    out.push(ToolEvent::Args {
        index,
        fragment: fragment.to_string(),
    });
}

/// Call numbering and ids of one response.
#[derive(Debug, Clone)]
pub(crate) struct Calls {
    next: usize,
    id_prefix: String,
}

impl Calls {
    pub fn new(id_prefix: &str) -> Self {
        Self {
            next: 0,
            id_prefix: id_prefix.to_string(),
        }
    }

    /// Emit the start of a new call; returns its index.
    pub fn start(&mut self, name: &str, out: &mut Vec<ToolEvent>) -> usize {
        let index = self.next;
        self.next += 1;
        out.push(ToolEvent::Start {
            index,
            id: format!("{}{index}", self.id_prefix),
            name: name.to_string(),
        });
        index
    }
}

/// The set of offered tool names, when a form of call requires the name to be offered.
pub(crate) type Offered = Option<Arc<HashSet<String>>>;

/// Tool names are at most this long (OpenAI allows 64); longer is not a name.
pub(crate) const MAX_NAME: usize = 256;

/// Decode a JSON string literal (with its quotes).
pub(crate) fn decode_json_string(raw: &str) -> Option<String> {
    serde_json::from_str::<String>(raw).ok()
}

/// A char of a JSON string, escaped (without quotes).
pub(crate) fn escape_json_char(c: char, out: &mut String) {
    match c {
        '"' => out.push_str("\\\""),
        '\\' => out.push_str("\\\\"),
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        '\t' => out.push_str("\\t"),
        c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
        c => out.push(c),
    }
}

#[derive(Debug, Clone)]
enum ObjState {
    Open,
    BeforeKey,
    Key {
        raw: String,
        escaped: bool,
    },
    AfterKey,
    BeforeValue,
    Value(JsonScan),
    AfterValue,
    /// After the call started, a malformed rest of the object is skipped to its closing brace.
    Skip(JsonScan),
}

/// Which key's value is being scanned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Name,
    Args,
    Other,
}

/// What [`CallObject::push`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ObjStep {
    More,
    /// The object closed with this char; the call's `End` was emitted.
    Done,
    /// Not a call object; the char was not consumed and nothing was emitted.
    NotACall,
}

/// The incremental parser of one call object `{"name": "f", "arguments": {...}}` (also
/// `"parameters"`, Llama's name; other keys such as `"type"` or `"id"` are skipped). The call
/// starts (a `Start` event) as soon as its name is known, then the raw text of the arguments
/// value streams as `Args` fragments (held until the name is known when the arguments come
/// first). Arguments given as a JSON string are decoded and sent whole. No arguments = `{}`.
///
/// Before the start, anything malformed makes it "not a call" (the caller turns the held text
/// into content); after the start, a malformed rest is skipped to the closing brace.
#[derive(Debug, Clone)]
pub(crate) struct CallObject {
    state: ObjState,
    field: Field,
    keys: usize,
    /// The first key must be `"name"` (or `"type"`): for forms without an explicit marker.
    strict: bool,
    offered: Offered,
    name_raw: String,
    name_done: bool,
    args_done: bool,
    args_string: bool,
    args_raw: String,
    /// Argument text seen before the name.
    args_held: String,
    started: Option<usize>,
}

impl CallObject {
    pub fn new(strict: bool, offered: Offered) -> Self {
        Self {
            state: ObjState::Open,
            field: Field::Other,
            keys: 0,
            strict,
            offered,
            name_raw: String::new(),
            name_done: false,
            args_done: false,
            args_string: false,
            args_raw: String::new(),
            args_held: String::new(),
            started: None,
        }
    }

    /// The call index once started.
    pub fn started(&self) -> Option<usize> {
        self.started
    }

    fn emit_args(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        match self.started {
            Some(i) => push_args(out, i, text),
            None => self.args_held.push_str(text),
        }
    }

    fn invalid(&mut self) -> ObjStep {
        if self.started.is_some() {
            self.state = ObjState::Skip(JsonScan::inside_object());
            ObjStep::More
        } else {
            ObjStep::NotACall
        }
    }

    fn close(&mut self, out: &mut Vec<ToolEvent>) -> ObjStep {
        match self.started {
            Some(i) => {
                if !self.args_done {
                    push_args(out, i, "{}");
                }
                out.push(ToolEvent::End { index: i });
                ObjStep::Done
            }
            None => ObjStep::NotACall,
        }
    }

    fn value_char(&mut self, c: char, out: &mut Vec<ToolEvent>) {
        match self.field {
            Field::Name => self.name_raw.push(c),
            Field::Args => {
                if self.args_string {
                    self.args_raw.push(c);
                } else {
                    let mut b = [0u8; 4];
                    self.emit_args(c.encode_utf8(&mut b), out);
                }
            }
            Field::Other => {}
        }
    }

    /// The value of the current field ended. `Err(())`: not a call.
    fn value_end(&mut self, calls: &mut Calls, out: &mut Vec<ToolEvent>) -> Result<(), ()> {
        match self.field {
            Field::Name => {
                self.name_done = true;
                let Some(name) = decode_json_string(&self.name_raw) else {
                    return Err(());
                };
                if name.is_empty() || name.len() > MAX_NAME {
                    return Err(());
                }
                if let Some(offered) = &self.offered {
                    if !offered.contains(&name) {
                        return Err(());
                    }
                }
                let i = calls.start(&name, out);
                self.started = Some(i);
                let held = std::mem::take(&mut self.args_held);
                push_args(out, i, &held);
            }
            Field::Args => {
                self.args_done = true;
                if self.args_string {
                    let raw = std::mem::take(&mut self.args_raw);
                    let text = decode_json_string(&raw).unwrap_or(raw);
                    let text = if text.is_empty() { "{}".to_string() } else { text };
                    self.emit_args(&text, out);
                }
            }
            Field::Other => {}
        }
        self.field = Field::Other;
        Ok(())
    }

    pub fn push(&mut self, c: char, calls: &mut Calls, out: &mut Vec<ToolEvent>) -> ObjStep {
        loop {
            match &mut self.state {
                ObjState::Open => {
                    return if c == '{' {
                        self.state = ObjState::BeforeKey;
                        ObjStep::More
                    } else {
                        ObjStep::NotACall
                    };
                }
                ObjState::BeforeKey => {
                    return match c {
                        c if c.is_whitespace() => ObjStep::More,
                        ',' if self.keys > 0 => ObjStep::More,
                        '"' => {
                            self.state = ObjState::Key {
                                raw: "\"".to_string(),
                                escaped: false,
                            };
                            ObjStep::More
                        }
                        '}' => self.close(out),
                        _ => self.invalid(),
                    };
                }
                ObjState::Key { raw, escaped } => {
                    raw.push(c);
                    if *escaped {
                        *escaped = false;
                        return ObjStep::More;
                    }
                    if c == '\\' {
                        *escaped = true;
                        return ObjStep::More;
                    }
                    if c != '"' {
                        if raw.len() > 4096 && self.started.is_none() {
                            return ObjStep::NotACall;
                        }
                        return ObjStep::More;
                    }
                    let key = decode_json_string(raw);
                    self.keys += 1;
                    let key = match key {
                        Some(k) => k,
                        None => return self.invalid(),
                    };
                    if self.strict && self.keys == 1 && key != "name" && key != "type" {
                        return ObjStep::NotACall;
                    }
                    self.field = match key.as_str() {
                        "name" if !self.name_done => Field::Name,
                        "arguments" | "parameters" if !self.args_done => Field::Args,
                        _ => Field::Other,
                    };
                    self.state = ObjState::AfterKey;
                    return ObjStep::More;
                }
                ObjState::AfterKey => {
                    return match c {
                        c if c.is_whitespace() => ObjStep::More,
                        ':' => {
                            self.state = ObjState::BeforeValue;
                            ObjStep::More
                        }
                        _ => self.invalid(),
                    };
                }
                ObjState::BeforeValue => {
                    if c.is_whitespace() {
                        return ObjStep::More;
                    }
                    let mut scan = JsonScan::new();
                    match scan.push(c) {
                        Step::Invalid => return self.invalid(),
                        _ => {
                            if self.field == Field::Name && c != '"' {
                                return self.invalid();
                            }
                            if self.field == Field::Args && c == '"' {
                                self.args_string = true;
                            }
                            self.state = ObjState::Value(scan);
                            self.value_char(c, out);
                            // A one-char value cannot be complete yet (strings need their close
                            // quote, numbers a following delimiter, containers a bracket).
                            return ObjStep::More;
                        }
                    }
                }
                ObjState::Value(scan) => match scan.push(c) {
                    Step::More => {
                        self.value_char(c, out);
                        return ObjStep::More;
                    }
                    Step::Done => {
                        self.value_char(c, out);
                        self.state = ObjState::AfterValue;
                        return match self.value_end(calls, out) {
                            Ok(()) => ObjStep::More,
                            Err(()) => self.invalid(),
                        };
                    }
                    Step::DoneBefore => {
                        self.state = ObjState::AfterValue;
                        if self.value_end(calls, out).is_err() {
                            return self.invalid();
                        }
                        // Reconsider `c` after the value.
                        continue;
                    }
                    Step::Invalid => return self.invalid(),
                },
                ObjState::AfterValue => {
                    return match c {
                        c if c.is_whitespace() => ObjStep::More,
                        ',' => {
                            self.state = ObjState::BeforeKey;
                            ObjStep::More
                        }
                        '}' => self.close(out),
                        _ => self.invalid(),
                    };
                }
                ObjState::Skip(scan) => {
                    return match scan.push(c) {
                        Step::Done => self.close(out),
                        _ => ObjStep::More,
                    };
                }
            }
        }
    }
}

/// Progress through a fixed expected text, one char at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expect {
    /// Matched so far, not complete.
    Partial,
    /// The char completed the text.
    Complete,
    /// The char does not match (it was not consumed; `text[..pos]` was).
    Mismatch,
}

/// Match `c` against `text[*pos..]`.
pub(crate) fn expect(text: &str, pos: &mut usize, c: char) -> Expect {
    match text[*pos..].chars().next() {
        Some(e) if e == c => {
            *pos += c.len_utf8();
            if *pos == text.len() {
                Expect::Complete
            } else {
                Expect::Partial
            }
        }
        _ => Expect::Mismatch,
    }
}

/// Prose between calls. Exact markers are matched; whitespace is held back so that whitespace
/// next to a call (before its marker, after its end) is dropped, while whitespace inside prose
/// or at the end of a call-free text is kept.
#[derive(Debug, Clone)]
pub(crate) struct Prose {
    markers: Markers,
    gap: String,
    at_start: bool,
    after_call: bool,
}

impl Prose {
    pub fn new() -> Self {
        Self {
            markers: Markers::default(),
            gap: String::new(),
            at_start: true,
            after_call: false,
        }
    }

    /// Nothing but whitespace has been seen yet.
    pub fn at_start(&self) -> bool {
        self.at_start
    }

    /// Directly after a call (only whitespace since).
    pub fn after_call(&self) -> bool {
        self.after_call && self.markers.is_empty()
    }

    /// Directly at the start or directly after a call, with no marker prefix held: where a call
    /// without a marker (a bare JSON object) may begin.
    pub fn bare_allowed(&self, after_call_too: bool) -> bool {
        self.markers.is_empty() && (self.at_start || (after_call_too && self.after_call))
    }

    fn release(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        if text.is_empty() {
            return;
        }
        let gap = std::mem::take(&mut self.gap);
        if !self.after_call {
            push_content(out, &gap);
        }
        push_content(out, text);
        self.at_start = false;
        self.after_call = false;
    }

    /// Push `c`; returns the index of the marker it completed. Content goes to `out`.
    pub fn push(&mut self, c: char, markers: &[&str], out: &mut Vec<ToolEvent>) -> Option<usize> {
        if self.markers.is_empty() && c.is_whitespace() {
            self.gap.push(c);
            return None;
        }
        let mut released = String::new();
        let hit = self.markers.push(c, markers, &mut released);
        self.release(&released, out);
        hit
    }

    /// A call attempt begins here: returns the held whitespace (part of the attempt's raw text,
    /// should it turn out not to be a call).
    pub fn begin(&mut self) -> String {
        let mut raw = std::mem::take(&mut self.gap);
        raw.push_str(&self.markers.take());
        if self.after_call {
            raw.clear();
        }
        raw
    }

    /// A bare call attempt that ended at its first char: put the whitespace back and leave the
    /// start (that char is then looked at again as prose).
    pub fn skip_bare(&mut self, gap: String) {
        self.gap = gap;
        self.at_start = false;
    }

    /// Text that turned out not to be a call: content, as is.
    pub fn content(&mut self, raw: &str, out: &mut Vec<ToolEvent>) {
        if raw.is_empty() {
            return;
        }
        push_content(out, raw);
        self.at_start = false;
        self.after_call = false;
    }

    /// A call ended: whitespace that follows it is dropped.
    pub fn call_ended(&mut self) {
        self.gap.clear();
        self.at_start = false;
        self.after_call = true;
    }

    /// End of output: a held marker prefix is content; held whitespace is content unless it
    /// follows a call.
    pub fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        let pending = self.markers.take();
        if pending.is_empty() {
            if !self.after_call {
                let gap = std::mem::take(&mut self.gap);
                push_content(out, &gap);
            }
        } else {
            self.release(&pending, out);
        }
        self.gap.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_hold_prefixes_and_release_the_rest() {
        let mut m = Markers::default();
        let mut out = String::new();
        let mut hits = Vec::new();
        for c in "a<<tool_call>b<tool_x".chars() {
            if let Some(i) = m.push(c, &["<tool_call>"], &mut out) {
                hits.push((i, out.clone()));
            }
        }
        assert_eq!(hits, vec![(0, "a<".to_string())]);
        assert_eq!(out, "a<b<tool_x");
        assert!(m.is_empty());
    }

    #[test]
    fn json_scan_respects_strings_and_escapes() {
        let text = r#"{"code": "f({x})]\"}", "b": [1, {"c": "]"}]} tail"#;
        let mut s = JsonScan::new();
        let mut end = None;
        for (i, c) in text.char_indices() {
            if s.push(c) == Step::Done {
                end = Some(i);
                break;
            }
        }
        assert_eq!(end, Some(text.find(" tail").unwrap() - 1));
        let mut s = JsonScan::new();
        assert_eq!(s.push('1'), Step::More);
        assert_eq!(s.push('2'), Step::More);
        assert_eq!(s.push(','), Step::DoneBefore);
        assert_eq!(JsonScan::new().push('x'), Step::Invalid);
    }
}
