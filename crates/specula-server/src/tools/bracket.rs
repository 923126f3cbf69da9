//! The bracket dialect: `[Calling tool: NAME({json})]`.
//!
//! The name is `[A-Za-z0-9_.:-]+`; the call starts at `(` followed by `{` (or `)`: no
//! arguments). The arguments are scanned with a string- and escape-aware JSON scanner, so code
//! arguments containing `})]`, quotes or backslashes inside strings do not end the call early.
//! The closing `)]` is consumed when present.

use super::scan::{push_args, Calls, JsonScan, Prose, Step, MAX_NAME};
use super::{ParserConfig, ToolEvent, ToolParser};

const OPEN: &str = "[Calling tool: ";
const CLOSE: &str = ")]";

#[derive(Debug, Clone)]
enum State {
    Prose,
    Name(String),
    /// After `(`, before the arguments.
    BeforeArgs(String),
    Args(usize, JsonScan),
    /// After the arguments: `)]`, matched up to `pos`.
    Close(usize),
}

fn name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':')
}

/// The bracket-dialect parser.
#[derive(Debug, Clone)]
pub struct Bracket {
    state: State,
    prose: Prose,
    calls: Calls,
    raw: String,
}

impl Bracket {
    pub fn new(cfg: &ParserConfig) -> Self {
        Self {
            state: State::Prose,
            prose: Prose::new(),
            calls: Calls::new(&cfg.id_prefix),
            raw: String::new(),
        }
    }

    fn not_a_call(&mut self, c: char, out: &mut Vec<ToolEvent>) {
        let raw = std::mem::take(&mut self.raw);
        self.prose.content(&raw, out);
        self.state = State::Prose;
        self.step(c, out);
    }

    fn step(&mut self, c: char, out: &mut Vec<ToolEvent>) {
        match std::mem::replace(&mut self.state, State::Prose) {
            State::Prose => {
                if self.prose.push(c, &[OPEN], out).is_some() {
                    self.raw = self.prose.begin() + OPEN;
                    self.state = State::Name(String::new());
                }
            }
            State::Name(mut name) => {
                if name_char(c) && name.len() < MAX_NAME {
                    name.push(c);
                    self.raw.push(c);
                    self.state = State::Name(name);
                } else if c == '(' && !name.is_empty() {
                    self.raw.push(c);
                    self.state = State::BeforeArgs(name);
                } else {
                    self.not_a_call(c, out);
                }
            }
            State::BeforeArgs(name) => {
                if c.is_whitespace() {
                    self.raw.push(c);
                    self.state = State::BeforeArgs(name);
                } else if c == '{' {
                    self.raw.push(c);
                    let i = self.calls.start(&name, out);
                    push_args(out, i, "{");
                    let mut scan = JsonScan::new();
                    scan.push(c);
                    self.state = State::Args(i, scan);
                } else if c == ')' {
                    let i = self.calls.start(&name, out);
                    push_args(out, i, "{}");
                    out.push(ToolEvent::End { index: i });
                    self.raw.clear();
                    self.state = State::Close(1);
                } else {
                    self.not_a_call(c, out);
                }
            }
            State::Args(i, mut scan) => {
                self.raw.push(c);
                let mut b = [0u8; 4];
                push_args(out, i, c.encode_utf8(&mut b));
                if scan.push(c) == Step::Done {
                    out.push(ToolEvent::End { index: i });
                    self.raw.clear();
                    self.state = State::Close(0);
                } else {
                    self.state = State::Args(i, scan);
                }
            }
            State::Close(pos) => {
                if CLOSE[pos..].starts_with(c) {
                    if pos + 1 == CLOSE.len() {
                        self.prose.call_ended();
                    } else {
                        self.state = State::Close(pos + 1);
                    }
                } else {
                    // No (complete) closing: what matched is content again.
                    self.prose.call_ended();
                    self.prose.content(&CLOSE[..pos], out);
                    self.step(c, out);
                }
            }
        }
    }
}

impl ToolParser for Bracket {
    fn feed(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        for c in text.chars() {
            self.step(c, out);
        }
    }

    fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        let raw = std::mem::take(&mut self.raw);
        match std::mem::replace(&mut self.state, State::Prose) {
            State::Prose => self.prose.finish(out),
            State::Name(_) | State::BeforeArgs(_) => out.push(ToolEvent::Unfinished { index: None, raw }),
            State::Args(i, _) => out.push(ToolEvent::Unfinished { index: Some(i), raw }),
            State::Close(_) => {}
        }
    }
}
