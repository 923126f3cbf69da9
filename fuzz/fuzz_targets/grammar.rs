//! The grammar compiler's input limits: arbitrary bytes as a Lark grammar, a regex or a JSON
//! schema (the first byte picks: `l`, `r`, `j`, other bytes by value modulo 3; the rest is the
//! grammar), compiled for the tiny model's tokenizer as a request's `response_format` is
//! (`Engine::compile_grammar`: `MAX_GRAMMAR_BYTES`, then llguidance on a thread with a
//! `COMPILE_STACK_BYTES` stack). Errors are fine; a crash, stack overflow or hang is not.

#![no_main]

#[path = "common.rs"]
mod common;

use libfuzzer_sys::fuzz_target;
use specula_engine::constraint::GrammarSpec;

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest).into_owned();
    let spec = match which {
        b'l' => GrammarSpec::Lark(text),
        b'r' => GrammarSpec::Regex(text),
        b'j' => json_schema(&text),
        b => match b % 3 {
            0 => GrammarSpec::Lark(text),
            1 => GrammarSpec::Regex(text),
            _ => json_schema(&text),
        },
    };
    common::compile(&spec);
});

/// A schema as a request carries it (JSON); text that is not JSON is passed as a JSON string
/// (which llguidance must reject, not crash on).
fn json_schema(text: &str) -> GrammarSpec {
    GrammarSpec::JsonSchema(serde_json::from_str(text).unwrap_or_else(|_| serde_json::Value::String(text.to_string())))
}
