//! The engine: one loaded model and the generation loop (prefill, then decode one token per
//! target step, every token through the [`Emitter`]).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use candle_core::{Device, Tensor};

use crate::bundle::{self, LoadedBundle};
use crate::chat::{ChatMessage, ChatTemplate};
use crate::emit::Emitter;
use crate::kv_cache::KvCache;
use crate::model::{LogitsRows, Model, ModelConfig};
use crate::sampling::{self, Sampler};
use crate::spec::draft_model::DraftModelDrafter;
use crate::spec::ngram::NgramDrafter;
use crate::spec::verify::{self, UniformRandomness};
use crate::spec::{DraftLength, Drafter, Proposal, SpecMode};
use crate::tokenizer::Tokenizer;
use crate::types::{
    FinishReason, GenerateOutput, GenerateRequest, GenerationStats, RequestError, StreamDelta, TokenLogprob, TopLogprob,
};

/// Options for loading a model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub device: Device,
    /// Prompt tokens per prefill forward (bounds activation memory).
    pub prefill_chunk: usize,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            prefill_chunk: 512,
        }
    }
}

/// A draft model attached to an engine (same tokenizer as the target).
struct DraftModel {
    model: Arc<Model>,
    id: String,
}

/// The most draft tokens per target step a request may ask for.
pub const MAX_DRAFT: usize = 32;

/// A loaded model ready to generate.
pub struct Engine {
    bundle: LoadedBundle,
    id: String,
    kv: KvCache,
    opts: LoadOptions,
    draft: Option<DraftModel>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("id", &self.id).finish_non_exhaustive()
    }
}

impl Engine {
    /// Load a bundle (GGUF file or HF directory). `id` is the name clients use for it.
    pub fn load(path: &Path, id: &str, opts: LoadOptions) -> Result<Self> {
        let bundle = bundle::load(path, &opts.device)?;
        Ok(Self::from_bundle(bundle, id, opts))
    }

    pub fn from_bundle(bundle: LoadedBundle, id: &str, opts: LoadOptions) -> Self {
        let kv = bundle.model.new_kv_cache();
        Self {
            bundle,
            id: id.to_string(),
            kv,
            opts,
            draft: None,
        }
    }

    /// Load a draft model (GGUF file or HF directory) for speculative decoding with this engine
    /// as the target. Errors when the bundle does not load, or when its tokenizer differs from
    /// the target's (vocabulary, merges, special tokens) or its vocabulary size does not match.
    pub fn attach_draft_model(&mut self, path: &Path, id: &str) -> Result<()> {
        let draft = bundle::load(path, &self.opts.device)?;
        self.attach_draft_bundle(draft, id)
    }

    /// As [`Engine::attach_draft_model`], from a loaded bundle.
    pub fn attach_draft_bundle(&mut self, draft: LoadedBundle, id: &str) -> Result<()> {
        crate::tokenizer::check_same_tokenizer(&self.bundle.tokenizer, &draft.tokenizer)
            .map_err(|e| anyhow::anyhow!("draft model {id} cannot draft for {}: {e}", self.id))?;
        let (tv, dv) = (self.config().vocab_size, draft.model.config.vocab_size);
        if tv != dv {
            anyhow::bail!(
                "draft model {id} cannot draft for {}: its LM head has {dv} rows, the target's has {tv}",
                self.id
            );
        }
        self.draft = Some(DraftModel {
            model: Arc::new(draft.model),
            id: id.to_string(),
        });
        Ok(())
    }

    /// The attached draft model's id, if any.
    pub fn draft_model_id(&self) -> Option<&str> {
        self.draft.as_ref().map(|d| d.id.as_str())
    }

    /// The drafter a speculative mode resolves to on this engine: `None` for AR.
    pub fn resolve_spec_mode(&self, mode: SpecMode) -> Option<SpecMode> {
        match mode {
            SpecMode::Off => None,
            SpecMode::Default | SpecMode::On => Some(if self.draft.is_some() {
                SpecMode::Draft
            } else {
                SpecMode::Ngram
            }),
            m => Some(m),
        }
    }

    /// The id clients use for this model.
    pub fn model_id(&self) -> &str {
        &self.id
    }

    pub fn model(&self) -> &Model {
        &self.bundle.model
    }

    pub fn config(&self) -> &ModelConfig {
        &self.bundle.model.config
    }

    pub fn bundle(&self) -> &LoadedBundle {
        &self.bundle
    }

