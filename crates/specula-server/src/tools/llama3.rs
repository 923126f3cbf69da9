//! Llama 3.x JSON tool calls: the output is a bare call object
//!
//! ```text
//! {"name": "get_weather", "parameters": {"city": "Paris"}}
//! ```
//!
//! (`"arguments"` is accepted for `"parameters"`), or follows `<|python_tag|>`. Several objects
//! separated by whitespace or `;` are parallel calls. A bare object counts only at the start of
//! the output (or right after another call), with `"name"` (or `"type"`) as its first key and an
//! offered tool's name; after `<|python_tag|>` any name passes through.
//!
//! Note: `<|python_tag|>` is a control token in Llama 3 tokenizers, which Specula's
//! detokenizer does not print; the marker form is recognised when it does reach the text.

use super::scan::{CallObject, Calls, ObjStep, Offered, Prose};
use super::{ParserConfig, ToolEvent, ToolParser};

const PYTHON_TAG: &str = "<|python_tag|>";

#[derive(Debug, Clone)]
enum State {
    Prose,
    /// After `<|python_tag|>`, before the object.
    Tag,
    Object(CallObject),
}

/// The Llama 3 JSON parser.
#[derive(Debug, Clone)]
pub struct Llama3 {
    state: State,
    prose: Prose,
    calls: Calls,
    offered: Offered,
    raw: String,
    tagged: bool,
}

impl Llama3 {
    pub fn new(cfg: &ParserConfig) -> Self {
        Self {
            state: State::Prose,
            prose: Prose::new(),
            calls: Calls::new(&cfg.id_prefix),
            offered: Some(cfg.offered()),
            raw: String::new(),
            tagged: false,
        }
    }

    fn not_a_call(&mut self, c: char, out: &mut Vec<ToolEvent>) {
        let raw = std::mem::take(&mut self.raw);
        self.prose.content(&raw, out);
        self.state = State::Prose;
        self.step(c, out);
    }

    fn begin_object(&mut self, c: char, strict: bool, out: &mut Vec<ToolEvent>) {
        self.raw.push(c);
        let mut obj = if strict {
            CallObject::new(true, self.offered.clone())
        } else {
            CallObject::new(false, None)
        };
        obj.push(c, &mut self.calls, out);
        self.state = State::Object(obj);
    }

    fn step(&mut self, c: char, out: &mut Vec<ToolEvent>) {
        match std::mem::replace(&mut self.state, State::Prose) {
            State::Prose => {
                if c == ';' && self.prose.after_call() {
                    return;
                }
                if c == '{' && self.prose.bare_allowed(true) {
                    self.raw = self.prose.begin();
                    self.tagged = false;
                    return self.begin_object(c, true, out);
                }
                if self.prose.push(c, &[PYTHON_TAG], out).is_some() {
                    self.raw = self.prose.begin() + PYTHON_TAG;
                    self.state = State::Tag;
                }
            }
            State::Tag => {
                if c.is_whitespace() {
                    self.raw.push(c);
                    self.state = State::Tag;
                } else if c == '{' {
                    self.tagged = true;
                    self.begin_object(c, false, out);
                } else {
                    self.not_a_call(c, out);
                }
            }
            State::Object(mut obj) => match obj.push(c, &mut self.calls, out) {
                ObjStep::More => {
                    self.raw.push(c);
                    self.state = State::Object(obj);
                }
                ObjStep::Done => {
                    self.raw.clear();
                    self.prose.call_ended();
                }
                ObjStep::NotACall => self.not_a_call(c, out),
            },
        }
    }
}

impl ToolParser for Llama3 {
    fn feed(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        for c in text.chars() {
            self.step(c, out);
        }
    }

    fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        let raw = std::mem::take(&mut self.raw);
        match std::mem::replace(&mut self.state, State::Prose) {
            State::Prose => self.prose.finish(out),
            State::Tag => out.push(ToolEvent::Unfinished { index: None, raw }),
            State::Object(obj) => match obj.started() {
                Some(i) => out.push(ToolEvent::Unfinished { index: Some(i), raw }),
                None if self.tagged => out.push(ToolEvent::Unfinished { index: None, raw }),
                None => self.prose.content(&raw, out),
            },
        }
    }
}
