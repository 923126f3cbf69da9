//! The chat output pipeline: generated text → reasoning split ([`crate::reasoning`]) → tool-call
//! parser ([`crate::tools`]) → events, rendered as streamed `delta`s or folded into the final
//! `message`. The same events drive both, so a streamed response and a non-streamed one of the
//! same request agree, and since every stage is chunk-invariant, so do responses decoded with
//! and without speculation (which commit tokens in blocks of different sizes).

use serde_json::{json, Map, Value};
use specula_engine::FinishReason;

use crate::reasoning::{ReasoningEvent, ReasoningSplitter};
use crate::tools::{ToolEvent, ToolParser};

/// One piece of chat output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutEvent {
    Reasoning(String),
    Content(String),
    /// A tool event other than content.
    Tool(ToolEvent),
}

/// The pipeline of one response.
pub struct ChatOutput {
    reasoning: Option<ReasoningSplitter>,
    tools: Option<Box<dyn ToolParser>>,
    complete_calls: usize,
    unfinished: bool,
}

impl ChatOutput {
    /// `reasoning`: split `<think>` (`Some(open)`: whether the prompt opened it); `tools`: the
    /// parser of the request's tool dialect.
    pub fn new(reasoning: Option<bool>, tools: Option<Box<dyn ToolParser>>) -> Self {
        Self {
            reasoning: reasoning.map(ReasoningSplitter::new),
            tools,
            complete_calls: 0,
            unfinished: false,
        }
    }

    fn content(&mut self, text: &str, out: &mut Vec<OutEvent>) {
        match &mut self.tools {
            None => push(out, OutEvent::Content(text.to_string())),
            Some(p) => {
                let mut evs = Vec::new();
                p.feed(text, &mut evs);
                self.tool_events(evs, out);
            }
        }
    }

    fn tool_events(&mut self, evs: Vec<ToolEvent>, out: &mut Vec<OutEvent>) {
        for e in evs {
            match e {
                ToolEvent::Content(t) => push(out, OutEvent::Content(t)),
                ToolEvent::End { .. } => {
                    self.complete_calls += 1;
                    push(out, OutEvent::Tool(e));
                }
                ToolEvent::Unfinished { .. } => {
                    self.unfinished = true;
                    push(out, OutEvent::Tool(e));
                }
                other => push(out, OutEvent::Tool(other)),
            }
        }
    }

    fn reasoning_events(&mut self, evs: Vec<ReasoningEvent>, out: &mut Vec<OutEvent>) {
        for e in evs {
            match e {
                ReasoningEvent::Reasoning(t) => push(out, OutEvent::Reasoning(t)),
                ReasoningEvent::Content(t) => self.content(&t, out),
            }
        }
    }

    /// Feed generated text.
    pub fn feed(&mut self, text: &str) -> Vec<OutEvent> {
        let mut out = Vec::new();
        match &mut self.reasoning {
            Some(r) => {
                let mut evs = Vec::new();
                r.feed(text, &mut evs);
                self.reasoning_events(evs, &mut out);
            }
            None => self.content(text, &mut out),
        }
        out
    }

    /// The output ended: flush everything held.
    pub fn finish(&mut self) -> Vec<OutEvent> {
        let mut out = Vec::new();
        if let Some(r) = &mut self.reasoning {
            let mut evs = Vec::new();
            r.finish(&mut evs);
            self.reasoning_events(evs, &mut out);
        }
        if let Some(p) = &mut self.tools {
            let mut evs = Vec::new();
            p.finish(&mut evs);
            self.tool_events(evs, &mut out);
        }
        out
    }

    /// OpenAI's `finish_reason`: `tool_calls` when the model stopped after at least one call and
    /// every call is complete; otherwise the engine's reason (`length` when `max_tokens` cut the
    /// output, a call included).
    pub fn finish_reason(&self, engine: FinishReason) -> &'static str {
        if engine == FinishReason::Stop && self.complete_calls > 0 && !self.unfinished {
            "tool_calls"
        } else {
            engine.as_str()
        }
    }
}