    /// Context window in tokens.
    pub fn context_length(&self) -> usize {
        self.bundle.model.config.context_length
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.bundle.tokenizer
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.bundle.template.as_ref()
    }

    /// Token ids that end generation.
    pub fn eos_ids(&self) -> &[u32] {
        &self.bundle.eos_ids
    }

    /// Render a chat with the model's template. Without a template, a plain ChatML rendering is
    /// used (and logged).
    pub fn render_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, RequestError> {
        match &self.bundle.template {
            Some(t) => t
                .render(messages, add_generation_prompt)
                .map_err(|e| RequestError::InvalidParameter(format!("chat template: {e}"))),
            None => {
                let mut s = String::new();
                for m in messages {
                    s.push_str(&format!("<|im_start|>{}\n{}<|im_end|>\n", m.role, m.content));
                }
                if add_generation_prompt {
                    s.push_str("<|im_start|>assistant\n");
                }
                Ok(s)
            }
        }
    }

    /// Tokenize a prompt (special-token text is parsed).
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, RequestError> {
        self.bundle
            .tokenizer
            .encode(text)
            .map_err(|e| RequestError::InvalidParameter(e.to_string()))
    }

    /// Render and tokenize a chat prompt.
    pub fn chat_prompt_tokens(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, RequestError> {
        let text = self.render_chat(messages, true)?;
        self.tokenize(&text)
    }

    /// Check a request against the model before any work is done.
    pub fn validate(&self, req: &GenerateRequest) -> Result<(), RequestError> {
        req.sampling.validate()?;
        let ctx = self.context_length();
        let prompt = req.prompt_tokens.len();
        if prompt == 0 {
            return Err(RequestError::EmptyPrompt);
        }
        if prompt >= ctx {
            return Err(RequestError::PromptTooLong { prompt, context: ctx });
        }
        if let Some(mt) = req.max_tokens {
            if prompt + mt > ctx {
                return Err(RequestError::MaxTokensTooLarge {
                    prompt,
                    max_tokens: mt,
                    context: ctx,
                });
            }
        }
        if let Some(&bad) = req
            .prompt_tokens
            .iter()
            .find(|&&t| t as usize >= self.config().vocab_size)
        {
            return Err(RequestError::InvalidParameter(format!(
                "prompt token id {bad} is outside the vocabulary ({} tokens)",
                self.config().vocab_size
            )));
        }
        if req.spec.mode == SpecMode::Draft && self.draft.is_none() {
            return Err(RequestError::InvalidParameter(format!(
                "speculative mode `draft` needs a draft model, and {} has none attached \
                 (start the server with --draft-model)",
                self.id
            )));
        }
        if req.spec.draft_max == 0 || req.spec.draft_max > MAX_DRAFT {
            return Err(RequestError::InvalidParameter(format!(
                "draft_max must be between 1 and {MAX_DRAFT}, got {}",
                req.spec.draft_max
            )));
        }
        if let Some(n) = req.logprobs {
            if n > 20 {
                return Err(RequestError::InvalidParameter(format!(
                    "top_logprobs must be at most 20, got {n}"
                )));
            }
        }
        Ok(())
    }

    /// Prefill `tokens` after the cache's current contents; returns the last row's logits, or
    /// `None` when `alive` (asked between chunks) says the client has gone.
    fn prefill(&mut self, tokens: &[u32], alive: &mut dyn FnMut() -> bool) -> Result<Option<Vec<f32>>> {
        let chunk = self.opts.prefill_chunk.max(1);
        let mut last = None;
        let n_chunks = tokens.len().div_ceil(chunk);
        for (i, c) in tokens.chunks(chunk).enumerate() {
            if i > 0 && !alive() {
                return Ok(None);
            }
            let rows = if i + 1 == n_chunks {
                LogitsRows::Last
            } else {
                LogitsRows::None
            };
            let out = self.bundle.model.forward(c, &mut self.kv, rows, &[])?;
            if i + 1 == n_chunks {
                last = Some(out.logits);
            }
        }
        let logits = last.ok_or_else(|| anyhow::anyhow!("empty prefill"))?;
        Ok(Some(logits.squeeze(0)?.to_vec1::<f32>()?))
    }

    /// Logits for every position of `tokens` (teacher forcing), from an empty cache.
    /// Returns `[tokens.len(), vocab]`.
    pub fn logits_all(&mut self, tokens: &[u32]) -> Result<Tensor> {
        self.kv.clear();
        let out = self.bundle.model.forward(tokens, &mut self.kv, LogitsRows::All, &[])?;
        self.kv.clear();
        Ok(out.logits)
    }

    /// Generate for one request. `on_delta` receives each piece of output as it becomes final,
    /// and an empty delta between prefill chunks (a liveness probe); returning `false` cancels
    /// the request (finish reason `cancelled`).
    pub fn generate(
        &mut self,
        req: &GenerateRequest,
        on_delta: &mut dyn FnMut(&StreamDelta) -> bool,
    ) -> Result<GenerateOutput, RequestError> {
        self.validate(req)?;
        let internal = |e: anyhow::Error| RequestError::Internal(format!("{e:#}"));
        let ctx = self.context_length();
        let prompt_len = req.prompt_tokens.len();
        let room = ctx - prompt_len;
        let max_tokens = req.max_tokens.unwrap_or(room).min(room);
        let mut sampler = Sampler::new(req.sampling.clone());
        let tokenizer = self.bundle.tokenizer.clone();
        let eos_ids = self.bundle.eos_ids.clone();
        let mut emitter = Emitter::new(&tokenizer, &eos_ids, req.stop.clone(), req.ignore_eos, max_tokens);
        let mut stats = GenerationStats {
            prompt_tokens: prompt_len,
            ..Default::default()
        };

        let t0 = Instant::now();
        self.kv.clear();
        // Between prefill chunks, an empty delta asks the client whether it is still there.
        let mut alive = || on_delta(&StreamDelta::default());
        let Some(logits) = self.prefill(&req.prompt_tokens, &mut alive).map_err(internal)? else {
            stats.prefill_s = t0.elapsed().as_secs_f64();
            return Ok(GenerateOutput {
                text: String::new(),
                token_ids: Vec::new(),
                logprobs: req.logprobs.map(|_| Vec::new()),
                finish_reason: FinishReason::Cancelled,
                stats,
            });
        };
        stats.prefill_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();

        // Speculation is used only where it is exact (see `spec`); otherwise plain AR, and the
        // stats say why.
        let mut drafter: Option<Box<dyn Drafter>> = None;
        let resolved = self.resolve_spec_mode(req.spec.mode);
        stats.spec.decode_path = match resolved {
            None => "ar".into(),
            Some(_) if !self.bundle.model.batch_invariant() => {
                "ar (this model's kernels are not batch-invariant: K-quant or f32 weights)".into()
            }
            Some(SpecMode::Draft) => {
                let d = self.draft.as_ref().ok_or_else(|| {
                    RequestError::InvalidParameter("speculative mode `draft` needs a draft model".into())
                })?;
                let seed = if req.sampling.is_greedy() {
                    0
                } else {
                    sampler.fork_seed()
                };
                drafter = Some(Box::new(DraftModelDrafter::new(
                    d.model.clone(),
                    &req.sampling,
                    seed,
                    self.opts.prefill_chunk,
                )));
                format!("draft-model:{}", d.id)
            }
            Some(_) => {
                drafter = Some(Box::new(NgramDrafter::default()));
                "ngram".into()
            }
        };
        // Acceptance at temperature > 0 draws from its own stream, derived from the request seed.
        let mut accept_rng = (drafter.is_some() && !req.sampling.is_greedy()).then(|| {
            use rand::SeedableRng;
            UniformRandomness(rand_chacha::ChaCha20Rng::seed_from_u64(sampler.fork_seed()))
        });
        let mut k_ctl = DraftLength::new(req.spec.draft_max, req.spec.adaptive);
        let mut context = req.prompt_tokens.clone();

        // The first token comes from the prefill's last row.
        let mut rows = vec![logits];
        let mut draft = Proposal::default();
        while emitter.finished().is_none() {
            // rows[i] = logits after the committed prefix and draft[..i].
            let lps = req
                .logprobs
                .map(|n| rows.iter().map(|r| self.token_logprobs(r, n)).collect::<Vec<_>>());
            let (accepted, next) = if draft.is_empty() {
                (0, sampler.sample(&mut rows[0]))
            } else if let Some(rng) = accept_rng.as_mut() {
                // Row i is processed as plain decoding would process it after committing
                // draft[..i]: the sampler observes those drafts before row i.
                let tokens = &draft.tokens;
                let mut observed = 0;
                let sampler = &mut sampler;
                let rows = &mut rows;
                let mut target = |i: usize| {
                    while observed < i {
                        sampler.observe(tokens[observed]);
                        observed += 1;
                    }
                    sampler.apply_penalties(&mut rows[i]);
                    sampler.distribution(&rows[i])
                };
                verify::accept_sampled(tokens, draft.q.as_deref(), &mut target, rng)
            } else {
                verify::accept_greedy(&draft.tokens, &mut rows, &mut sampler)
            };
            sampler.observe(next);
            if !draft.is_empty() {
                stats.spec.record(draft.len(), accepted);
                k_ctl.update(draft.len(), accepted);
            }
            let mut block = draft.tokens[..accepted].to_vec();
            block.push(next);
            let block_lps = lps.map(|l| {
                block
                    .iter()
                    .zip(l)
                    .map(|(&id, (all, top))| TokenLogprob {
                        id,
                        token: tokenizer.token_text(id),
                        logprob: all[id as usize],
                        top,
                    })
                    .collect::<Vec<_>>()
            });
            let outcome = emitter.emit_block(&block, block_lps.as_deref());
            if stats.decode_steps > 0 {
                // Tokens committed by target decode steps (the first token came from prefill).
                stats.spec.committed += outcome.committed;
            }
            let has_output = !outcome.delta.text.is_empty() || !outcome.delta.token_ids.is_empty();
            if has_output && !on_delta(&outcome.delta) {
                emitter.finish_with(FinishReason::Cancelled);
                break;
            }
            if outcome.finished.is_some() {
                break;
            }
            // Keep the committed part of the verified block in the KV cache: the pending token
            // before the draft plus the accepted drafts (`next` is not in the cache yet).
            let keep = self.kv.len() - draft.len() + accepted;
            self.kv.truncate(keep);
            context.extend_from_slice(&block);

            // Next step: forward [next, draft...] and get one row per position.
            let room_ctx = ctx.saturating_sub(self.kv.len() + 1);
            let room_out = max_tokens.saturating_sub(emitter.tokens().len() + 1);
            let k = k_ctl.next_k().min(room_ctx).min(room_out);
            draft = match drafter.as_mut() {
                Some(d) if k > 0 => {
                    let td = Instant::now();
                    let p = d.propose(&context, k).map_err(internal)?;
                    let secs = td.elapsed().as_secs_f64();
                    stats.spec.draft_s += secs;
                    k_ctl.observe_draft(p.len(), secs);
                    p
                }
                _ => Proposal::default(),
            };
            draft.truncate(k);
            if self.kv.len() + 1 + draft.len() > ctx {
                let d = emitter.finish_with(FinishReason::Length);
                on_delta(&d);
                break;
            }
            let mut input = Vec::with_capacity(1 + draft.len());
            input.push(next);
            input.extend_from_slice(&draft.tokens);
            let which = if draft.is_empty() {
                LogitsRows::Last
            } else {
                LogitsRows::All
            };
            let tv = Instant::now();
            let out = self
                .bundle
                .model
                .forward(&input, &mut self.kv, which, &[])
                .map_err(internal)?;
            stats.decode_steps += 1;
            rows = out.logits.to_vec2::<f32>().map_err(|e| internal(e.into()))?;
            let secs = tv.elapsed().as_secs_f64();
            stats.spec.record_forward(input.len(), secs);
            k_ctl.observe_forward(input.len(), secs);
        }
        stats.spec.target_steps = stats.decode_steps;
        stats.decode_s = t1.elapsed().as_secs_f64();
        stats.completion_tokens = emitter.tokens().len();
        if let Some(d) = &drafter {
            tracing::debug!(
                drafter = d.name(),
                drafted = stats.spec.drafted,
                accepted = stats.spec.accepted,
                tau = stats.spec.tau(),
                "speculation"
            );
        }
        let finish_reason = emitter.finished().unwrap_or(FinishReason::Length);
        Ok(GenerateOutput {
            text: emitter.text().to_string(),
            token_ids: emitter.tokens().to_vec(),
            logprobs: req.logprobs.map(|_| emitter.logprobs().to_vec()),
            finish_reason,
            stats,
        })
    }

    /// Raw log-softmax of a logits row and its `n` best entries.
    fn token_logprobs(&self, logits: &[f32], n: usize) -> (Vec<f32>, Vec<TopLogprob>) {
        let all = sampling::log_softmax(logits);
        let top = sampling::top_n(&all, n)
            .into_iter()
            .map(|(id, logprob)| TopLogprob {
                id,
                token: self.bundle.tokenizer.token_text(id),
                logprob,
            })
            .collect();
        (all, top)
    }
}
