//! Qwen3-Coder XML tool calls:
//!
//! ```text
//! <tool_call>
//! <function=get_weather>
//! <parameter=city>
//! Paris
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! The call starts at the `>` closing `<function=NAME>`. Parameter values are text: one newline
//! after `<parameter=KEY>` and one before `</parameter>` are trimmed (as Qwen's own parser does),
//! and the value becomes a JSON string, streamed as it comes, unless the offered tool's schema
//! types the parameter as `integer`, `number`, `boolean`, `object`, `array` or `null`: then the
//! value is sent at `</parameter>`, as JSON when it parses as such (else as a string). A missing
//! `</parameter>` is tolerated before the next `<parameter=` or `</function>`. Several
//! `<function=...>` in one block are several calls.

use std::collections::BTreeMap;

use super::scan::{escape_json_char, expect, push_args, Calls, Expect, Markers, Prose, MAX_NAME};
use super::{ParserConfig, ToolEvent, ToolParser};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const FUNC: &str = "<function=";
const FUNC_END: &str = "</function>";
const PARAM: &str = "<parameter=";
const PARAM_END: &str = "</parameter>";

#[derive(Debug, Clone)]
enum State {
    Prose,
    /// After `<tool_call>` (whitespace, then `<function=`, matched up to `pos`).
    Open {
        pos: usize,
    },
    FuncName(String),
    Body(Markers),
    ParamName(String),
    ParamValue(Value),
    AfterFunc(Markers),
}

#[derive(Debug, Clone)]
struct Value {
    key: String,
    typed: bool,
    buf: String,
    first: bool,
    held_newline: bool,
    markers: Markers,
}

/// The Qwen3-Coder parser.
#[derive(Debug, Clone)]
pub struct Qwen3Coder {
    state: State,
    prose: Prose,
    calls: Calls,
    schemas: BTreeMap<String, BTreeMap<String, String>>,
    raw: String,
    /// The current call: its index, its name and how many parameters were sent.
    call: Option<(usize, String, usize)>,
}

fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        escape_json_char(c, &mut out);
    }
    out.push('"');
    out
}

impl Qwen3Coder {
    pub fn new(cfg: &ParserConfig) -> Self {
        Self {
            state: State::Prose,
            prose: Prose::new(),
            calls: Calls::new(&cfg.id_prefix),
            schemas: cfg.tools.iter().map(|t| (t.name.clone(), t.params.clone())).collect(),
            raw: String::new(),
            call: None,
        }
    }

    fn typed(&self, key: &str) -> bool {
        let Some((_, name, _)) = &self.call else {
            return false;
        };
        self.schemas.get(name).and_then(|p| p.get(key)).is_some_and(|t| {
            matches!(
                t.as_str(),
                "integer" | "number" | "boolean" | "object" | "array" | "null"
            )
        })
    }

    fn args(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        if let Some((i, _, _)) = &self.call {
            push_args(out, *i, text);
        }
    }

    /// The separator and key of the next parameter.
    fn key_prefix(&mut self, key: &str) -> String {
        let Some((_, _, n)) = &mut self.call else {
            return String::new();
        };
        let sep = if *n == 0 { "{" } else { ", " };
        *n += 1;
        format!("{sep}{}: ", json_string(key))
    }

    fn value_char(&mut self, v: &mut Value, ch: char, out: &mut Vec<ToolEvent>) {
        if v.first {
            v.first = false;
            if ch == '\n' {
                return;
            }
        }
        if v.held_newline {
            v.held_newline = false;
            self.value_text(v, '\n', out);
        }
        if ch == '\n' {
            v.held_newline = true;
        } else {
            self.value_text(v, ch, out);
        }
    }

    fn value_text(&mut self, v: &mut Value, ch: char, out: &mut Vec<ToolEvent>) {
        if v.typed {
            v.buf.push(ch);
        } else {
            let mut s = String::new();
            escape_json_char(ch, &mut s);
            self.args(&s, out);
        }
    }

    fn end_value(&mut self, v: Value, out: &mut Vec<ToolEvent>) {
        if v.typed {
            let json = serde_json::from_str::<serde_json::Value>(v.buf.trim())
                .map(|j| j.to_string())
                .unwrap_or_else(|_| json_string(&v.buf));
            let prefix = self.key_prefix(&v.key);
            self.args(&(prefix + &json), out);
        } else {
            self.args("\"", out);
        }
    }

    fn end_call(&mut self, out: &mut Vec<ToolEvent>) {
        if let Some((i, _, n)) = self.call.take() {
            push_args(out, i, if n == 0 { "{}" } else { "}" });
            out.push(ToolEvent::End { index: i });
        }
        self.raw.clear();
        self.state = State::AfterFunc(Markers::default());
    }