/// Append, merging text with a preceding event of the same kind.
fn push(out: &mut Vec<OutEvent>, e: OutEvent) {
    match (out.last_mut(), &e) {
        (Some(OutEvent::Content(a)), OutEvent::Content(b)) | (Some(OutEvent::Reasoning(a)), OutEvent::Reasoning(b)) => {
            a.push_str(b)
        }
        (
            Some(OutEvent::Tool(ToolEvent::Args { index: i, fragment: a })),
            OutEvent::Tool(ToolEvent::Args { index: j, fragment: b }),
        ) if i == j => a.push_str(b),
        _ => {
            if !matches!(&e, OutEvent::Content(t) | OutEvent::Reasoning(t) if t.is_empty()) {
                out.push(e)
            }
        }
    }
}

/// The streamed `delta` for some events (`None`: nothing to show). Unfinished calls that never
/// started are content; the pieces of one that started were already sent as `tool_calls`.
pub fn delta(events: &[OutEvent]) -> Option<Map<String, Value>> {
    let mut reasoning = String::new();
    let mut content = String::new();
    let mut calls: Vec<Value> = Vec::new();
    for e in events {
        match e {
            OutEvent::Reasoning(t) => reasoning.push_str(t),
            OutEvent::Content(t) => content.push_str(t),
            OutEvent::Tool(ToolEvent::Unfinished { index: None, raw }) => content.push_str(raw),
            OutEvent::Tool(ToolEvent::Start { index, id, name }) => calls.push(json!({
                "index": index,
                "id": id,
                "type": "function",
                "function": {"name": name, "arguments": ""},
            })),
            OutEvent::Tool(ToolEvent::Args { index, fragment }) => {
                if let Some(last) = calls.last_mut().filter(|c| c["index"] == json!(index)) {
                    let prev = last["function"]["arguments"].as_str().unwrap_or("").to_string();
                    last["function"]["arguments"] = Value::String(prev + fragment);
                } else {
                    calls.push(json!({"index": index, "function": {"arguments": fragment}}));
                }
            }
            OutEvent::Tool(_) => {}
        }
    }
    let mut d = Map::new();
    if !reasoning.is_empty() {
        d.insert("reasoning_content".into(), Value::String(reasoning));
    }
    if !content.is_empty() {
        d.insert("content".into(), Value::String(content));
    }
    if !calls.is_empty() {
        d.insert("tool_calls".into(), Value::Array(calls));
    }
    (!d.is_empty()).then_some(d)
}

/// A call of the folded message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoldedCall {
    pub index: usize,
    pub id: String,
    pub name: String,
    pub arguments: String,
    pub complete: bool,
}

/// The whole output as one message.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Folded {
    pub content: String,
    pub reasoning: String,
    pub calls: Vec<FoldedCall>,
}

/// Fold events into a message. An unfinished call is not a call: its raw text is appended to
/// the content.
pub fn fold(events: &[OutEvent]) -> Folded {
    let mut f = Folded::default();
    for e in events {
        match e {
            OutEvent::Reasoning(t) => f.reasoning.push_str(t),
            OutEvent::Content(t) => f.content.push_str(t),
            OutEvent::Tool(ToolEvent::Start { index, id, name }) => f.calls.push(FoldedCall {
                index: *index,
                id: id.clone(),
                name: name.clone(),
                arguments: String::new(),
                complete: false,
            }),
            OutEvent::Tool(ToolEvent::Args { index, fragment }) => {
                if let Some(c) = f.calls.iter_mut().find(|c| c.index == *index) {
                    c.arguments.push_str(fragment);
                }
            }
            OutEvent::Tool(ToolEvent::End { index }) => {
                if let Some(c) = f.calls.iter_mut().find(|c| c.index == *index) {
                    c.complete = true;
                }
            }
            OutEvent::Tool(ToolEvent::Unfinished { raw, .. }) => f.content.push_str(raw),
            OutEvent::Tool(ToolEvent::Content(t)) => f.content.push_str(t),
        }
    }
    f.calls.retain(|c| c.complete);
    f
}

