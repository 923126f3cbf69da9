//! Log-probabilities in OpenAI's two formats: chat (`{content: [{token, logprob, bytes,
//! top_logprobs}]}`) and legacy completions (`{tokens, token_logprobs, top_logprobs,
//! text_offset}`).

use std::collections::HashMap;

use serde_json::{json, Map, Value};
use specula_engine::tokenizer::bytes_to_unicode;
use specula_engine::tokenizer::Tokenizer;
use specula_engine::TokenLogprob;

/// Recovers the raw bytes of a token (OpenAI's `bytes` field).
#[derive(Clone)]
pub struct TokenBytes {
    tokenizer: Tokenizer,
    /// GPT-2 byte-level alphabet, char -> byte.
    byte_level: HashMap<char, u8>,
}

impl TokenBytes {
    pub fn new(tokenizer: Tokenizer) -> Self {
        let byte_level = bytes_to_unicode()
            .into_iter()
            .enumerate()
            .map(|(b, c)| (c, b as u8))
            .collect();
        Self { tokenizer, byte_level }
    }

    /// The bytes of token `id` whose decoded text is `text`. The text is exact unless the token is
    /// part of a UTF-8 sequence (shown as U+FFFD); then the bytes come from the vocabulary entry:
    /// the byte-level alphabet (GPT-2 style BPE) or a `<0xAB>` byte token (SentencePiece style).
    pub fn bytes(&self, id: u32, text: &str) -> Vec<u8> {
        if !text.contains('\u{FFFD}') {
            return text.as_bytes().to_vec();
        }
        if let Some(piece) = self.tokenizer.id_to_token(id) {
            if let Some(hex) = piece.strip_prefix("<0x").and_then(|s| s.strip_suffix('>')) {
                if let Ok(b) = u8::from_str_radix(hex, 16) {
                    return vec![b];
                }
            }
            let mapped: Option<Vec<u8>> = piece.chars().map(|c| self.byte_level.get(&c).copied()).collect();
            if let Some(b) = mapped {
                return b;
            }
        }
        text.as_bytes().to_vec()
    }
}

/// Chat format for a run of tokens.
pub fn chat(tb: &TokenBytes, lps: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = lps
        .iter()
        .map(|lp| {
            let top: Vec<Value> = lp
                .top
                .iter()
                .map(|t| json!({"token": t.token, "logprob": t.logprob, "bytes": tb.bytes(t.id, &t.token)}))
                .collect();
            json!({
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": tb.bytes(lp.id, &lp.token),
                "top_logprobs": top,
            })
        })
        .collect();
    json!({ "content": content, "refusal": null })
}

/// Legacy completions format for a run of tokens; `offset` is the character offset of the first
/// token in the completion text and is advanced past these tokens.
pub fn legacy(lps: &[TokenLogprob], offset: &mut usize) -> Value {
    let mut tokens = Vec::with_capacity(lps.len());
    let mut token_logprobs = Vec::with_capacity(lps.len());
    let mut top_logprobs = Vec::with_capacity(lps.len());
    let mut text_offset = Vec::with_capacity(lps.len());
    for lp in lps {
        tokens.push(Value::from(lp.token.clone()));
        token_logprobs.push(json!(lp.logprob));
        let mut top = Map::new();
        for t in &lp.top {
            // Several ids can share a text; keep the best (the list is best first).
            top.entry(t.token.clone()).or_insert(json!(t.logprob));
        }
        top_logprobs.push(Value::Object(top));
        text_offset.push(Value::from(*offset));
        *offset += lp.token.chars().count();
    }
    json!({
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    })
}
