//! The reasoning split: `<think>…</think>` at the start of the output goes to
//! `reasoning_content`, the rest to `content`.
//!
//! - Only the exact tags count, and only where reasoning is: `<think>` as the first non-blank
//!   text of the output, or already open when the rendered prompt ends with `<think>` (templates
//!   that open the thinking block in the generation prompt); then everything up to the first
//!   `</think>` is reasoning. Any later `<think>` / `</think>`, and prose that mentions "think",
//!   is content.
//! - Whitespace around the reasoning (after `<think>`, before `</think>`, between `</think>`
//!   and the answer) is dropped.
//! - Reasoning never closed (the output ended inside it) stays reasoning; the content is empty.
//!
//! Like the tool parsers, the splitter is an incremental state machine whose events do not
//! depend on how the text is cut into chunks.

use crate::tools::scan::Markers;

pub const THINK_OPEN: &str = "<think>";
pub const THINK_CLOSE: &str = "</think>";

/// What the splitter saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReasoningEvent {
    Reasoning(String),
    Content(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace yet: `<think>` may open reasoning.
    Start,
    /// Inside the reasoning.
    Reasoning,
    /// After `</think>`: whitespace before the answer is dropped.
    AfterReasoning,
    /// Everything else is content.
    Content,
}

/// Whether a rendered prompt leaves a `<think>` block open for the model.
pub fn prompt_opens_reasoning(prompt_tail: &str) -> bool {
    prompt_tail.trim_end().ends_with(THINK_OPEN)
}

/// Where the output starts relative to reasoning, for a prompt ending in `prompt_tail` and a
/// model that does (`thinking`) or does not think on its own: `Some(true)` inside a block the
/// prompt opened, `Some(false)` before one the model may open, `None` when no reasoning follows
/// (a model that does not think, or a prompt that already closed an empty block: Qwen3's
/// `enable_thinking: false` renders `<think>\n\n</think>\n\n`).
pub fn output_reasoning(prompt_tail: &str, thinking: bool) -> Option<bool> {
    if prompt_opens_reasoning(prompt_tail) {
        Some(true)
    } else if thinking && !prompt_tail.trim_end().ends_with(THINK_CLOSE) {
        Some(false)
    } else {
        None
    }
}

/// The incremental splitter of one response.
#[derive(Debug, Clone)]
pub struct ReasoningSplitter {
    state: State,
    markers: Markers,
    /// Held whitespace (leading content whitespace in `Start`, trailing reasoning whitespace).
    gap: String,
    /// No reasoning text yet (its leading whitespace is dropped).
    reasoning_empty: bool,
}

fn push(out: &mut Vec<ReasoningEvent>, reasoning: bool, text: &str) {
    if text.is_empty() {
        return;
    }
    match (out.last_mut(), reasoning) {
        (Some(ReasoningEvent::Reasoning(s)), true) | (Some(ReasoningEvent::Content(s)), false) => s.push_str(text),
        _ => out.push(if reasoning {
            ReasoningEvent::Reasoning(text.to_string())
        } else {
            ReasoningEvent::Content(text.to_string())
        }),
    }
}

impl ReasoningSplitter {
    /// `open`: the prompt already opened `<think>` (see [`prompt_opens_reasoning`]).
    pub fn new(open: bool) -> Self {
        Self {
            state: if open { State::Reasoning } else { State::Start },
            markers: Markers::default(),
            gap: String::new(),
            reasoning_empty: true,
        }
    }

    fn reasoning_char(&mut self, c: char, out: &mut Vec<ReasoningEvent>) {
        if c.is_whitespace() {
            if !self.reasoning_empty {
                self.gap.push(c);
            }
            return;
        }
        let gap = std::mem::take(&mut self.gap);
        push(out, true, &gap);
        let mut b = [0u8; 4];
        push(out, true, c.encode_utf8(&mut b));
        self.reasoning_empty = false;
    }

    fn step(&mut self, c: char, out: &mut Vec<ReasoningEvent>) {
        match self.state {
            State::Content => {
                let mut b = [0u8; 4];
                push(out, false, c.encode_utf8(&mut b));
            }
            State::AfterReasoning => {
                if !c.is_whitespace() {
                    self.state = State::Content;
                    self.step(c, out);
                }
            }
            State::Start => {
                if self.markers.is_empty() && c.is_whitespace() {
                    self.gap.push(c);
                    return;
                }
                let mut released = String::new();
                if self.markers.push(c, &[THINK_OPEN], &mut released).is_some() {
                    self.gap.clear();
                    self.state = State::Reasoning;
                } else if !released.is_empty() {
                    let gap = std::mem::take(&mut self.gap);
                    push(out, false, &gap);
                    push(out, false, &released);
                    let rest = self.markers.take();
                    push(out, false, &rest);
                    self.state = State::Content;
                }
            }
            State::Reasoning => {
                let mut released = String::new();
                let hit = self.markers.push(c, &[THINK_CLOSE], &mut released);
                for r in released.chars() {
                    self.reasoning_char(r, out);
                }
                if hit.is_some() {
                    self.gap.clear();
                    self.state = State::AfterReasoning;
                }
            }
        }
    }

