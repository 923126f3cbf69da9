//! Tool-call parsers, one per dialect, as incremental state machines.
//!
//! A parser is fed the generated text in chunks of any size ([`ToolParser::feed`]) and emits
//! [`ToolEvent`]s: content text, the start of a call (`id`, `name`), fragments of its arguments
//! (a JSON object's text), the end of a call. [`ToolParser::finish`] flushes what is held at the
//! end of the output; a call still open there is reported as [`ToolEvent::Unfinished`].
//!
//! Rules every dialect keeps:
//! - **Chunk invariance.** Events depend only on the text, never on how it was cut: feeding a
//!   text at once, a byte at a time or in random pieces gives the same events after merging
//!   adjacent content / argument fragments ([`merge`]).
//! - **Held, not re-sent.** Text that may still be the start of a call (a marker prefix such as
//!   `<tool_`, a call whose name is not known yet) is held back; it is released as content only
//!   once it is certain not to be a call, and a call's text is never sent as content.
//! - **Exact markers.** Markers count only in their exact form (`<tool_call>`, `<function=`,
//!   `[Calling tool: `, `[TOOL_CALLS]`, `<|python_tag|>`); prose mentioning "tool_call" or
//!   "function=" stays prose.
//! - **Unknown names pass through** under their raw name in the marked forms. Forms without a
//!   marker (a bare JSON object at the start of the output, see [`hermes`], [`llama3`],
//!   [`mistral`]) are taken as calls only for offered tool names.
//! - **Whitespace next to a call is dropped** (the newline between `</tool_call>` and the next
//!   `<tool_call>`); other content is kept byte for byte.

pub mod bracket;
#[doc(hidden)]
pub mod fuzz;
pub mod hermes;
pub mod llama3;
pub mod mistral;
pub mod qwen3_coder;
pub(crate) mod scan;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

/// What a parser saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    /// Text for the message's `content`.
    Content(String),
    /// A call begins (its index counts calls from 0 within the response).
    Start { index: usize, id: String, name: String },
    /// A piece of a call's arguments (the concatenation is the arguments' JSON text).
    Args { index: usize, fragment: String },
    /// The call is complete.
    End { index: usize },
    /// At the end of the output, a call was still open (cut by `max_tokens`, or the model
    /// stopped inside it). `index` is set when its `Start` was emitted; `raw` is its text from
    /// the opening marker on.
    Unfinished { index: Option<usize>, raw: String },
}

/// An incremental tool-call parser.
pub trait ToolParser: Send {
    /// Feed the next piece of generated text.
    fn feed(&mut self, text: &str, out: &mut Vec<ToolEvent>);
    /// The output ended: flush what is held.
    fn finish(&mut self, out: &mut Vec<ToolEvent>);
}

/// A tool as the parsers need it: its name and the JSON-schema type of each parameter (used by
/// dialects whose argument values are untyped text, such as Qwen3-Coder's XML).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ToolSpec {
    pub name: String,
    /// Parameter name to its schema `type` (the first non-null one when it is a list).
    pub params: BTreeMap<String, String>,
}

impl ToolSpec {
    /// From an OpenAI tool's `function` object (`name`, `parameters`).
    pub fn from_function(function: &serde_json::Value) -> Option<Self> {
        let name = function.get("name")?.as_str()?.to_string();
        let mut params = BTreeMap::new();
        if let Some(props) = function
            .get("parameters")
            .and_then(|p| p.get("properties"))
            .and_then(|p| p.as_object())
        {
            for (k, v) in props {
                let ty = match v.get("type") {
                    Some(serde_json::Value::String(t)) => Some(t.clone()),
                    Some(serde_json::Value::Array(ts)) => ts
                        .iter()
                        .filter_map(|t| t.as_str())
                        .find(|t| *t != "null")
                        .map(str::to_string),
                    _ => None,
                };
                if let Some(ty) = ty {
                    params.insert(k.clone(), ty);
                }
            }
        }
        Some(Self { name, params })
    }
}

/// What a parser is built with.
#[derive(Debug, Clone, Default)]
pub struct ParserConfig {
    /// The offered tools.
    pub tools: Vec<ToolSpec>,
    /// Call ids are this prefix followed by the call's index.
    pub id_prefix: String,
}

