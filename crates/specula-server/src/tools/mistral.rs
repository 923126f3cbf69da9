//! Mistral tool calls:
//!
//! ```text
//! [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]
//! [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}
//! ```
//!
//! The first form (v3 tokenizers; an `"id"` key is ignored, Specula assigns ids) holds parallel
//! calls in one array; the second (v11+) repeats `[TOOL_CALLS]` per call.
//!
//! `[TOOL_CALLS]` is a control token in Mistral tokenizers, which Specula's detokenizer does not
//! print, so the array form is also recognised without it at the very start of the output
//! (`[{"name": ...` with an offered tool's name). The `[ARGS]` form needs the markers in the text.

use super::scan::{expect, push_args, CallObject, Calls, Expect, JsonScan, ObjStep, Offered, Prose, Step, MAX_NAME};
use super::{ParserConfig, ToolEvent, ToolParser};

const TOOL_CALLS: &str = "[TOOL_CALLS]";
const ARGS: &str = "[ARGS]";

#[derive(Debug, Clone)]
enum State {
    Prose,
    /// After `[TOOL_CALLS]`.
    Open,
    /// `[` at the start: an array of calls, or prose (also `[TOOL_CALLS]`).
    Bracket,
    /// After `[` of an array (`bare`: without `[TOOL_CALLS]`).
    ArrayOpen {
        bare: bool,
    },
    Object(CallObject),
    /// After an object of the array: `,` or `]`.
    ArrayNext,
    /// After `,` in the array.
    ArrayElem,
    /// `[TOOL_CALLS]NAME`, then `[ARGS]` matched up to `pos` (0 = still in the name).
    Name {
        name: String,
        pos: usize,
    },
    /// After `[ARGS]`, before the object.
    BeforeArgs(String),
    Args(usize, JsonScan),
}

fn name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')
}

/// The Mistral parser.
#[derive(Debug, Clone)]
pub struct Mistral {
    state: State,
    prose: Prose,
    calls: Calls,
    offered: Offered,
    raw: String,
    /// The current attempt started with `[TOOL_CALLS]`.
    marked: bool,
}

impl Mistral {
    pub fn new(cfg: &ParserConfig) -> Self {
        Self {
            state: State::Prose,
            prose: Prose::new(),
            calls: Calls::new(&cfg.id_prefix),
            offered: Some(cfg.offered()),
            raw: String::new(),
            marked: false,
        }
    }

    fn not_a_call(&mut self, replay: &str, c: char, out: &mut Vec<ToolEvent>) {
        let raw = std::mem::take(&mut self.raw);
        self.prose.content(&raw, out);
        self.state = State::Prose;
        for r in replay.chars() {
            self.step(r, out);
        }
        self.step(c, out);
    }

    /// The array ended (or broke off after a complete call): back to prose.
    fn array_over(&mut self, c: Option<char>, out: &mut Vec<ToolEvent>) {
        self.raw.clear();
        self.prose.call_ended();
        self.state = State::Prose;
        if let Some(c) = c {
            self.step(c, out);
        }
    }

