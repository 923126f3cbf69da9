//! The request side of chat: what a chat job renders (messages plus the template's extra
//! variables: tools, tool_choice, keyword arguments) and what the server knows about the
//! model's chat format (its tool-call dialect, whether it thinks).

use specula_engine::chat::ChatExtras;
use specula_engine::{ChatMessage, Engine, RequestError};

use crate::reasoning::THINK_OPEN;
use crate::tools::Dialect;

/// A chat prompt before templating.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatPrompt {
    pub messages: Vec<ChatMessage>,
    pub extras: ChatExtras,
}

impl From<Vec<ChatMessage>> for ChatPrompt {
    fn from(messages: Vec<ChatMessage>) -> Self {
        Self {
            messages,
            extras: ChatExtras::default(),
        }
    }
}

/// How many bytes of the rendered prompt's end are reported back (enough to see `<think>`).
const TAIL_BYTES: usize = 64;

/// The end of `text` (at most [`TAIL_BYTES`], on a char boundary).
fn tail(text: &str) -> String {
    let mut at = text.len().saturating_sub(TAIL_BYTES);
    while !text.is_char_boundary(at) {
        at += 1;
    }
    text[at..].to_string()
}

/// Render with the model's template and tokenize (on the worker thread;
/// [`Engine::chat_tokens`]: message contents are data, never markup). Returns the tokens and
/// the end of the rendered text (for templates that open `<think>` in the generation prompt).
pub fn render_tokens(engine: &Engine, p: &ChatPrompt) -> Result<(Vec<u32>, String), RequestError> {
    let (tokens, text) = engine.chat_tokens(&p.messages, &p.extras)?;
    Ok((tokens, tail(&text)))
}

/// The model's chat format as the server sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatInfo {
    /// The tool-call dialect responses are parsed in.
    pub tool_dialect: Dialect,
    /// Where the dialect came from: `"template"`, `"family"` or `"--tool-parser"`.
    pub tool_dialect_from: &'static str,
    /// The model may think in `<think>…</think>` (its template or vocabulary knows the tag);
    /// responses then get the reasoning split.
    pub thinking: bool,
}

impl ChatInfo {
    pub fn of(engine: &Engine) -> Self {
        let family = engine.config().family.as_str();
        let template = engine.chat_template().map(|t| t.source());
        let detected = Dialect::detect(Some(family), template);
        // Whether the template itself names the dialect's markers (else the family decided).
        let from_template = template.is_some_and(|t| {
            [
                "<tool_call>",
                "<function=",
                "[TOOL_CALLS]",
                "[Calling tool:",
                "<|python_tag|>",
                "<|start_header_id|>",
            ]
            .iter()
            .any(|m| t.contains(m))
        });
        let thinking =
            template.is_some_and(|t| t.contains(THINK_OPEN)) || engine.tokenizer().token_to_id(THINK_OPEN).is_some();
        Self {
            tool_dialect: detected,
            tool_dialect_from: if from_template { "template" } else { "family" },
            thinking,
        }
    }

    /// With the dialect chosen by `--tool-parser`.
    pub fn with_dialect(mut self, d: Dialect) -> Self {
        self.tool_dialect = d;
        self.tool_dialect_from = "--tool-parser";
        self
    }
}

#[cfg(test)]
mod tests {
    use super::tail;

    #[test]
    fn tail_is_on_a_char_boundary() {
        let s = format!("{}<think>\n", "é".repeat(60));
        let t = tail(&s);
        assert!(t.ends_with("<think>\n"));
        assert!(t.len() <= 64);
        assert_eq!(tail("ab"), "ab");
    }
}