impl ParserConfig {
    pub(crate) fn offered(&self) -> Arc<HashSet<String>> {
        Arc::new(self.tools.iter().map(|t| t.name.clone()).collect())
    }
}

/// The tool-call dialects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dialect {
    /// Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
    Hermes,
    /// Qwen3-Coder: `<tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>`.
    Qwen3Coder,
    /// `[Calling tool: NAME({json})]`.
    Bracket,
    /// Llama 3.x: a bare `{"name": ..., "parameters": {...}}`, or after `<|python_tag|>`.
    Llama3,
    /// Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (and `[TOOL_CALLS]NAME[ARGS]{...}`).
    Mistral,
}

impl Dialect {
    pub const ALL: [Dialect; 5] = [
        Dialect::Hermes,
        Dialect::Qwen3Coder,
        Dialect::Bracket,
        Dialect::Llama3,
        Dialect::Mistral,
    ];

    /// The name used by `--tool-parser`.
    pub fn name(self) -> &'static str {
        match self {
            Dialect::Hermes => "hermes",
            Dialect::Qwen3Coder => "qwen3_coder",
            Dialect::Bracket => "bracket",
            Dialect::Llama3 => "llama3_json",
            Dialect::Mistral => "mistral",
        }
    }

    /// Parse a `--tool-parser` name (a few aliases: `qwen`, `qwen3-coder`, `llama3`, ...).
    pub fn parse(s: &str) -> Option<Dialect> {
        let s = s.trim().to_ascii_lowercase().replace('-', "_");
        Some(match s.as_str() {
            "hermes" | "qwen" | "qwen2" | "qwen2.5" | "qwen3" => Dialect::Hermes,
            "qwen3_coder" | "qwen3coder" | "qwen3_xml" | "xml" => Dialect::Qwen3Coder,
            "bracket" | "calling_tool" => Dialect::Bracket,
            "llama3_json" | "llama3" | "llama" | "llama3.1" | "llama3.2" => Dialect::Llama3,
            "mistral" => Dialect::Mistral,
            _ => return None,
        })
    }

    /// The names `--tool-parser` accepts, for messages.
    pub fn names() -> String {
        Self::ALL.iter().map(|d| d.name()).collect::<Vec<_>>().join(", ")
    }

    /// The dialect of a model: from what its chat template prints, else from its family
    /// (`qwen2` / `qwen3` → Hermes, `llama` → Llama 3 JSON), else Hermes.
    pub fn detect(family: Option<&str>, template: Option<&str>) -> Dialect {
        if let Some(t) = template {
            if t.contains("<function=") && t.contains("<parameter=") {
                return Dialect::Qwen3Coder;
            }
            if t.contains("<tool_call>") {
                return Dialect::Hermes;
            }
            if t.contains("[TOOL_CALLS]") {
                return Dialect::Mistral;
            }
            if t.contains("[Calling tool:") {
                return Dialect::Bracket;
            }
            if t.contains("<|python_tag|>") || (t.contains("<|start_header_id|>") && t.contains("tools")) {
                return Dialect::Llama3;
            }
        }
        match family {
            Some("llama") => Dialect::Llama3,
            _ => Dialect::Hermes,
        }
    }

    /// A Lark grammar (llguidance's dialect) whose every sentence is one call, or with
    /// `parallel` one or more calls, of this dialect to one of `tools` (`(name, parameters
    /// schema)`; `None` for a tool without `parameters`: any JSON object), arguments valid
    /// against the schema: what `tool_choice` `"required"` or a named function forces.
    /// `None` for the dialects whose calls are not plain text around one JSON value (Qwen3-Coder's
    /// XML parameters, Mistral's control-token markers): there a call is asked for, not forced.
    pub fn forced_calls(self, tools: &[(&str, Option<&serde_json::Value>)], parallel: bool) -> Option<String> {
        use serde_json::json;
        // Each tool's parameters schema is the root of its own `%json` rule (so its `$ref`s
        // resolve as the client wrote them), its arguments an object (a schema without a `type`
        // gets `"type": "object"`), laid out as the chat templates print JSON (`", "`, `": "`,
        // no free whitespace, which a model under a mask could repeat forever), and lenient as
        // OpenAI's non-strict tools are (unsupported keywords and formats are ignored).
        let args = |p: Option<&serde_json::Value>| {
            let mut schema = p.cloned().unwrap_or_else(|| json!({"type": "object"}));
            if let Some(o) = schema.as_object_mut() {
                o.entry("type").or_insert_with(|| json!("object"));
                o.insert("x-guidance".into(), specula_engine::constraint::json_layout(true));
            }
            schema
        };
        // The text around a tool's arguments (tool names are `[a-zA-Z0-9_.:-]`: nothing to
        // escape in a Lark literal or a JSON string).
        let (open, close): (fn(&str) -> String, &str) = match self {
            Dialect::Hermes => (
                |name| format!("<tool_call>\n{{\"name\": \"{name}\", \"arguments\": "),
                "}\n</tool_call>",
            ),
            Dialect::Llama3 => (|name| format!("{{\"name\": \"{name}\", \"parameters\": "), "}"),
            Dialect::Bracket => (|name| format!("[Calling tool: {name}("), ")]"),
            Dialect::Qwen3Coder | Dialect::Mistral => return None,
        };
        let lit = |s: &str| serde_json::Value::from(s).to_string();
        let mut rules = Vec::new();
        for (i, &(name, params)) in tools.iter().enumerate() {
            rules.push(format!("t{i}: {} args{i} {}", lit(&open(name)), lit(close)));
            rules.push(format!("args{i}: %json {}", args(params)));
        }
        let alts: Vec<String> = (0..tools.len()).map(|i| format!("t{i}")).collect();
        // Up to two newlines may come first (a thinking model's after `</think>`); calls in
        // parallel are one a line. Llama 3 has no separator of its own: one call.
        let calls = if parallel && self != Dialect::Llama3 {
            "call (\"\\n\" call)*"
        } else {
            "call"
        };
        Some(format!(
            "start: LEAD? {calls}\nLEAD: /\\n\\n?/\ncall: {}\n{}\n",
            alts.join(" | "),
            rules.join("\n")
        ))
    }

    /// A fresh parser for one response.
    pub fn parser(self, cfg: &ParserConfig) -> Box<dyn ToolParser> {
        match self {
            Dialect::Hermes => Box::new(hermes::Hermes::new(cfg)),
            Dialect::Qwen3Coder => Box::new(qwen3_coder::Qwen3Coder::new(cfg)),
            Dialect::Bracket => Box::new(bracket::Bracket::new(cfg)),
            Dialect::Llama3 => Box::new(llama3::Llama3::new(cfg)),
            Dialect::Mistral => Box::new(mistral::Mistral::new(cfg)),
        }
    }
}

impl std::fmt::Display for Dialect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Merge adjacent content events and adjacent argument fragments of the same call (the
/// canonical form chunk invariance is stated in).
pub fn merge(events: &[ToolEvent]) -> Vec<ToolEvent> {
    let mut out = Vec::with_capacity(events.len());
    for e in events {
        match e {
            ToolEvent::Content(t) => scan::push_content(&mut out, t),
            ToolEvent::Args { index, fragment } => scan::push_args(&mut out, *index, fragment),
            other => out.push(other.clone()),
        }
    }
    out
}

/// Feed `pieces` in order, then finish; the merged events.
pub fn parse_pieces<'a>(
    dialect: Dialect,
    cfg: &ParserConfig,
    pieces: impl IntoIterator<Item = &'a str>,
) -> Vec<ToolEvent> {
    let mut p = dialect.parser(cfg);
    let mut out = Vec::new();
    for piece in pieces {
        p.feed(piece, &mut out);
    }
    p.finish(&mut out);
    merge(&out)
}

/// Parse a whole text at once; the merged events.
pub fn parse_all(dialect: Dialect, cfg: &ParserConfig, text: &str) -> Vec<ToolEvent> {
    parse_pieces(dialect, cfg, [text])
}

#[cfg(test)]
mod tests;
