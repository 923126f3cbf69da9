//! Token constraints: structured output (JSON object, JSON schema, regex, Lark grammar) through
//! `llguidance`, applied as a sampling-time mask.
//!
//! A constraint masks each logits row with the state *after* every earlier token of the row's
//! prefix and advances only on committed tokens. Under speculation, verify row i is masked with
//! the state after `draft[..i]` (the drafts are committed into the constraint as they are
//! accepted, like penalties see them), so the committed tokens are exactly those plain decoding
//! with the same mask would give; nothing ever needs rolling back, because a rejected draft token
//! was never committed. Drafts are cut at their first token the grammar does not allow
//! ([`Constraint::valid_prefix`]): such a token would be rejected anyway.

use std::sync::Arc;

use anyhow::{anyhow, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

use crate::tokenizer::Tokenizer;

/// A sampling-time token constraint.
pub trait Constraint: Send {
    /// Set the logits of tokens not allowed next to `-inf`. `logits` has one entry per model
    /// vocabulary row.
    fn mask(&mut self, logits: &mut [f32]) -> Result<()>;
    /// Advance over a committed token (one the last mask allowed).
    fn commit(&mut self, token: u32) -> Result<()>;
    /// How many leading tokens of `tokens` the constraint allows in sequence from its current
    /// state (without advancing).
    fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        tokens.len()
    }
}

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON matching a JSON Schema (`response_format: {"type": "json_schema", ...}`).
    JsonSchema(serde_json::Value),
    /// A regular expression (llguidance regex syntax).
    Regex(String),
    /// A Lark grammar (llguidance's Lark dialect).
    Lark(String),
}

/// Builds constraints for one tokenizer. Building the token trie costs ~0.1 s for a 150k vocab,
/// so an engine keeps one.
pub struct GrammarCompiler {
    factory: ParserFactory,
    vocab: usize,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").field("vocab", &self.vocab).finish()
    }
}

/// The bytes each token id stands for, in toktrie's convention: byte-level BPE tokens decoded
/// through the GPT-2 byte alphabet; added/special tokens as `0xFF` followed by their text (so a
/// grammar never matches them as text); ids the tokenizer does not know (model rows past the
/// vocabulary) as empty words (never allowed).
fn token_words(tokenizer: &Tokenizer, rows: usize) -> Vec<Vec<u8>> {
    let alphabet = crate::testing::bytes_to_unicode();
    let mut byte_of = std::collections::HashMap::with_capacity(256);
    for (b, &c) in alphabet.iter().enumerate() {
        byte_of.insert(c, b as u8);
    }
    let added = tokenizer.inner().get_added_tokens_decoder();
    (0..rows as u32)
        .map(|id| {
            if let Some(t) = added.get(&id) {
                let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                w.extend_from_slice(t.content.as_bytes());
                return w;
            }
            let Some(s) = tokenizer.id_to_token(id) else {
                return Vec::new();
            };
            // A token outside the byte alphabet (not byte-level BPE) is taken as its UTF-8 text.
            s.chars()
                .map(|c| byte_of.get(&c).copied())
                .collect::<Option<Vec<u8>>>()
                .unwrap_or_else(|| s.into_bytes())
        })
        .collect()
}

impl GrammarCompiler {
    /// For `tokenizer` and a model with `rows` logits rows; `eos` is the token the grammar ends
    /// with.
    pub fn new(tokenizer: &Tokenizer, rows: usize, eos: u32) -> Result<Self> {
        let words = token_words(tokenizer, rows);
        let info = TokRxInfo::new(rows as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| anyhow!("grammar setup: {e}"))?;
        factory.quiet();
        Ok(Self { factory, vocab: rows })
    }

    /// Compile a constraint. Errors (a bad schema, regex or grammar) are the client's: the
    /// message says what is wrong.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<GrammarConstraint> {
        let grammar = match spec {
            GrammarSpec::JsonObject => TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"})),
            GrammarSpec::JsonSchema(s) => TopLevelGrammar::from_json_schema(s.clone()),
            GrammarSpec::Regex(r) => TopLevelGrammar::from_regex(r),
            GrammarSpec::Lark(l) => TopLevelGrammar::from_lark(l.clone()),
        };
        let parser = self.factory.create_parser(grammar)?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(anyhow!("{e}"));
        }
        Ok(GrammarConstraint {
            matcher,
            vocab: self.vocab,
        })
    }
}

/// An llguidance matcher as a [`Constraint`].
pub struct GrammarConstraint {
    matcher: Matcher,
    vocab: usize,
}

impl Constraint for GrammarConstraint {
    fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        let allowed = self.matcher.compute_mask_or_eos()?;
        for (i, l) in logits.iter_mut().enumerate().take(self.vocab) {
            if !allowed.is_allowed(i as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        for l in logits.iter_mut().skip(self.vocab) {
            *l = f32::NEG_INFINITY;
        }
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<()> {
        if self.matcher.is_stopped() {
            // The grammar is complete: only the end of generation follows.
            return Ok(());
        }
        self.matcher.consume_token(token)
    }

    fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        if self.matcher.is_stopped() {
            return 0;
        }
        self.matcher.validate_tokens(tokens).unwrap_or(0)
    }
}
