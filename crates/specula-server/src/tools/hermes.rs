//! Hermes / Qwen2.5 / Qwen3 tool calls:
//!
//! ```text
//! <tool_call>
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! </tool_call>
//! ```
//!
//! One call object per block (several objects in one block are several calls), any number of
//! blocks (parallel calls). The call starts once its `"name"` is read; the raw text of
//! `"arguments"` then streams. The closing `</tool_call>` may be missing at the end of the output.
//!
//! Fallback for models that drop the tags (Qwen2.5-Coder 0.5B/1.5B answer tool prompts with a
//! bare `{"name": ..., "arguments": ...}`, sometimes inside a ```` ```json ```` fence): at the
//! very start of the output (or right after such a call), a JSON object whose first key is
//! `"name"` is a call when the name is one of the offered tools. Anything else stays content.

use super::scan::{CallObject, Calls, Markers, ObjStep, Offered, Prose};
use super::{ParserConfig, ToolEvent, ToolParser};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const FENCE: &str = "```json";
const FENCE_END: &str = "```";

#[derive(Debug, Clone)]
enum State {
    Prose,
    /// After `<tool_call>`, before the object.
    TagOpen,
    /// Inside a call object (`tag`: within `<tool_call>`; `fenced`: within ```` ```json ````).
    Object {
        obj: CallObject,
        tag: bool,
        fenced: bool,
    },
    /// After an object inside `<tool_call>`: `</tool_call>`, another object, or another block.
    AfterTagObject(Markers),
    /// After ```` ```json ```` at the start, before the object.
    FenceOpen,
    /// After a fenced call: the closing fence.
    FenceClose(Markers),
}

/// The Hermes parser.
#[derive(Debug, Clone)]
pub struct Hermes {
    state: State,
    prose: Prose,
    calls: Calls,
    offered: Offered,
    /// The text of the current call attempt, for content (not a call) or `Unfinished`.
    raw: String,
}

impl Hermes {
    pub fn new(cfg: &ParserConfig) -> Self {
        Self {
            state: State::Prose,
            prose: Prose::new(),
            calls: Calls::new(&cfg.id_prefix),
            offered: Some(cfg.offered()),
            raw: String::new(),
        }
    }

    fn not_a_call(&mut self, out: &mut Vec<ToolEvent>) {
        let raw = std::mem::take(&mut self.raw);
        self.prose.content(&raw, out);
        self.state = State::Prose;
    }

    fn step(&mut self, c: char, out: &mut Vec<ToolEvent>) {
        loop {
            match &mut self.state {
                State::Prose => {
                    if c == '{' && self.prose.bare_allowed(true) {
                        self.raw = self.prose.begin();
                        self.raw.push(c);
                        let mut obj = CallObject::new(true, self.offered.clone());
                        obj.push(c, &mut self.calls, out);
                        self.state = State::Object {
                            obj,
                            tag: false,
                            fenced: false,
                        };
                        return;
                    }
                    let markers: &[&str] = if self.prose.at_start() { &[OPEN, FENCE] } else { &[OPEN] };
                    match self.prose.push(c, markers, out) {
                        Some(0) => {
                            self.raw = self.prose.begin() + OPEN;
                            self.state = State::TagOpen;
                        }
                        Some(_) => {
                            self.raw = self.prose.begin() + FENCE;
                            self.state = State::FenceOpen;
                        }
                        None => {}
                    }
                    return;
                }
                State::TagOpen | State::FenceOpen => {
                    let tag = matches!(self.state, State::TagOpen);
                    if c.is_whitespace() {
                        self.raw.push(c);
                        return;
                    }
                    if c != '{' {
                        self.not_a_call(out);
                        continue;
                    }
                    self.raw.push(c);
                    let mut obj = if tag {
                        CallObject::new(false, None)
                    } else {
                        CallObject::new(true, self.offered.clone())
                    };
                    obj.push(c, &mut self.calls, out);
                    self.state = State::Object { obj, tag, fenced: !tag };
                    return;
                }
                State::Object { obj, tag, fenced } => match obj.push(c, &mut self.calls, out) {
                    ObjStep::More => {
                        self.raw.push(c);
                        return;
                    }
                    ObjStep::Done => {
                        self.raw.clear();
                        self.state = if *tag {
                            State::AfterTagObject(Markers::default())
                        } else if *fenced {
                            State::FenceClose(Markers::default())
                        } else {
                            self.prose.call_ended();
                            State::Prose
                        };
                        return;
                    }
                    ObjStep::NotACall => {
                        self.not_a_call(out);
                        continue;
                    }
                },
                State::AfterTagObject(m) => {
                    if m.is_empty() && c.is_whitespace() {
                        return;
                    }
                    if m.is_empty() && c == '{' {
                        // Another object in the same block.
                        self.raw = String::from(c);
                        let mut obj = CallObject::new(false, None);
                        obj.push(c, &mut self.calls, out);
                        self.state = State::Object {
                            obj,
                            tag: true,
                            fenced: false,
                        };
                        return;
                    }
                    let mut released = String::new();
                    match m.push(c, &[CLOSE, OPEN], &mut released) {
                        Some(0) => {
                            self.prose.call_ended();
                            self.state = State::Prose;
                        }
                        Some(_) => {
                            // A new block without closing the previous one.
                            self.prose.call_ended();
                            self.raw = OPEN.to_string();
                            self.state = State::TagOpen;
                        }
                        None => {
                            if !released.is_empty() {
                                // Junk after the object: content, and the block is over.
                                let rest = m.take();
                                self.prose.call_ended();
                                self.state = State::Prose;
                                self.prose.content(&released, out);
                                for r in rest.chars() {
                                    self.step(r, out);
                                }
                            }
                        }
                    }
                    return;
                }
                State::FenceClose(m) => {
                    if m.is_empty() && c.is_whitespace() {
                        return;
                    }
                    let mut released = String::new();
                    match m.push(c, &[FENCE_END], &mut released) {
                        Some(_) => {
                            self.prose.call_ended();
                            self.state = State::Prose;
                        }
                        None => {
                            if !released.is_empty() {
                                let rest = m.take();
                                self.prose.call_ended();
                                self.state = State::Prose;
                                self.prose.content(&released, out);
                                for r in rest.chars() {
                                    self.step(r, out);
                                }
                            }
                        }
                    }
                    return;
                }
            }
        }
    }
}

impl ToolParser for Hermes {
    fn feed(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        for c in text.chars() {
            self.step(c, out);
        }
    }

    fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        let raw = std::mem::take(&mut self.raw);
        match std::mem::replace(&mut self.state, State::Prose) {
            State::Prose => self.prose.finish(out),
            State::TagOpen => out.push(ToolEvent::Unfinished { index: None, raw }),
            State::Object { obj, tag, .. } => match obj.started() {
                Some(i) => out.push(ToolEvent::Unfinished { index: Some(i), raw }),
                None if tag => out.push(ToolEvent::Unfinished { index: None, raw }),
                None => self.prose.content(&raw, out),
            },
            State::FenceOpen => self.prose.content(&raw, out),
            State::AfterTagObject(_) | State::FenceClose(_) => {}
        }
    }
}