    fn start_value(&mut self, key: String, out: &mut Vec<ToolEvent>) {
        let typed = self.typed(&key);
        if !typed {
            let prefix = self.key_prefix(&key);
            self.args(&(prefix + "\""), out);
        }
        self.state = State::ParamValue(Value {
            key,
            typed,
            buf: String::new(),
            first: true,
            held_newline: false,
            markers: Markers::default(),
        });
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

    fn step(&mut self, c: char, out: &mut Vec<ToolEvent>) {
        match std::mem::replace(&mut self.state, State::Prose) {
            State::Prose => {
                if self.prose.push(c, &[OPEN], out).is_some() {
                    self.raw = self.prose.begin() + OPEN;
                    self.state = State::Open { pos: 0 };
                }
            }
            State::Open { mut pos } => {
                if pos == 0 && c.is_whitespace() {
                    self.raw.push(c);
                    self.state = State::Open { pos };
                    return;
                }
                let before = pos;
                match expect(FUNC, &mut pos, c) {
                    Expect::Partial => self.state = State::Open { pos },
                    Expect::Complete => self.state = State::FuncName(String::new()),
                    Expect::Mismatch => {
                        // `<tool_call>` and whitespace are content; what matched of
                        // `<function=` (kept out of `raw`) is looked at again as prose.
                        self.not_a_call(&FUNC[..before], c, out);
                    }
                }
            }
            State::FuncName(mut name) => {
                if c == '>' && !name.trim().is_empty() {
                    let name = name.trim().to_string();
                    let i = self.calls.start(&name, out);
                    self.raw.push_str(FUNC);
                    self.raw.push_str(&format!("{name}>"));
                    self.call = Some((i, name, 0));
                    self.state = State::Body(Markers::default());
                } else if c == '\n' || c == '>' || c == '<' || name.len() >= MAX_NAME {
                    let replay = format!("{FUNC}{name}");
                    self.not_a_call(&replay, c, out);
                } else {
                    name.push(c);
                    self.state = State::FuncName(name);
                }
            }
            State::Body(mut m) => {
                self.raw.push(c);
                let mut junk = String::new();
                match m.push(c, &[PARAM, FUNC_END], &mut junk) {
                    Some(0) => self.state = State::ParamName(String::new()),
                    Some(_) => self.end_call(out),
                    None => self.state = State::Body(m),
                }
            }
            State::ParamName(mut key) => {
                self.raw.push(c);
                if c == '>' {
                    self.start_value(key.trim().to_string(), out);
                } else if c == '\n' || key.len() >= MAX_NAME {
                    // Not a parameter after all: back to the function body.
                    self.state = State::Body(Markers::default());
                } else {
                    key.push(c);
                    self.state = State::ParamName(key);
                }
            }
            State::ParamValue(mut v) => {
                self.raw.push(c);
                let mut text = String::new();
                let hit = v.markers.push(c, &[PARAM_END, FUNC_END, PARAM], &mut text);
                for ch in text.chars() {
                    self.value_char(&mut v, ch, out);
                }
                match hit {
                    None => self.state = State::ParamValue(v),
                    Some(0) => {
                        self.end_value(v, out);
                        self.state = State::Body(Markers::default());
                    }
                    Some(1) => {
                        self.end_value(v, out);
                        self.end_call(out);
                    }
                    Some(_) => {
                        self.end_value(v, out);
                        self.state = State::ParamName(String::new());
                    }
                }
            }
            State::AfterFunc(mut m) => {
                if m.is_empty() && c.is_whitespace() {
                    self.state = State::AfterFunc(m);
                    return;
                }
                let mut released = String::new();
                match m.push(c, &[CLOSE, FUNC, OPEN], &mut released) {
                    Some(0) => self.prose.call_ended(),
                    Some(1) => {
                        self.prose.call_ended();
                        self.raw = String::new();
                        self.state = State::FuncName(String::new());
                    }
                    Some(_) => {
                        self.prose.call_ended();
                        self.raw = OPEN.to_string();
                        self.state = State::Open { pos: 0 };
                    }
                    None if released.is_empty() => self.state = State::AfterFunc(m),
                    None => {
                        // Junk after the function: content; the block is over.
                        let rest = m.take();
                        self.prose.call_ended();
                        self.prose.content(&released, out);
                        for r in rest.chars() {
                            self.step(r, out);
                        }
                    }
                }
            }
        }
    }
}

impl ToolParser for Qwen3Coder {
    fn feed(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        for c in text.chars() {
            self.step(c, out);
        }
    }

    fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        let mut raw = std::mem::take(&mut self.raw);
        match std::mem::replace(&mut self.state, State::Prose) {
            State::Prose => self.prose.finish(out),
            State::Open { pos } => {
                raw.push_str(&FUNC[..pos]);
                out.push(ToolEvent::Unfinished { index: None, raw });
            }
            State::FuncName(name) => {
                raw.push_str(FUNC);
                raw.push_str(&name);
                out.push(ToolEvent::Unfinished { index: None, raw });
            }
            State::AfterFunc(_) => {}
            State::Body(_) | State::ParamName(_) | State::ParamValue(_) => {
                let index = self.call.take().map(|(i, _, _)| i);
                out.push(ToolEvent::Unfinished { index, raw });
            }
        }
    }
}