    pub fn feed(&mut self, text: &str, out: &mut Vec<ReasoningEvent>) {
        for c in text.chars() {
            self.step(c, out);
        }
    }

    /// The output ended: flush what is held.
    pub fn finish(&mut self, out: &mut Vec<ReasoningEvent>) {
        let pending = self.markers.take();
        match self.state {
            State::Start => {
                let gap = std::mem::take(&mut self.gap);
                push(out, false, &gap);
                push(out, false, &pending);
            }
            State::Reasoning => {
                for r in pending.chars() {
                    self.reasoning_char(r, out);
                }
            }
            State::AfterReasoning | State::Content => {}
        }
        self.gap.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(open: bool, pieces: &[&str]) -> (String, String) {
        let mut s = ReasoningSplitter::new(open);
        let mut out = Vec::new();
        for p in pieces {
            s.feed(p, &mut out);
        }
        s.finish(&mut out);
        let mut r = String::new();
        let mut c = String::new();
        for e in out {
            match e {
                ReasoningEvent::Reasoning(t) => r.push_str(&t),
                ReasoningEvent::Content(t) => c.push_str(&t),
            }
        }
        (r, c)
    }

    fn chars(s: &str) -> Vec<String> {
        s.chars().map(|c| c.to_string()).collect()
    }

    fn all_splits(open: bool, text: &str) -> (String, String) {
        let whole = split(open, &[text]);
        let cs = chars(text);
        let refs: Vec<&str> = cs.iter().map(String::as_str).collect();
        assert_eq!(split(open, &refs), whole, "char by char: {text:?}");
        for k in 2..6 {
            let pieces: Vec<String> = cs.chunks(k).map(|c| c.concat()).collect();
            let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            assert_eq!(split(open, &refs), whole, "{k} chars at a time: {text:?}");
        }
        whole
    }

    #[test]
    fn think_block_at_the_start() {
        assert_eq!(
            all_splits(false, "<think>\nLet me think.\n</think>\n\nThe answer is 4."),
            ("Let me think.".into(), "The answer is 4.".into())
        );
        assert_eq!(all_splits(false, "  <think>a  b</think>c"), ("a  b".into(), "c".into()));
    }

    #[test]
    fn prompt_opened_think() {
        assert!(prompt_opens_reasoning("<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_opens_reasoning(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        for thinking in [false, true] {
            assert_eq!(
                output_reasoning("<|im_start|>assistant\n<think>\n", thinking),
                Some(true)
            );
            assert_eq!(output_reasoning("<think>\n\n</think>\n\n", thinking), None);
        }
        assert_eq!(output_reasoning("<|im_start|>assistant\n", true), Some(false));
        assert_eq!(output_reasoning("<|im_start|>assistant\n", false), None);
        assert_eq!(
            all_splits(true, "\nhmm, 2+2.\n</think>\n\n4"),
            ("hmm, 2+2.".into(), "4".into())
        );
        // Never closed: all reasoning (cut by max_tokens).
        assert_eq!(
            all_splits(true, "still thinking </thi"),
            ("still thinking </thi".into(), "".into())
        );
    }

    #[test]
    fn prose_mentioning_think_stays_content() {
        for text in [
            "I think so.",
            "Use <think> tags to reason.",
            "The answer. <think>not reasoning</think>",
            "<thinking>no</thinking>",
            "think</think>",
            "<think",
        ] {
            assert_eq!(all_splits(false, text), ("".into(), text.into()), "{text:?}");
        }
        // After the reasoning, tags are content.
        assert_eq!(
            all_splits(false, "<think>r</think>a <think>b</think>"),
            ("r".into(), "a <think>b</think>".into())
        );
    }

    #[test]
    fn whitespace_only_output_is_content() {
        assert_eq!(all_splits(false, "  \n"), ("".into(), "  \n".into()));
        assert_eq!(all_splits(false, ""), ("".into(), "".into()));
    }
}
