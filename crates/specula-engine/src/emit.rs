//! The emit step: the one place where generated tokens become output.
//!
//! Every committed token, whether it came from plain decoding or from a speculative block, passes
//! through [`Emitter::emit_block`] in order. Per token it applies, in this order: end-of-generation
//! tokens, incremental detokenization, stop strings (also spanning tokens), `max_tokens`, and usage
//! counting. The block is cut at the first terminal event: tokens after it are not emitted, not
//! counted and not returned in logprobs.
//!
//! Streaming text is released only when final: bytes of an incomplete UTF-8 sequence wait for
//! the tokens that complete them, and a suffix that could still grow into a stop string is held
//! back until it cannot (then released) or does (then dropped).

use crate::tokenizer::Tokenizer;
use crate::types::{FinishReason, StreamDelta, TokenLogprob};

/// Per-request emit state.
pub struct Emitter {
    tokenizer: Tokenizer,
    stop: Vec<String>,
    eos_ids: Vec<u32>,
    ignore_eos: bool,
    max_tokens: usize,
    /// Every committed token (EOS included), in order.
    tokens: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    /// Tokens fed to the detokenizer (EOS excluded).
    text_tokens: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    /// Output text so far (cut at a stop string once one matched).
    text: String,
    /// Bytes of `text` already released to the stream.
    released: usize,
    finish: Option<FinishReason>,
    /// The stop string that ended the generation, if one did.
    matched_stop: Option<String>,
}

/// What one call of [`Emitter::emit_block`] did.
#[derive(Debug, Default)]
pub struct EmitOutcome {
    /// How many tokens of the block were committed (the rest came after a terminal event).
    pub committed: usize,
    /// The output that became final in this call.
    pub delta: StreamDelta,
    /// Set when this call ended the generation.
    pub finished: Option<FinishReason>,
}

impl Emitter {
    /// `max_tokens` must already be capped by the room left in the context window. The
    /// tokenizer is shared (cheap clone), the EOS ids copied.
    pub fn new(tokenizer: &Tokenizer, eos_ids: &[u32], stop: Vec<String>, ignore_eos: bool, max_tokens: usize) -> Self {
        Self {
            tokenizer: tokenizer.clone(),
            stop: stop.into_iter().filter(|s| !s.is_empty()).collect(),
            eos_ids: eos_ids.to_vec(),
            ignore_eos,
            max_tokens,
            tokens: Vec::new(),
            logprobs: Vec::new(),
            text_tokens: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            text: String::new(),
            released: 0,
            finish: None,
            matched_stop: None,
        }
    }

    /// Commit tokens in order until the block ends or generation finishes. `logprobs`, when
    /// given, has one entry per token of `block`.
    pub fn emit_block(&mut self, block: &[u32], logprobs: Option<&[TokenLogprob]>) -> EmitOutcome {
        let mut out = EmitOutcome::default();
        if self.finish.is_some() {
            return out;
        }
        if self.max_tokens == 0 {
            self.finish = Some(FinishReason::Length);
            out.finished = self.finish;
            return out;
        }
        for (i, &tok) in block.iter().enumerate() {
            self.tokens.push(tok);
            out.committed += 1;
            out.delta.token_ids.push(tok);
            if let Some(lp) = logprobs.and_then(|l| l.get(i)) {
                self.logprobs.push(lp.clone());
                out.delta.logprobs.push(lp.clone());
            }
            if !self.ignore_eos && self.eos_ids.contains(&tok) {
                self.finish = Some(FinishReason::Stop);
            } else {
                self.text_tokens.push(tok);
                let piece = self.detokenize_step(false);
                let scan_from = self.text.len().saturating_sub(self.max_stop_len().saturating_sub(1));
                self.text.push_str(&piece);
                if let Some((cut, stop)) = self.find_stop(scan_from) {
                    self.matched_stop = Some(self.stop[stop].clone());
                    self.text.truncate(cut);
                    self.finish = Some(FinishReason::Stop);
                }
            }
            if self.finish.is_none() && self.tokens.len() >= self.max_tokens {
                self.finish = Some(FinishReason::Length);
            }
            if self.finish.is_some() {
                break;
            }
        }
        if self.finish == Some(FinishReason::Length) {
            // Flush bytes still waiting for a continuation: the output ends here.
            let rest = self.detokenize_step(true);
            self.text.push_str(&rest);
        }
        let release_to = if self.finish.is_some() {
            self.text.len()
        } else {
            self.text.len() - self.stop_prefix_hold()
        };
        if release_to > self.released {
            out.delta.text = self.text[self.released..release_to].to_string();
            self.released = release_to;
        }
        out.finished = self.finish;
        out
    }

    /// Mark the generation finished for an outside reason (client gone, context full).
    pub fn finish_with(&mut self, reason: FinishReason) -> StreamDelta {
        let mut delta = StreamDelta::default();
        if self.finish.is_none() {
            self.finish = Some(reason);
            let rest = self.detokenize_step(true);
            self.text.push_str(&rest);
            delta.text = self.text[self.released..].to_string();
            self.released = self.text.len();
        }
        delta
    }

    pub fn finished(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Committed tokens (EOS included).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn logprobs(&self) -> &[TokenLogprob] {
        &self.logprobs
    }

    fn max_stop_len(&self) -> usize {
        self.stop.iter().map(|s| s.len()).max().unwrap_or(0)
    }

    /// Earliest stop-string match starting at or after byte `from` of `text`: its byte offset
    /// and the index of the stop string (the first one listed among those matching there).
    fn find_stop(&self, from: usize) -> Option<(usize, usize)> {
        let mut from = from.min(self.text.len());
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        self.stop
            .iter()
            .enumerate()
            .filter_map(|(k, s)| self.text[from..].find(s.as_str()).map(|i| (from + i, k)))
            .min()
    }

    /// The stop string that ended the generation (`None`: it ended otherwise, or goes on).
    pub fn matched_stop(&self) -> Option<&str> {
        self.matched_stop.as_deref()
    }

    /// Length of the longest suffix of unreleased text that is a proper prefix of a stop string.
    fn stop_prefix_hold(&self) -> usize {
        let pending = &self.text[self.released..];
        let mut hold = 0;
        for s in &self.stop {
            for (i, _) in s.char_indices().skip(1) {
                let prefix = &s[..i];
                if i > hold && pending.ends_with(prefix) {
                    hold = i;
                }
            }
        }
        hold
    }

    /// Incremental detokenization (the prefix/read-offset scheme of HF text-generation-inference
    /// and vLLM): decode a short window twice and emit the difference, unless it ends in an
    /// incomplete UTF-8 sequence (U+FFFD), in which case wait for more tokens (or, with `flush`,
    /// emit it as is).
    fn detokenize_step(&mut self, flush: bool) -> String {
        if self.read_offset >= self.text_tokens.len() {
            return String::new();
        }
        let prefix = self
            .tokenizer
            .decode(&self.text_tokens[self.prefix_offset..self.read_offset]);
        let full = self.tokenizer.decode(&self.text_tokens[self.prefix_offset..]);
        if full.len() > prefix.len() && (flush || !full.ends_with('\u{FFFD}')) {
            let delta = match full.get(prefix.len()..) {
                Some(d) if full.starts_with(&prefix) => d.to_string(),
                _ => full.clone(),
            };
            self.prefix_offset = self.read_offset;
            self.read_offset = self.text_tokens.len();
            delta
        } else {
            String::new()
        }
    }
}