impl Folded {
    /// The OpenAI `message` object. `content` is `null` when there are tool calls and no text.
    pub fn message(&self) -> Value {
        let mut m = Map::new();
        m.insert("role".into(), json!("assistant"));
        let content = if self.content.is_empty() && !self.calls.is_empty() {
            Value::Null
        } else {
            Value::String(self.content.clone())
        };
        m.insert("content".into(), content);
        if !self.reasoning.is_empty() {
            m.insert("reasoning_content".into(), Value::String(self.reasoning.clone()));
        }
        if !self.calls.is_empty() {
            let calls: Vec<Value> = self
                .calls
                .iter()
                .map(|c| {
                    json!({
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    })
                })
                .collect();
            m.insert("tool_calls".into(), Value::Array(calls));
        }
        Value::Object(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::{Dialect, ParserConfig, ToolSpec};

    fn output(think: Option<bool>) -> ChatOutput {
        let cfg = ParserConfig {
            tools: vec![ToolSpec {
                name: "get_weather".into(),
                ..Default::default()
            }],
            id_prefix: "call_".into(),
        };
        ChatOutput::new(think, Some(Dialect::Hermes.parser(&cfg)))
    }

    fn run(think: Option<bool>, pieces: &[&str], engine: FinishReason) -> (Vec<OutEvent>, &'static str) {
        let mut o = output(think);
        let mut evs = Vec::new();
        for p in pieces {
            for e in o.feed(p) {
                push(&mut evs, e);
            }
        }
        for e in o.finish() {
            push(&mut evs, e);
        }
        (evs, o.finish_reason(engine))
    }

    #[test]
    fn reasoning_then_a_call() {
        let text = "<think>\nNeed weather.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let (whole, reason) = run(Some(false), &[text], FinishReason::Stop);
        assert_eq!(reason, "tool_calls");
        let by_char: Vec<String> = text.chars().map(String::from).collect();
        let refs: Vec<&str> = by_char.iter().map(String::as_str).collect();
        assert_eq!(run(Some(false), &refs, FinishReason::Stop).0, whole);
        let f = fold(&whole);
        assert_eq!(f.reasoning, "Need weather.");
        assert_eq!(f.content, "");
        assert_eq!(f.calls.len(), 1);
        assert_eq!(f.calls[0].arguments, "{\"city\": \"Paris\"}");
        let m = f.message();
        assert_eq!(m["content"], Value::Null);
        assert_eq!(m["tool_calls"][0]["function"]["name"], "get_weather");
        // A tool call inside the reasoning is reasoning.
        let (evs, reason) = run(
            Some(true),
            &["<tool_call>{\"name\": \"get_weather\"}</tool_call></think>Hi"],
            FinishReason::Stop,
        );
        assert_eq!(reason, "stop");
        let f = fold(&evs);
        assert!(f.calls.is_empty());
        assert_eq!(f.content, "Hi");
    }

    #[test]
    fn a_cut_call_is_not_a_call() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"ci";
        let (evs, reason) = run(None, &[text], FinishReason::Length);
        assert_eq!(reason, "length");
        let f = fold(&evs);
        assert!(f.calls.is_empty());
        assert_eq!(f.content, text);
        assert!(f.message().get("tool_calls").is_none());
        // Stopped (EOS) inside a call: not `tool_calls` either.
        let (_, reason) = run(None, &[text], FinishReason::Stop);
        assert_eq!(reason, "stop");
        // Streamed: the start and the argument prefix were sent as tool_calls deltas, nothing
        // of the call as content.
        let d = delta(&evs).unwrap();
        assert!(d.get("content").is_none(), "{d:?}");
        assert_eq!(d["tool_calls"][0]["function"]["arguments"], "{\"ci");
    }

    #[test]
    fn delta_shapes() {
        let evs = vec![
            OutEvent::Content("a".into()),
            OutEvent::Tool(ToolEvent::Start {
                index: 0,
                id: "call_0".into(),
                name: "f".into(),
            }),
            OutEvent::Tool(ToolEvent::Args {
                index: 0,
                fragment: "{\"x\"".into(),
            }),
        ];
        let d = Value::Object(delta(&evs).unwrap());
        assert_eq!(
            d,
            json!({"content": "a", "tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                "function": {"name": "f", "arguments": "{\"x\""}}]})
        );
        let d = Value::Object(
            delta(&[OutEvent::Tool(ToolEvent::Args {
                index: 0,
                fragment: ": 1}".into(),
            })])
            .unwrap(),
        );
        assert_eq!(
            d,
            json!({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]})
        );
        assert!(delta(&[OutEvent::Tool(ToolEvent::End { index: 0 })]).is_none());
    }
}
