//! Log-probabilities in OpenAI's two formats: chat (`{content: [{token, logprob, bytes,
//! top_logprobs}]}`) and legacy completions (`{tokens, token_logprobs, top_logprobs,
//! text_offset}`).

use serde_json::{json, Map, Value};
use specula_engine::tokenizer::Tokenizer;
use specula_engine::TokenLogprob;

/// Recovers the raw bytes of a token (OpenAI's `bytes` field).
#[derive(Clone)]
pub struct TokenBytes {
    tokenizer: Tokenizer,
}

impl TokenBytes {
    pub fn new(tokenizer: Tokenizer) -> Self {
        Self { tokenizer }
    }

    /// The bytes of token `id` whose decoded text is `text`. The text is exact unless the token is
    /// part of a UTF-8 sequence (shown as U+FFFD); then the bytes come from the vocabulary entry
    /// ([`Tokenizer::token_bytes`]: the byte-level alphabet, or a SentencePiece `<0xAB>` token).
    pub fn bytes(&self, id: u32, text: &str) -> Vec<u8> {
        if !text.contains('\u{FFFD}') {
            return text.as_bytes().to_vec();
        }
        self.tokenizer
            .token_bytes(id)
            .unwrap_or_else(|| text.as_bytes().to_vec())
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
