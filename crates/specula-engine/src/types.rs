//! Request and result types shared by the engine, the server and the CLI.

use serde::{Deserialize, Serialize};

use crate::sampling::SamplingParams;

/// Why a generation ended, in OpenAI's vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model produced an end-of-generation token, or a stop string matched.
    Stop,
    /// `max_tokens` was reached, or the context window is full.
    Length,
    /// The client went away (stream receiver dropped); nothing more is produced.
    Cancelled,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string.
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// One alternative in a `top_logprobs` list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    /// Token id in the model's vocabulary.
    pub id: u32,
    /// The token's text (its own decoded piece; may be a partial UTF-8 sequence shown lossily).
    pub token: String,
    /// Natural-log probability under the model's raw distribution (log-softmax of the logits,
    /// before any sampler transform), as OpenAI and llama.cpp report it.
    pub logprob: f32,
}

/// A committed token with its log-probability information.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub id: u32,
    pub token: String,
    pub logprob: f32,
    /// Up to `top_logprobs` alternatives, best first.
    pub top: Vec<TopLogprob>,
}

/// One generation request after templating and tokenization.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Token ids to prefill (the rendered chat prompt or the raw completion prompt).
    pub prompt_tokens: Vec<u32>,
    /// Sampling parameters (temperature 0 = greedy).
    pub sampling: SamplingParams,
    /// Maximum number of tokens to generate. `None` = until EOS or the context is full.
    pub max_tokens: Option<usize>,
    /// Stop strings: generation ends at the first occurrence in the generated text, which is
    /// cut before it. May span several tokens.
    pub stop: Vec<String>,
    /// Return log-probabilities for each generated token, with this many alternatives.
    pub logprobs: Option<usize>,
    /// Keep going past the model's end-of-generation tokens.
    pub ignore_eos: bool,
    /// Speculative decoding settings (default: off).
    pub spec: crate::speculative::SpecOptions,
}

/// A streamed piece of output: the text that became final since the last delta, and the tokens
/// committed in this step (text that may still turn out to be part of a stop string is held back).
#[derive(Debug, Clone, Default)]
pub struct StreamDelta {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
}

/// Timings and counters of one request.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GenerationStats {
    /// Tokens prefilled (the whole prompt).
    pub prompt_tokens: usize,
    /// Tokens generated and counted (EOS included when it ended the generation).
    pub completion_tokens: usize,
    /// Seconds spent in prefill.
    pub prefill_s: f64,
    /// Seconds spent decoding after prefill.
    pub decode_s: f64,
    /// Target forward passes made while decoding.
    pub decode_steps: usize,
    /// Prompt tokens whose KV came from the prefix cache (not recomputed).
    pub cached_prompt_tokens: usize,
    /// Speculative decoding counters (decode path, drafted, accepted, tau inputs).
    pub spec: crate::speculative::SpecStats,
}

/// The finished result of one request.
#[derive(Debug, Clone)]
pub struct GenerateOutput {
    /// Generated text (stop string and EOS excluded).
    pub text: String,
    /// Generated token ids (EOS included when it ended the generation).
    pub token_ids: Vec<u32>,
    /// Per-token log-probabilities, when requested.
    pub logprobs: Option<Vec<TokenLogprob>>,
    pub finish_reason: FinishReason,
    /// The stop string that ended the generation (`finish_reason` is then `Stop`).
    pub stop_sequence: Option<String>,
    pub stats: GenerationStats,
}

/// Errors a request can cause; each maps to an HTTP 4xx in the server.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error(
        "the prompt has {prompt} tokens, but the context window is {context} tokens and must leave room for at least one output token"
    )]
    PromptTooLong { prompt: usize, context: usize },
    /// Found before tokenizing: no token spells more than `max_token_bytes` bytes, so a prompt
    /// of `bytes` bytes has at least `bytes / max_token_bytes` tokens.
    #[error(
        "the prompt is {bytes} bytes, so at least {min_tokens} tokens, but the context window is {context} tokens and must leave room for at least one output token"
    )]
    PromptTooLongBytes {
        bytes: usize,
        min_tokens: usize,
        context: usize,
    },
    #[error("prompt ({prompt} tokens) + max_tokens ({max_tokens}) exceeds the context window of {context} tokens")]
    MaxTokensTooLarge {
        prompt: usize,
        max_tokens: usize,
        context: usize,
    },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("invalid request: {0}")]
    InvalidParameter(String),
    #[error("internal error: {0}")]
    Internal(String),
}