    fn step(&mut self, c: char, out: &mut Vec<ToolEvent>) {
        match std::mem::replace(&mut self.state, State::Prose) {
            State::Prose => {
                if c == '[' && self.prose.bare_allowed(false) {
                    self.raw = self.prose.begin();
                    self.raw.push(c);
                    self.marked = false;
                    self.state = State::Bracket;
                    return;
                }
                if self.prose.push(c, &[TOOL_CALLS], out).is_some() {
                    self.raw = self.prose.begin() + TOOL_CALLS;
                    self.marked = true;
                    self.state = State::Open;
                }
            }
            State::Bracket => {
                if c.is_whitespace() || c == '{' {
                    self.state = State::ArrayOpen { bare: true };
                    self.step(c, out);
                } else {
                    let mut gap = std::mem::take(&mut self.raw);
                    gap.pop();
                    self.prose.skip_bare(gap);
                    self.step('[', out);
                    self.step(c, out);
                }
            }
            State::Open => {
                if c.is_whitespace() {
                    self.raw.push(c);
                    self.state = State::Open;
                } else if c == '[' {
                    self.raw.push(c);
                    self.state = State::ArrayOpen { bare: false };
                } else if name_char(c) {
                    self.state = State::Name {
                        name: c.to_string(),
                        pos: 0,
                    };
                } else {
                    self.not_a_call("", c, out);
                }
            }
            State::ArrayOpen { bare } => {
                if c.is_whitespace() {
                    self.raw.push(c);
                    self.state = State::ArrayOpen { bare };
                } else if c == '{' {
                    self.raw.push(c);
                    let mut obj = if bare {
                        CallObject::new(true, self.offered.clone())
                    } else {
                        CallObject::new(false, None)
                    };
                    obj.push(c, &mut self.calls, out);
                    self.state = State::Object(obj);
                } else {
                    self.not_a_call("", c, out);
                }
            }
            State::Object(mut obj) => match obj.push(c, &mut self.calls, out) {
                ObjStep::More => {
                    self.raw.push(c);
                    self.state = State::Object(obj);
                }
                ObjStep::Done => {
                    self.raw.clear();
                    self.state = State::ArrayNext;
                }
                ObjStep::NotACall => self.not_a_call("", c, out),
            },
            State::ArrayNext => match c {
                c if c.is_whitespace() => self.state = State::ArrayNext,
                ',' => self.state = State::ArrayElem,
                ']' => self.array_over(None, out),
                c => self.array_over(Some(c), out),
            },
            State::ArrayElem => match c {
                c if c.is_whitespace() => self.state = State::ArrayElem,
                '{' => {
                    self.raw = c.to_string();
                    let mut obj = CallObject::new(false, None);
                    obj.push(c, &mut self.calls, out);
                    self.state = State::Object(obj);
                }
                c => self.array_over(Some(c), out),
            },
            State::Name { mut name, mut pos } => {
                if pos == 0 && name_char(c) && name.len() < MAX_NAME {
                    name.push(c);
                    self.state = State::Name { name, pos };
                    return;
                }
                let before = pos;
                match expect(ARGS, &mut pos, c) {
                    Expect::Partial => self.state = State::Name { name, pos },
                    Expect::Complete => {
                        self.raw.push_str(&name);
                        self.raw.push_str(ARGS);
                        self.state = State::BeforeArgs(name);
                    }
                    Expect::Mismatch => {
                        let replay = format!("{name}{}", &ARGS[..before]);
                        self.not_a_call(&replay, c, out);
                    }
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
                } else {
                    self.not_a_call("", c, out);
                }
            }
            State::Args(i, mut scan) => {
                self.raw.push(c);
                let mut b = [0u8; 4];
                push_args(out, i, c.encode_utf8(&mut b));
                if scan.push(c) == Step::Done {
                    out.push(ToolEvent::End { index: i });
                    self.array_over(None, out);
                } else {
                    self.state = State::Args(i, scan);
                }
            }
        }
    }
}

impl ToolParser for Mistral {
    fn feed(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        for c in text.chars() {
            self.step(c, out);
        }
    }

    fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        let mut raw = std::mem::take(&mut self.raw);
        match std::mem::replace(&mut self.state, State::Prose) {
            State::Prose => self.prose.finish(out),
            State::Open | State::BeforeArgs(_) => out.push(ToolEvent::Unfinished { index: None, raw }),
            State::Name { name, pos } => {
                raw.push_str(&name);
                raw.push_str(&ARGS[..pos]);
                out.push(ToolEvent::Unfinished { index: None, raw });
            }
            State::Bracket => self.prose.content(&raw, out),
            State::ArrayOpen { bare } => {
                if bare {
                    self.prose.content(&raw, out);
                } else {
                    out.push(ToolEvent::Unfinished { index: None, raw });
                }
            }
            State::Object(obj) => match obj.started() {
                Some(i) => out.push(ToolEvent::Unfinished { index: Some(i), raw }),
                None if self.marked => out.push(ToolEvent::Unfinished { index: None, raw }),
                None => self.prose.content(&raw, out),
            },
            State::ArrayNext | State::ArrayElem => {}
            State::Args(i, _) => out.push(ToolEvent::Unfinished { index: Some(i), raw }),
        }
    }
}
