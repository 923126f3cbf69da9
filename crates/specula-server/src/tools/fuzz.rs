//! Checks shared by the randomized tests, the `#[ignore]` stress test and the `cargo fuzz`
//! targets under `fuzz/`: for one input text, parse it whole and in pieces, and verify the
//! events are the same and structurally sound. Everything panics on a violation.

use super::{merge, parse_all, parse_pieces, Dialect, ParserConfig, ToolEvent, ToolSpec};
use crate::reasoning::{ReasoningEvent, ReasoningSplitter};

/// The tools the checks offer (so that bare-JSON forms can match).
pub fn config() -> ParserConfig {
    let f = |name: &str, params: &[(&str, &str)]| ToolSpec {
        name: name.to_string(),
        params: params.iter().map(|(k, t)| (k.to_string(), t.to_string())).collect(),
    };
    ParserConfig {
        tools: vec![
            f("get_weather", &[("city", "string")]),
            f("add", &[("a", "integer"), ("b", "number")]),
            f("run_code", &[("code", "string")]),
        ],
        id_prefix: "call_".to_string(),
    }
}

/// Split `text` at char boundaries into pieces of 1..=`max_k` chars, the lengths drawn from
/// `seed` (a small xorshift generator).
pub fn split(text: &str, seed: u64, max_k: usize) -> Vec<&str> {
    let mut x = seed | 1;
    let idx: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
    let mut out = Vec::new();
    let mut at = 0;
    while at + 1 < idx.len() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let k = 1 + (x % max_k.max(1) as u64) as usize;
        let end = (at + k).min(idx.len() - 1);
        out.push(&text[idx[at]..idx[end]]);
        at = end;
    }
    out
}

/// Structural soundness: calls are numbered 0, 1, ...; arguments and ends belong to the open
/// call; no content inside a call; `Unfinished` only last, naming the open call; without any
/// call, content plus an unfinished attempt's raw text is exactly the input.
pub fn check_events(d: Dialect, text: &str, events: &[ToolEvent]) {
    let mut next = 0;
    let mut open: Option<usize> = None;
    let mut any_call = false;
    for (n, e) in events.iter().enumerate() {
        match e {
            ToolEvent::Start { index, .. } => {
                assert_eq!(open, None, "{d}: start inside a call in {text:?}: {events:?}");
                assert_eq!(*index, next, "{d}: call indices count up in {text:?}");
                next += 1;
                open = Some(*index);
                any_call = true;
            }
            ToolEvent::Args { index, .. } => {
                assert_eq!(open, Some(*index), "{d}: args outside their call in {text:?}")
            }
            ToolEvent::End { index } => {
                assert_eq!(open, Some(*index), "{d}: end of a call not open in {text:?}");
                open = None;
            }
            ToolEvent::Content(_) => {
                assert_eq!(open, None, "{d}: content inside a call in {text:?}: {events:?}")
            }
            ToolEvent::Unfinished { index, .. } => {
                assert_eq!(n, events.len() - 1, "{d}: Unfinished is last in {text:?}");
                assert_eq!(*index, open, "{d}: Unfinished names the open call in {text:?}");
                open = None;
            }
        }
    }
    assert_eq!(
        open, None,
        "{d}: a call left open without Unfinished in {text:?}: {events:?}"
    );
    if !any_call {
        let mut all = String::new();
        for e in events {
            match e {
                ToolEvent::Content(t) => all.push_str(t),
                ToolEvent::Unfinished { raw, .. } => all.push_str(raw),
                _ => {}
            }
        }
        assert_eq!(all, text, "{d}: text lost without any call: {events:?}");
    }
}

/// One fuzz input for a tool parser: the first byte picks the split (seed and piece size), the
/// rest is the text (lossy UTF-8). Whole and split parses must agree and be sound.
pub fn tool_parser(d: Dialect, data: &[u8]) {
    let (head, rest) = data.split_first().map(|(h, r)| (*h, r)).unwrap_or((0, &[]));
    let text = String::from_utf8_lossy(rest);
    let cfg = config();
    let whole = parse_all(d, &cfg, &text);
    check_events(d, &text, &whole);
    let pieces = split(&text, u64::from(head) * 0x9e37_79b9 + 1, 1 + usize::from(head % 8));
    let parts = parse_pieces(d, &cfg, pieces.iter().copied());
    assert_eq!(parts, whole, "{d}: pieces {pieces:?}");
    assert_eq!(merge(&whole), whole, "{d}: events come merged");
}

fn split_reasoning(open: bool, pieces: &[&str]) -> Vec<ReasoningEvent> {
    let mut s = ReasoningSplitter::new(open);
    let mut out = Vec::new();
    for p in pieces {
        s.feed(p, &mut out);
    }
    s.finish(&mut out);
    // Merge adjacent events of a kind.
    let mut merged: Vec<ReasoningEvent> = Vec::new();
    for e in out {
        match (merged.last_mut(), e) {
            (Some(ReasoningEvent::Reasoning(a)), ReasoningEvent::Reasoning(b))
            | (Some(ReasoningEvent::Content(a)), ReasoningEvent::Content(b)) => a.push_str(&b),
            (_, e) => merged.push(e),
        }
    }
    merged
}

/// One fuzz input for the reasoning splitter (first byte: split and whether `<think>` is open
/// from the prompt). Whole and split must agree; text is only dropped as whitespace or tags.
pub fn reasoning(data: &[u8]) {
    let (head, rest) = data.split_first().map(|(h, r)| (*h, r)).unwrap_or((0, &[]));
    let text = String::from_utf8_lossy(rest);
    let open = head & 0x80 != 0;
    let whole = split_reasoning(open, &[&text]);
    let pieces = split(&text, u64::from(head) * 0x2545_f491 + 7, 1 + usize::from(head % 8));
    assert_eq!(split_reasoning(open, &pieces), whole, "pieces {pieces:?}");
    let kept: usize = whole
        .iter()
        .map(|e| match e {
            ReasoningEvent::Reasoning(t) | ReasoningEvent::Content(t) => t.len(),
        })
        .sum();
    assert!(kept <= text.len());
    if !open && !text.trim_start().starts_with("<think>") {
        assert_eq!(
            whole,
            if text.is_empty() {
                vec![]
            } else {
                vec![ReasoningEvent::Content(text.to_string())]
            }
        );
    }
}
