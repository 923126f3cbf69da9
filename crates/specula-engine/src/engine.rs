//! The engine: one loaded model and the generation loop (prefill, then decode one token per
//! target step, every token through the [`Emitter`]).

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Result;
use candle_core::{Device, Tensor};

use crate::bundle::{self, LoadedBundle};
use crate::chat::{ChatMessage, ChatTemplate};
use crate::constraint::{
    Constraint, GrammarCompiler, GrammarSpec, OutputControl, ReasoningConstraint, ReasoningControl,
};
use crate::device::{DeviceRow, DeviceTarget, SlotPool};
use crate::kv_cache::KvCache;
use crate::model::{LogitsRows, Model, ModelConfig};
use crate::prefix_cache::PrefixCache;
use crate::sequence::{Sequence, SequenceEnv, StepInput, StepOutcome};
use crate::speculative::SpecMode;
use crate::target::{Target, TargetSegment};
use crate::tokenizer::Tokenizer;
use crate::types::{GenerateOutput, GenerateRequest, RequestError, StreamDelta};

/// Options for loading a model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub device: Device,
    /// Prompt tokens per prefill forward (bounds activation memory).
    pub prefill_chunk: usize,
    /// Bytes of KV rows the prefix cache may hold ([`crate::prefix_cache`]); 0 = no prefix
    /// cache. Used only on batch-invariant models (where reuse is exact).
    pub prefix_cache_bytes: usize,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            prefill_chunk: 512,
            prefix_cache_bytes: 0,
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

/// What reading a draft model for an engine needs ([`Engine::draft_loader`]): the target's
/// tokenizer and vocabulary to check it against, and the device to load it on. Runs on any
/// thread.
#[derive(Clone)]
pub struct DraftLoader {
    tokenizer: Tokenizer,
    vocab: usize,
    device: Device,
    target_id: String,
}

/// A draft model read and checked by [`DraftLoader::load`], ready for
/// [`Engine::attach_loaded_draft`].
pub struct LoadedDraft {
    bundle: LoadedBundle,
    id: String,
}

impl LoadedDraft {
    /// The id it was loaded under.
    pub fn id(&self) -> &str {
        &self.id
    }
}

impl DraftLoader {
    /// Read the draft model at `path` (a GGUF file or HF directory) under `id`. Its tokenizer
    /// and LM head size are checked against the target's from the headers, before any weight is
    /// read, and `cancel` is looked at then too: a draft model with another tokenizer, or a
    /// load nobody waits for any more, stops there. Errors: the bundle does not load, does not
    /// fit the target, or the load was cancelled.
    pub fn load(&self, path: &Path, id: &str, cancel: &AtomicBool) -> Result<LoadedDraft> {
        let bundle = bundle::load_with(path, &self.device, &|tokenizer, config| {
            self.check(id, tokenizer, config)?;
            if cancel.load(Ordering::Relaxed) {
                anyhow::bail!("the load of draft model {id} was cancelled");
            }
            Ok(())
        })?;
        Ok(LoadedDraft {
            bundle,
            id: id.to_string(),
        })
    }

    /// Can a model with `tokenizer` and `config` draft for the target? The same tokenizer
    /// (vocabulary, merges, special tokens) and as many LM head rows.
    fn check(&self, id: &str, tokenizer: &Tokenizer, config: &ModelConfig) -> Result<()> {
        crate::tokenizer::check_same_tokenizer(&self.tokenizer, tokenizer)
            .map_err(|e| anyhow::anyhow!("draft model {id} cannot draft for {}: {e}", self.target_id))?;
        let (tv, dv) = (self.vocab, config.vocab_size);
        if tv != dv {
            anyhow::bail!(
                "draft model {id} cannot draft for {}: its LM head has {dv} rows, the target's has {tv}",
                self.target_id
            );
        }
        Ok(())
    }
}

/// Compile a request's grammar with `compiler` (any thread: the compile runs on a thread of
/// its own with a deep stack, [`GrammarCompiler::compile`]). Errors are the request's, naming
/// `tools` for a grammar built from forced tool calls and `response_format` otherwise.
pub fn compile_request_grammar(
    compiler: &GrammarCompiler,
    spec: &GrammarSpec,
) -> Result<Box<dyn Constraint>, RequestError> {
    compiler
        .compile(spec)
        .map(|c| Box::new(c) as Box<dyn Constraint>)
        .map_err(|e| match spec {
            GrammarSpec::ToolCalls(_) => RequestError::InvalidParameter(format!(
                "tools: tool_choice forces a call, and the grammar for it could not be built \
                 from the tools' parameters: {e:#}"
            )),
            _ => RequestError::InvalidParameter(format!("response_format: {e:#}")),
        })
}

/// A loaded model ready to generate.
pub struct Engine {
    bundle: LoadedBundle,
    id: String,
    kv: KvCache,
    opts: LoadOptions,
    draft: Option<DraftModel>,
    /// What `SpecMode::Default` runs, measured by `specula tune` (see [`crate::tuning`]).
    tuned: Option<crate::tuning::TunedDefault>,
    /// Built on the first constrained request (or [`Engine::shared_grammar_compiler`]).
    grammar: Option<Arc<GrammarCompiler>>,
    /// The attached MTP head ([`crate::speculative::mtp`]).
    mtp: Option<Arc<crate::speculative::mtp::MtpHead>>,
    /// The attached block drafter ([`crate::speculative::block`]).
    block: Option<Arc<crate::speculative::block::BlockDrafterModel>>,
    /// KV rows of seen prefixes (`LoadOptions::prefix_cache_bytes`).
    prefix: Option<PrefixCache>,
    /// What finished requests learned about drafting, by decode path and verification
    /// (see [`crate::speculative::DraftLength::warm_start`]).
    controller_priors: std::collections::HashMap<String, crate::speculative::DraftLength>,
    /// Seconds of batched forwards by row count, for the draft-length controllers under load.
    batch_cost: std::sync::Mutex<crate::speculative::controller::BatchCost>,
    /// Prompt rows per step beside decoding streams ([`PrefillBudget`]).
    prefill_budget: std::sync::Mutex<PrefillBudget>,
    /// The accelerator that runs the target's forwards, when one is attached
    /// ([`Engine::attach_device`]).
    device: Option<DeviceState>,
    /// [`Engine::limit_context`].
    context_cap: Option<usize>,
}

/// A [`DeviceTarget`] and its free KV slots.
pub(crate) struct DeviceState {
    pub(crate) target: std::sync::Mutex<Box<dyn DeviceTarget>>,
    slots: SlotPool,
    pub(crate) name: String,
    max_ctx: usize,
    pub(crate) batch_invariant: bool,
}

/// [`Engine::device_forward_hidden`] on the attached device `d`.
fn forward_hidden_in_slot(d: &DeviceState, tokens: &[u32], taps: &[usize]) -> Result<(Vec<f32>, Vec<f32>)> {
    if tokens.len() > d.max_ctx {
        anyhow::bail!("a {}-token sequence: a KV slot holds {}", tokens.len(), d.max_ctx);
    }
    // An empty prompt: the slot's held tokens are not reused, and forgotten.
    let Some((lease, _)) = d.slots.lease(&[]) else {
        anyhow::bail!("every KV slot of the device is held");
    };
    let mut target = d.target.lock().unwrap_or_else(|e| e.into_inner());
    let step = target.max_rows().max(1);
    let (mut logits, mut hidden) = (Vec::new(), Vec::new());
    for (c, chunk) in tokens.chunks(step).enumerate() {
        let rows: Vec<DeviceRow> = chunk
            .iter()
            .enumerate()
            .map(|(i, &token)| DeviceRow {
                token,
                slot: lease.slot(),
                pos: (c * step + i) as u32,
            })
            .collect();
        let (l, h) = target.forward_hidden(&rows, taps)?;
        logits.extend(l);
        hidden.extend(h);
    }
    Ok((logits, hidden))
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("id", &self.id).finish_non_exhaustive()
    }
}

/// The plain ChatML rendering used for a model without a chat template whose vocabulary has
/// ChatML's tokens: `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then
/// `<|im_start|>assistant\n` when `add_generation_prompt`. Returns the text and each message's
/// content range in it.
fn chatml(messages: &[ChatMessage], add_generation_prompt: bool) -> (String, Vec<std::ops::Range<usize>>) {
    let mut s = String::new();
    let mut spans = Vec::with_capacity(messages.len());
    for m in messages {
        s.push_str("<|im_start|>");
        s.push_str(&m.role);
        s.push('\n');
        spans.push(s.len()..s.len() + m.content.len());
        s.push_str(&m.content);
        s.push_str("<|im_end|>\n");
    }
    if add_generation_prompt {
        s.push_str("<|im_start|>assistant\n");
    }
    (s, spans)
}

impl Engine {
    /// Load a bundle (GGUF file or HF directory). `id` is the name clients use for it.
    pub fn load(path: &Path, id: &str, opts: LoadOptions) -> Result<Self> {
        let bundle = bundle::load(path, &opts.device)?;
        Ok(Self::from_bundle(bundle, id, opts))
    }

    pub fn from_bundle(bundle: LoadedBundle, id: &str, opts: LoadOptions) -> Self {
        let kv = bundle.model.new_kv_cache();
        let prefix = (opts.prefix_cache_bytes > 0 && bundle.model.batch_invariant())
            .then(|| PrefixCache::new(opts.prefix_cache_bytes));
        Self {
            prefix,
            controller_priors: Default::default(),
            batch_cost: Default::default(),
            prefill_budget: Default::default(),
            bundle,
            id: id.to_string(),
            kv,
            opts,
            draft: None,
            mtp: None,
            block: None,
            grammar: None,
            tuned: None,
            device: None,
            context_cap: None,
        }
    }

    /// Run the target's forwards on `target` (an accelerator holding the KV cache in slots,
    /// e.g. the CUDA model built from this engine's bundle) instead of the CPU model. The CPU
    /// model stays loaded for what has no device path yet (`logits_all`, distillation).
    /// Sequences then hold a device KV slot each ([`Engine::device_slots`]: at most that many
    /// run at once) and the context window is at most the slots' length. The host prefix cache
    /// is replaced by slot reuse (when `LoadOptions::prefix_cache_bytes` > 0): a new sequence
    /// takes a free slot whose K/V holds the start of its prompt ([`SlotPool::lease`]).
    ///
    /// Errors: an MTP head or block drafter is attached (they read hidden-state taps, which the
    /// device path does not return), the target's vocabulary differs from the model's, or it
    /// has no slot.
    pub fn attach_device(&mut self, target: Box<dyn DeviceTarget>) -> Result<()> {
        if target.vocab() != self.config().vocab_size {
            anyhow::bail!(
                "{}: {} logits per row, the model's vocabulary has {}",
                target.device_name(),
                target.vocab(),
                self.config().vocab_size
            );
        }
        if self.mtp.is_some() || self.block.is_some() {
            anyhow::bail!(
                "MTP heads and block drafters read the target's hidden states, which the {} path does not return yet: use n-gram or a draft model",
                target.device_name()
            );
        }
        if target.slots() == 0 || target.max_ctx() == 0 {
            anyhow::bail!("{}: no KV slot", target.device_name());
        }
        if self.prefix.take().is_some() {
            tracing::info!(
                "host prefix cache off: the KV cache lives on {} (a new request reuses the free KV slot sharing the longest prefix with its prompt)",
                target.device_name()
            );
        }
        self.device = Some(DeviceState {
            // Slot reuse is the device's prefix cache: on when the prefix cache is, and only
            // on batch-invariant kernels (where it is exact).
            slots: SlotPool::new(
                target.slots(),
                self.opts.prefix_cache_bytes > 0 && target.batch_invariant(),
            ),
            batch_invariant: target.batch_invariant(),
            name: target.device_name(),
            max_ctx: target.max_ctx(),
            target: std::sync::Mutex::new(target),
        });
        Ok(())
    }

    /// Whether the target's forwards give every row the same bits whatever the batch (then
    /// speculation and batching are exact): the CPU model's kernels for its weight types
    /// ([`Model::batch_invariant`]), or the attached device's, which are for every type
    /// (docs/gpu.md).
    pub fn batch_invariant(&self) -> bool {
        match &self.device {
            Some(d) => d.batch_invariant,
            None => self.bundle.model.batch_invariant(),
        }
    }

    /// Cap the context window (prompt + output tokens of one request) at `tokens` (never above
    /// the model's own or the device's). Errors: `tokens` is 0.
    pub fn limit_context(&mut self, tokens: usize) -> Result<()> {
        if tokens == 0 {
            anyhow::bail!("the context window must be at least one token");
        }
        self.context_cap = Some(tokens);
        Ok(())
    }

    /// The attached device's logits `[n, vocab]` and the outputs of blocks `taps`
    /// `[n, taps × hidden]` (f32, row-major, each row's taps side by side;
    /// [`DeviceTarget::forward_hidden`]) over a whole sequence `tokens` at positions `0..n`,
    /// fed in forwards of at most the device's row limit through a KV slot of its own. `None`
    /// without a device. Errors: the sequence is longer than a slot, every slot is held, a tap
    /// past the last block, or the device fails.
    pub fn device_forward_hidden(&self, tokens: &[u32], taps: &[usize]) -> Option<Result<(Vec<f32>, Vec<f32>)>> {
        let d = self.device.as_ref()?;
        Some(forward_hidden_in_slot(d, tokens, taps))
    }

    /// The attached device ([`Engine::attach_device`]) by name.
    pub fn device_name(&self) -> Option<&str> {
        self.device.as_ref().map(|d| d.name.as_str())
    }

    /// The attached device's KV slots: how many there are and how many are held.
    pub fn device_slots(&self) -> Option<&SlotPool> {
        self.device.as_ref().map(|d| &d.slots)
    }

    /// Load a draft model (GGUF file or HF directory) for speculative decoding with this engine
    /// as the target. Errors when the bundle does not load, or when its tokenizer differs from
    /// the target's (vocabulary, merges, special tokens) or its vocabulary size does not match
    /// (both checked before any weight is read).
    pub fn attach_draft_model(&mut self, path: &Path, id: &str) -> Result<()> {
        let draft = self.draft_loader().load(path, id, &AtomicBool::new(false))?;
        self.attach_loaded_draft(draft);
        Ok(())
    }

    /// As [`Engine::attach_draft_model`], from a loaded bundle.
    pub fn attach_draft_bundle(&mut self, draft: LoadedBundle, id: &str) -> Result<()> {
        let loader = self.draft_loader();
        loader.check(id, &draft.tokenizer, &draft.model.config)?;
        self.attach_loaded_draft(LoadedDraft {
            bundle: draft,
            id: id.to_string(),
        });
        Ok(())
    }

    /// What loading a draft model for this engine needs, to load one off the engine's thread
    /// ([`DraftLoader::load`]) while it keeps generating.
    pub fn draft_loader(&self) -> DraftLoader {
        DraftLoader {
            tokenizer: self.bundle.tokenizer.clone(),
            vocab: self.config().vocab_size,
            device: self.opts.device.clone(),
            target_id: self.id.clone(),
        }
    }

    /// Attach a draft model [`DraftLoader::load`] read for this engine (checked then: attaching
    /// is a move).
    pub fn attach_loaded_draft(&mut self, draft: LoadedDraft) {
        self.draft = Some(DraftModel {
            model: Arc::new(draft.bundle.model),
            id: draft.id,
        });
    }

    /// Reduce the attached draft model's LM head to a draft vocabulary (FR-Spec): the `n` token
    /// ids [`crate::speculative::draft_model::draft_vocab_ids`] picks from `ranked` (ids by frequency
    /// in this target's text), with this target's end-of-generation ids. The draft model then
    /// proposes only those tokens, at the cost of that share of its LM head; the target still
    /// verifies over the full vocabulary, so output is unchanged. Errors: no draft model
    /// attached, or one already in use by a request, or whose LM head is not on our kernels.
    pub fn reduce_draft_vocab(&mut self, ranked: &[u32], n: usize) -> Result<usize> {
        let eos = self.bundle.eos_ids.clone();
        let Some(d) = self.draft.as_mut() else {
            anyhow::bail!("a draft vocabulary needs a draft model (--draft-model)");
        };
        let Some(model) = Arc::get_mut(&mut d.model) else {
            anyhow::bail!("the draft model is in use: its vocabulary can only be reduced before the first request");
        };
        let ids = crate::speculative::draft_model::draft_vocab_ids(ranked, n, model.config.vocab_size, &eos);
        model
            .restrict_logits(&ids)
            .map_err(|e| anyhow::anyhow!("draft model {}: {e}", d.id))?;
        Ok(ids.len())
    }

    /// Load an MTP head (a directory with config.json and safetensors, or one safetensors file)
    /// for this engine's model and attach it: `SpecMode::Mtp` drafts with it, and `Default` /
    /// `On` use it when no draft model is attached. Errors: the head does not load or does not
    /// fit the target (the message names the file and the tensor or field).
    pub fn attach_mtp_head(&mut self, path: &Path) -> Result<()> {
        self.refuse_taps_on_device("an MTP head")?;
        let head = crate::speculative::mtp::MtpHead::load(path, &self.bundle.model)?;
        self.mtp = Some(Arc::new(head));
        Ok(())
    }

    /// Load a block drafter (a folder with config.json and safetensors) for this engine's model
    /// and attach it: `SpecMode::Block` drafts with it. Errors: it does not load or does not fit
    /// the target (the message names the file and the field or tensor).
    pub fn attach_block_drafter(&mut self, dir: &Path) -> Result<()> {
        self.refuse_taps_on_device("a block drafter")?;
        let m = crate::speculative::block::BlockDrafterModel::load(dir, &self.bundle.model)?;
        self.block = Some(Arc::new(m));
        Ok(())
    }

    /// Errors when a device is attached: `what` reads hidden-state taps, which the device path
    /// does not return yet.
    fn refuse_taps_on_device(&self, what: &str) -> Result<()> {
        match &self.device {
            Some(d) => anyhow::bail!(
                "{what} reads the target's hidden states, which the {} path does not return yet: use n-gram or a draft model",
                d.name
            ),
            None => Ok(()),
        }
    }

    /// The attached block drafter, if any.
    pub fn block_drafter(&self) -> Option<&crate::speculative::block::BlockDrafterModel> {
        self.block.as_deref()
    }

    /// The attached native drafters as `kind: source` lines (`mtp: /path`, `block: /path`).
    pub fn native_drafters(&self) -> Vec<String> {
        // Shown to clients (`/v1/models`): the files by name, not by server path.
        let mut v = Vec::new();
        if let Some(m) = &self.mtp {
            v.push(format!("mtp: {}", crate::inspect::redact_paths(&m.source)));
        }
        if let Some(b) = &self.block {
            v.push(format!("block: {}", crate::inspect::redact_paths(&b.source)));
        }
        v
    }

    /// The attached MTP head, if any.
    pub fn mtp_head(&self) -> Option<&crate::speculative::mtp::MtpHead> {
        self.mtp.as_deref()
    }

    /// The attached draft model's id, if any.
    pub fn draft_model_id(&self) -> Option<&str> {
        self.draft.as_ref().map(|d| d.id.as_str())
    }

    /// Detach the draft model and return its id (`None` when none was attached). Its weights
    /// are freed once no [`SequenceEnv`] from [`Engine::sequence_env`] holds them (none does
    /// between generations). Afterwards requests with
    /// `SpecMode::Draft` are rejected by [`Engine::validate`], `Default` / `On` resolve to n-gram
    /// lookup, and a tuned draft-model choice is left to the built-in chain.
    pub fn detach_draft_model(&mut self) -> Option<String> {
        self.draft.take().map(|d| d.id)
    }

    /// The drafter a speculative mode resolves to on this engine: `None` for AR. `Default`
    /// follows the measured tuning choice when one is set ([`Engine::set_tuned_default`]).
    pub fn resolve_spec_mode(&self, mode: SpecMode) -> Option<SpecMode> {
        let spec = self.effective_spec(crate::speculative::SpecOptions {
            mode,
            ..Default::default()
        });
        crate::sequence::resolve(
            spec.mode,
            self.draft.is_some(),
            self.mtp.is_some(),
            self.block.is_some(),
        )
    }

    /// Make `SpecMode::Default` follow a measured tuning choice (`None`: the built-in chain).
    pub fn set_tuned_default(&mut self, tuned: Option<crate::tuning::TunedDefault>) {
        self.tuned = tuned;
    }

    /// The measured choice `SpecMode::Default` follows, if any.
    pub fn tuned_default(&self) -> Option<&crate::tuning::TunedDefault> {
        self.tuned.as_ref()
    }

    /// A request's speculation settings as they run: `Default` with a tuning choice becomes that
    /// choice (drafter, k, adaptive); a tuned draft-model choice without an attached draft model
    /// is left to the built-in chain. Everything else is unchanged.
    pub fn effective_spec(&self, spec: crate::speculative::SpecOptions) -> crate::speculative::SpecOptions {
        match &self.tuned {
            Some(t)
                if spec.mode == SpecMode::Default
                    && (t.mode != SpecMode::Draft || self.draft.is_some())
                    && (t.mode != SpecMode::Mtp || self.mtp.is_some())
                    && (t.mode != SpecMode::Block || self.block.is_some()) =>
            {
                crate::speculative::SpecOptions {
                    mode: t.mode,
                    draft_max: t.draft_max.clamp(1, MAX_DRAFT),
                    adaptive: t.adaptive,
                    sampled_verify: spec.sampled_verify,
                }
            }
            _ => spec,
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
        let model = self
            .bundle
            .model
            .config
            .context_length
            .min(self.context_cap.unwrap_or(usize::MAX));
        self.device.as_ref().map_or(model, |d| model.min(d.max_ctx))
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
    /// used when the vocabulary has ChatML's tokens. Errors: the template fails, or the model has
    /// neither (a base model: completions only).
    pub fn render_chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, RequestError> {
        match &self.bundle.template {
            Some(t) => t
                .render(messages, add_generation_prompt)
                .map_err(|e| RequestError::InvalidParameter(format!("chat template: {e}"))),
            None if self.bundle.tokenizer.token_to_id("<|im_start|>").is_none() => {
                Err(RequestError::InvalidParameter(format!(
                    "model '{}' has no chat template (a base model): send a plain prompt to /v1/completions instead",
                    self.id
                )))
            }
            None => Ok(chatml(messages, add_generation_prompt).0),
        }
    }

    /// Tokenize text (special-token text is parsed), whatever its length.
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, RequestError> {
        self.bundle
            .tokenizer
            .encode(text)
            .map_err(|e| RequestError::InvalidParameter(e.to_string()))
    }

    /// Tokenize a prompt (special-token text is parsed). A text too long for the context
    /// window whatever its tokens ([`RequestError::PromptTooLongBytes`]: its bytes divided by
    /// the most bytes one token covers reach the context length) is refused before tokenizing,
    /// so a huge request costs no tokenizer time.
    pub fn tokenize_prompt(&self, text: &str) -> Result<Vec<u32>, RequestError> {
        self.check_prompt_bytes(text)?;
        self.tokenize(text)
    }

    /// Tokenize a prompt given as text by a client: control-token strings in it (`<|im_end|>`)
    /// are the text they spell, as message contents are ([`crate::tokenizer::Tokenizer::encode_with_text_spans`]
    /// over the whole text), unless `parse_special`, which maps them to their tokens as
    /// [`Engine::tokenize_prompt`] does. A text without such strings gives the same ids either
    /// way. Errors: as [`Engine::tokenize_prompt`].
    pub fn tokenize_prompt_text(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, RequestError> {
        if parse_special {
            return self.tokenize_prompt(text);
        }
        self.check_prompt_bytes(text)?;
        self.bundle
            .tokenizer
            .encode_with_text_spans(text, std::slice::from_ref(&(0..text.len())))
            .map_err(|e| RequestError::InvalidParameter(e.to_string()))
    }

    /// [`RequestError::PromptTooLongBytes`] for a text too long for the context window whatever
    /// its tokens.
    fn check_prompt_bytes(&self, text: &str) -> Result<(), RequestError> {
        let ctx = self.context_length();
        let min_tokens = text.len() / self.bundle.tokenizer.max_token_bytes();
        if min_tokens >= ctx {
            return Err(RequestError::PromptTooLongBytes {
                bytes: text.len(),
                min_tokens,
                context: ctx,
            });
        }
        Ok(())
    }

    /// Render and tokenize a chat prompt ([`Engine::chat_tokens`] without extras).
    pub fn chat_prompt_tokens(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, RequestError> {
        Ok(self.chat_tokens(messages, &crate::chat::ChatExtras::default())?.0)
    }

    /// Render a chat prompt (with the generation prompt) and tokenize it; returns the tokens and
    /// the rendered text. Message contents are data: control-token text written in a
    /// `content` or `reasoning_content` becomes the ordinary tokens of that text
    /// ([`crate::tokenizer::Tokenizer::encode_with_text_spans`]), so a message cannot close its turn or open a
    /// system turn; only the template's own markup yields control tokens. Contents without
    /// such text tokenize exactly as the rendered text does.
    ///
    /// Errors (400s): the template fails or rewrites a content holding control-token text;
    /// `tools` for a model without a template; no template and no ChatML tokens (a base
    /// model); a prompt too long ([`Engine::tokenize_prompt`]'s checks).
    pub fn chat_tokens(
        &self,
        messages: &[ChatMessage],
        extras: &crate::chat::ChatExtras,
    ) -> Result<(Vec<u32>, String), RequestError> {
        let tok = &self.bundle.tokenizer;
        let marked = |t: &str| tok.has_special_text(t).unwrap_or(true);
        let (text, spans) = match &self.bundle.template {
            Some(t) => t
                .render_marked(messages, true, extras, &marked)
                .map_err(|e| RequestError::InvalidParameter(format!("chat template: {e}")))?,
            None => {
                // Checks that ChatML's tokens exist (else a base model's 400).
                self.render_chat(&[], false)?;
                if extras.tools.is_some() {
                    return Err(RequestError::InvalidParameter(format!(
                        "{} has no chat template, so it cannot be shown tools",
                        self.id
                    )));
                }
                let (text, spans) = chatml(messages, true);
                let spans = messages
                    .iter()
                    .zip(spans)
                    .filter(|(m, _)| marked(&m.content))
                    .map(|(_, r)| r)
                    .collect();
                (text, spans)
            }
        };
        self.check_prompt_bytes(&text)?;
        let tokens = tok
            .encode_with_text_spans(&text, &spans)
            .map_err(|e| RequestError::InvalidParameter(e.to_string()))?;
        Ok((tokens, text))
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
        if let Some(&(bad, _)) = req
            .sampling
            .logit_bias
            .iter()
            .find(|&&(t, _)| t as usize >= self.config().vocab_size)
        {
            return Err(RequestError::InvalidParameter(format!(
                "logit_bias token id {bad} is outside the vocabulary ({} tokens)",
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
        if req.spec.mode == SpecMode::Mtp && self.mtp.is_none() {
            return Err(RequestError::InvalidParameter(format!(
                "speculative mode `mtp` needs an MTP head, and {} has none attached \
                 (start the server with --drafter, or train one with `specula distill`)",
                self.id
            )));
        }
        if req.spec.mode == SpecMode::Block && self.block.is_none() {
            return Err(RequestError::InvalidParameter(format!(
                "speculative mode `block` needs a block drafter, and {} has none attached \
                 (start the server with --drafter DIR)",
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

    /// Logits for every position of `tokens` (teacher forcing), from an empty cache.
    /// Returns `[tokens.len(), vocab]`.
    pub fn logits_all(&mut self, tokens: &[u32]) -> Result<Tensor> {
        self.kv.clear();
        let out = self.bundle.model.forward(tokens, &mut self.kv, LogitsRows::All, &[])?;
        self.kv.clear();
        Ok(out.logits)
    }

    /// Logits of every row of `tokens` (`[tokens.len(), vocab]` f32), evaluated the way
    /// llama.cpp's CPU backend evaluates a prompt of `prompt_len` tokens and then decodes the
    /// rest: the prompt in micro-batches of 512 rows (llama.cpp's default `-ub`), each with the
    /// attention path llama.cpp picks for its row count (`flash_attn_ext`'s tiled path from 64
    /// rows, the one-chunk path below), its batch arithmetic for Q4_K and Q6_K products
    /// ([`crate::kernels::kquants::with_llamacpp_batches`]) and its dot-product arithmetic for
    /// the 32-wide block types ([`crate::kernels::qmatmul::with_ggml_arithmetic`]), then the
    /// remaining rows as one-row decode steps. This reproduces the reference files made with
    /// `llama-server` (`tests/reference.rs`); serving keeps one arithmetic for every row count,
    /// which batch invariance needs (llama.cpp's one-row arithmetic for the K-quants, one float
    /// chain per output for the 32-wide types: `kernels/qmatmul.rs`).
    ///
    /// Errors: as [`crate::model::Model::forward`]; `prompt_len` past `tokens.len()`.
    pub fn logits_as_llamacpp(&mut self, tokens: &[u32], prompt_len: usize) -> Result<Tensor> {
        use crate::kernels::kquants::with_llamacpp_batches;
        use crate::kernels::qmatmul::with_ggml_arithmetic;
        use crate::model::attention::{with_mode, AttnMode};
        anyhow::ensure!(
            prompt_len <= tokens.len(),
            "prompt_len {prompt_len} past {} tokens",
            tokens.len()
        );
        const UBATCH: usize = 512;
        const TILED_FROM: usize = 64;
        self.kv.clear();
        let mut parts = Vec::new();
        let mut pieces: Vec<&[u32]> = tokens[..prompt_len].chunks(UBATCH).collect();
        if prompt_len < tokens.len() {
            pieces.push(&tokens[prompt_len..]);
        }
        let mut done = 0;
        for piece in pieces {
            let mode = if done < prompt_len && piece.len() >= TILED_FROM {
                AttnMode::Tiled
            } else {
                AttnMode::OneChunk
            };
            let model = &self.bundle.model;
            let kv = &mut self.kv;
            // Prompt micro-batches in llama.cpp's batch arithmetic for Q4_K and Q6_K; the
            // completion rows were one-row decode steps.
            let batch = done < prompt_len;
            let out = with_mode(mode, || {
                with_ggml_arithmetic(true, || {
                    with_llamacpp_batches(batch, || model.forward(piece, kv, LogitsRows::All, &[]))
                })
            });
            match out {
                Ok(o) => parts.push(o.logits),
                Err(e) => {
                    self.kv.clear();
                    return Err(e);
                }
            }
            done += piece.len();
        }
        self.kv.clear();
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// The shared, read-only part of this engine a [`Sequence`] needs.
    pub fn sequence_env(&self) -> SequenceEnv {
        SequenceEnv {
            tokenizer: self.bundle.tokenizer.clone(),
            eos_ids: self.bundle.eos_ids.clone(),
            context_length: self.context_length(),
            prefill_chunk: self.opts.prefill_chunk,
            batch_invariant: self.batch_invariant(),
            draft: self.draft.as_ref().map(|d| (d.model.clone(), d.id.clone())),
            draft_size: self.draft.as_ref().map(|d| {
                crate::speculative::controller::SizeRatio::of(
                    d.model.config(),
                    d.model.logit_rows(),
                    self.model().config(),
                )
            }),
            verify_prior: (1..=MAX_DRAFT + 1)
                .map(|r| crate::speculative::controller::verify_cost_prior(self.model().config(), r))
                .collect(),
            mtp: self.mtp.clone(),
            block: self.block.clone(),
            controller_priors: self.controller_priors.clone(),
        }
    }

    /// Generate for one request. `on_delta` receives each piece of output as it becomes final,
    /// and an empty delta between prefill chunks (a liveness probe); returning `false` cancels
    /// the request (finish reason `cancelled`).
    pub fn generate(
        &mut self,
        req: &GenerateRequest,
        on_delta: &mut dyn FnMut(&StreamDelta) -> bool,
    ) -> Result<GenerateOutput, RequestError> {
        self.generate_constrained(req, None, on_delta)
    }

    /// The grammar compiler of this model (built on first use: ~0.1 s for a 150k vocabulary).
    fn grammar_compiler(&mut self) -> Result<&GrammarCompiler, RequestError> {
        if self.grammar.is_none() {
            let rows = self.config().vocab_size;
            if !self.bundle.eos_ids.iter().any(|&t| (t as usize) < rows) {
                return Err(RequestError::InvalidParameter(
                    "this model has no end-of-generation token to end a grammar".into(),
                ));
            }
            let c = GrammarCompiler::new(&self.bundle.tokenizer, rows, &self.bundle.eos_ids)
                .map_err(|e| RequestError::Internal(format!("{e:#}")))?;
            self.grammar = Some(Arc::new(c));
        }
        self.grammar
            .as_deref()
            .ok_or_else(|| RequestError::Internal("grammar compiler".into()))
    }

    /// The grammar compiler of this model, to compile requests' grammars off the engine's
    /// thread ([`compile_request_grammar`]). Errors: the model has no end-of-generation token.
    pub fn shared_grammar_compiler(&mut self) -> Result<Arc<GrammarCompiler>, RequestError> {
        self.grammar_compiler()?;
        self.grammar
            .clone()
            .ok_or_else(|| RequestError::Internal("grammar compiler".into()))
    }

    /// Compile a structured-output constraint for this model. Errors: the grammar, schema or
    /// regex is invalid (a request error).
    pub fn compile_grammar(&mut self, spec: &GrammarSpec) -> Result<Box<dyn Constraint>, RequestError> {
        compile_request_grammar(self.grammar_compiler()?, spec)
    }

    /// The constraint of a request whose grammar is already compiled (`grammar`, from
    /// [`compile_request_grammar`] with this model's [`Engine::shared_grammar_compiler`]): the
    /// grammar alone, or the reasoning bounds of `reasoning` with the grammar applied to the
    /// answer after the reasoning (`None` when neither constrains anything). Errors: empty
    /// reasoning markers.
    pub fn constrain(
        &mut self,
        grammar: Option<Box<dyn Constraint>>,
        reasoning: Option<&ReasoningControl>,
    ) -> Result<Option<Box<dyn Constraint>>, RequestError> {
        let Some(r) = reasoning else {
            return Ok(grammar);
        };
        let bad = |m: String| RequestError::InvalidParameter(m);
        let forced = self
            .bundle
            .tokenizer
            .inner()
            .encode_fast(r.close.as_str(), false)
            .map_err(|e| bad(format!("reasoning close marker: {e}")))?
            .get_ids()
            .to_vec();
        let words = self.grammar_compiler()?.words().clone();
        ReasoningConstraint::new(words, r, forced, grammar)
            .map(|c| Some(Box::new(c) as Box<dyn Constraint>))
            .map_err(|e| bad(format!("{e:#}")))
    }

    /// Build the constraint of `control` for this model: the grammar alone, or the reasoning
    /// bounds with the grammar applied to the answer after the reasoning (`None` when `control`
    /// constrains nothing). Errors: an invalid grammar, empty reasoning markers.
    pub fn compile_output_control(
        &mut self,
        control: &OutputControl,
    ) -> Result<Option<Box<dyn Constraint>>, RequestError> {
        let grammar = control.grammar.as_ref().map(|g| self.compile_grammar(g)).transpose()?;
        self.constrain(grammar, control.reasoning.as_ref())
    }

    /// As [`Engine::generate`], with the output constrained to `grammar` (structured output):
    /// every logits row, verify rows included, is masked with the grammar state after the
    /// tokens before it, so speculation stays exact.
    pub fn generate_constrained(
        &mut self,
        req: &GenerateRequest,
        grammar: Option<&GrammarSpec>,
        on_delta: &mut dyn FnMut(&StreamDelta) -> bool,
    ) -> Result<GenerateOutput, RequestError> {
        let control = OutputControl {
            grammar: grammar.cloned(),
            reasoning: None,
        };
        self.generate_with(req, &control, on_delta)
    }

    /// As [`Engine::generate`], with the output constrained by `control`: a grammar
    /// (structured output) and/or a reasoning budget ([`ReasoningControl`]). Every logits row,
    /// verify rows included, is masked with the constraint's state after the tokens before it,
    /// so speculation stays exact: the forced `</think>` and the grammar's first token land
    /// where plain decoding puts them, also inside an accepted block.
    ///
    /// [`ReasoningControl`]: crate::constraint::ReasoningControl
    pub fn generate_with(
        &mut self,
        req: &GenerateRequest,
        control: &OutputControl,
        on_delta: &mut dyn FnMut(&StreamDelta) -> bool,
    ) -> Result<GenerateOutput, RequestError> {
        self.validate(req)?;
        let constraint = self.compile_output_control(control)?;
        self.generate_with_constraint(req, constraint, on_delta)
    }

    /// As [`Engine::generate`], with every logits row masked by `constraint` (from
    /// [`Engine::compile_output_control`]), so that callers can report a bad grammar before
    /// generation starts.
    pub fn generate_with_constraint(
        &mut self,
        req: &GenerateRequest,
        constraint: Option<Box<dyn Constraint>>,
        on_delta: &mut dyn FnMut(&StreamDelta) -> bool,
    ) -> Result<GenerateOutput, RequestError> {
        let mut seq = self.start_sequence(req, constraint)?;
        let mut result = Ok(());
        while seq.finished().is_none() {
            // Between prefill chunks, an empty delta asks the client whether it is still there.
            if seq.is_prefilling() && !seq.kv().is_empty() && !on_delta(&StreamDelta::default()) {
                seq.cancel();
                break;
            }
            let outcome = match self.step(&mut [&mut seq]).pop() {
                Some(Ok(Some(o))) => o,
                Some(Ok(None)) | None => break,
                Some(Err(e)) => {
                    result = Err(e);
                    break;
                }
            };
            let d = &outcome.delta;
            let has_output = !d.text.is_empty() || !d.token_ids.is_empty();
            if has_output && !on_delta(d) {
                seq.cancel();
                break;
            }
        }
        let out = self.retire(seq, result.is_ok());
        result.map(|()| out)
    }

    /// A sequence for `req` with its own, empty KV cache, to be advanced with [`Engine::step`]
    /// (continuous batching). `constraint`: from [`Engine::compile_output_control`]. The
    /// request's `spec` is resolved as [`Engine::effective_spec`] says. Errors: the request is
    /// invalid for this model ([`Engine::validate`]).
    pub fn start_sequence(
        &mut self,
        req: &GenerateRequest,
        constraint: Option<Box<dyn Constraint>>,
    ) -> Result<Sequence, RequestError> {
        self.validate(req)?;
        let mut req = req.clone();
        req.spec = self.effective_spec(req.spec);
        if self.device.is_some() {
            return self.start_device_sequence(req, constraint);
        }
        let mut kv = self.bundle.model.new_kv_cache();
        // A prefix-cache hit fills the cache with the prefix's rows (at least one prompt token
        // is left to feed: its logits give the first output token).
        let cached = match self.prefix.as_mut() {
            Some(p) => {
                let n = req.prompt_tokens.len().saturating_sub(1);
                p.lookup(&req.prompt_tokens, n, &mut kv).unwrap_or_else(|e| {
                    tracing::warn!("prefix cache lookup failed, prefilling cold: {e:#}");
                    kv.clear();
                    0
                })
            }
            None => 0,
        };
        let mut seq = Sequence::with_constraint(self.sequence_env(), req, kv, constraint);
        if cached > 0 {
            seq.skip_prefix(cached);
        }
        Ok(seq)
    }

    /// [`Engine::start_sequence`] on the attached device: the sequence leases a KV slot.
    fn start_device_sequence(
        &mut self,
        req: GenerateRequest,
        constraint: Option<Box<dyn Constraint>>,
    ) -> Result<Sequence, RequestError> {
        let Some(dev) = self.device.as_ref() else {
            return Err(RequestError::Internal("no device attached".into()));
        };
        let (lease, reuse) = dev.slots.lease(&req.prompt_tokens).ok_or_else(|| {
            RequestError::Internal(format!(
                "all {} KV slots of {} are in use (run at most that many requests at once)",
                dev.slots.slots(),
                dev.name
            ))
        })?;
        let mut kv = crate::device::position_counter(self.context_length());
        if reuse > 0 {
            kv.advance(reuse)
                .map_err(|e| RequestError::Internal(format!("{e:#}")))?;
        }
        let mut seq = Sequence::with_constraint(self.sequence_env(), req, kv, constraint);
        seq.set_device_slot(lease);
        if reuse > 0 {
            seq.skip_prefix(reuse);
        }
        Ok(seq)
    }

    /// Finish `seq` and return its output; when it ended without an error (`ok`), its prompt
    /// and output rows enter the prefix cache (the positions whose tokens were fed to the
    /// model: the prompt and every output token but the last).
    pub fn retire(&mut self, seq: Sequence, ok: bool) -> GenerateOutput {
        let prompt = seq.request().prompt_tokens.clone();
        if let Some((key, ctl)) = seq.controller() {
            self.controller_priors.insert(key, ctl.clone());
        }
        let slot = seq.device_slot();
        let (out, kv) = seq.finish();
        if let (Some(d), Some(slot), true) = (self.device.as_ref(), slot, ok) {
            // The positions fed to the slot (as for the prefix cache below): the prompt and
            // every output token but the last, and never past what the slot committed.
            let mut tokens = prompt.clone();
            tokens.extend_from_slice(&out.token_ids);
            let fed = (prompt.len() + out.token_ids.len().saturating_sub(1)).min(kv.len());
            tokens.truncate(fed);
            d.slots.remember(slot, tokens);
        }
        if let (Some(p), true) = (self.prefix.as_mut(), ok) {
            let mut tokens = prompt;
            let fed = tokens.len() + out.token_ids.len().saturating_sub(1);
            tokens.extend_from_slice(&out.token_ids);
            p.insert(&tokens, fed, &kv);
        }
        out
    }

    /// Bytes of KV cache one position takes (every layer's K and V rows, f16).
    pub fn kv_bytes_per_token(&self) -> usize {
        let c = self.config();
        c.num_layers * 2 * c.num_kv_heads * c.head_dim * crate::kv_cache::KV_ELEM_BYTES
    }

    /// The prefix cache's counters, when it is on (with a device: its slot reuse, which holds
    /// no host memory).
    pub fn prefix_cache_stats(&self) -> Option<crate::prefix_cache::PrefixCacheStats> {
        if let Some(d) = &self.device {
            let s = d.slots.stats();
            return Some(crate::prefix_cache::PrefixCacheStats {
                hits: s.hits,
                misses: s.misses,
                hit_tokens: s.hit_tokens,
                ..Default::default()
            });
        }
        self.prefix.as_ref().map(PrefixCache::stats)
    }

    /// One target forward for every unfinished sequence of `seqs` (continuous batching), on
    /// whichever device the target runs: their inputs (prefill chunks, decode steps, verify
    /// blocks) go through one batched [`Target::forward`] (the CPU [`Model`] or the attached
    /// device) when the target is batch-invariant, so each sequence gets the bits it would get
    /// alone; otherwise one forward per sequence (still exact, no batching gain). Then each
    /// sequence absorbs its rows (acceptance, emission, the next draft). This is the one step
    /// path: [`Engine::generate`] runs it for one sequence.
    ///
    /// Prompt rows are budgeted: at most `LoadOptions::prefill_chunk` of them per step, fewer
    /// beside decoding streams ([`PrefillBudget`]), shortest remaining prompt first, so a burst
    /// of new requests does not stall the running streams and a short prompt is not kept
    /// waiting behind a long one; a deferred sequence gets an empty outcome and feeds its chunk
    /// later.
    ///
    /// Returns one entry per sequence, in order: `Ok(None)` for a sequence that was already
    /// finished, `Ok(Some(outcome))`, or the error of its forward or acceptance (an internal
    /// error; the sequence should then be finished by the caller).
    pub fn step(&self, seqs: &mut [&mut Sequence]) -> Vec<Result<Option<StepOutcome>, RequestError>> {
        // A grammar that hits one of the grammar library's limits mid-generation is the
        // request's fault, not the server's.
        let internal = |e: anyhow::Error| match e.downcast_ref::<crate::constraint::GrammarError>() {
            Some(g) => RequestError::InvalidParameter(format!("{}: {g}", g.param)),
            None => RequestError::Internal(format!("{e:#}")),
        };
        let mut inputs: Vec<Option<StepInput>> = seqs.iter_mut().map(|s| s.next_input()).collect();
        let deferred = self.budget_prompt_rows(seqs, &mut inputs);
        if draft_budget_on() {
            self.apply_draft_budget(seqs, &mut inputs);
        }
        let live: Vec<usize> = (0..seqs.len()).filter(|&i| inputs[i].is_some()).collect();
        let mut results: Vec<Result<Option<StepOutcome>, RequestError>> =
            deferred.iter().map(|&d| Ok(d.then(StepOutcome::default))).collect();
        let target: &dyn Target = match &self.device {
            Some(dev) => dev,
            None => &self.bundle.model,
        };
        let ctx = self.context_length();
        let groups: Vec<Vec<usize>> = if target.batch_invariant() {
            vec![live]
        } else {
            live.into_iter().map(|i| vec![i]).collect()
        };
        for group in groups {
            // A sequence this target cannot run fails alone; the others go ahead.
            let mut ok = Vec::with_capacity(group.len());
            for i in group {
                let Some(inp) = inputs[i].as_ref() else { continue };
                let fail = if !seqs[i].taps().is_empty() && !target.hidden_states() {
                    Some(target.no_hidden_reason())
                } else if seqs[i].kv().len() + inp.tokens.len() > ctx {
                    Some(format!("the sequence would pass the {ctx} positions of its KV cache"))
                } else {
                    None
                };
                match fail {
                    Some(m) => results[i] = Err(RequestError::Internal(m)),
                    None => ok.push(i),
                }
            }
            if ok.is_empty() {
                continue;
            }
            // The union of the group's drafter taps (MTP heads, block drafters).
            let mut taps: Vec<usize> = ok.iter().flat_map(|&i| seqs[i].taps().to_vec()).collect();
            taps.sort_unstable();
            taps.dedup();
            let mut segs: Vec<TargetSegment> = seqs
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| ok.contains(i))
                .filter_map(|(i, s)| {
                    let argmax_only = s.argmax_suffices();
                    inputs[i].as_ref().map(|inp| TargetSegment {
                        tokens: &inp.tokens,
                        state: s.target_state(),
                        rows: inp.rows,
                        argmax_only,
                    })
                })
                .collect();
            let rows: usize = segs.iter().map(|s| s.tokens.len()).sum();
            let started = std::time::Instant::now();
            let outs = target.forward(&mut segs, &taps);
            let seconds = started.elapsed().as_secs_f64();
            drop(segs);
            self.note_batch(seqs, &ok, rows, outs.is_ok().then_some(seconds));
            match outs {
                Err(e) => fail_group(&mut results, &ok, &e),
                Ok(outs) => {
                    for (&i, out) in ok.iter().zip(outs) {
                        let absorbed = (|| {
                            let hidden = seqs[i]
                                .taps()
                                .iter()
                                .map(|t| {
                                    let at = taps.iter().position(|u| u == t).unwrap_or(0);
                                    Ok(out.hidden[at].flatten_all()?.to_vec1::<f32>()?)
                                })
                                .collect::<Result<Vec<_>>>()?;
                            seqs[i].absorb_target(out.rows, hidden)
                        })();
                        results[i] = absorbed.map(Some).map_err(internal);
                    }
                }
            }
        }
        results
    }

    /// The batch's draft budget ([`crate::speculative::controller::draft_budget`]): with two or more
    /// sequences decoding in one forward, trim the drafts the measured row costs say the step is
    /// faster without (a row-group boundary is paid once by the whole step). Each trimmed
    /// sequence's input is taken again.
    fn apply_draft_budget(&self, seqs: &mut [&mut Sequence], inputs: &mut [Option<StepInput>]) {
        let (mut fixed_rows, mut decoding) = (0, 0);
        let (mut who, mut drafts) = (Vec::new(), Vec::new());
        for (i, s) in seqs.iter().enumerate() {
            let Some(inp) = inputs[i].as_ref() else { continue };
            match s.pending_draft() {
                Some(d) => {
                    fixed_rows += 1;
                    decoding += 1;
                    who.push(i);
                    drafts.push(d);
                }
                None => {
                    fixed_rows += inp.tokens.len();
                    decoding += usize::from(!s.is_prefilling());
                }
            }
        }
        if decoding < 2 || !drafts.iter().any(|d| d.trimmable) {
            return;
        }
        let keep = {
            let bc = self.batch_cost.lock().unwrap_or_else(|e| e.into_inner());
            crate::speculative::controller::draft_budget(fixed_rows, decoding, &drafts, &bc)
        };
        for ((&i, k), d) in who.iter().zip(keep).zip(&drafts) {
            if k < d.len {
                seqs[i].trim_draft(k);
                inputs[i] = seqs[i].next_input();
            }
        }
    }

    /// The step's prompt rows ([`Engine::step`]); returns which sequences were deferred (their
    /// input taken away: they feed their chunk at a later step).
    ///
    /// At most `prefill_chunk` prompt rows per step (at least one), so running streams keep
    /// flowing while new prompts are prefilled. On batch-invariant forwards:
    /// - While streams decode, fewer ([`PrefillBudget`]): each of their tokens waits for the
    ///   whole step.
    /// - The rows go to the prompts with the fewest tokens left first (shortest remaining first,
    ///   which minimises the mean time to first token): a short prompt that arrives behind a
    ///   long one is prefilled at once, and the long one takes the rows left (a chunk that ends
    ///   elsewhere, which changes no bit there). The longest-waiting prefilling sequence (the
    ///   first in `seqs`) is promised a quarter of the rows first, so a stream of short prompts
    ///   cannot starve it.
    ///
    /// Without batch invariance a chunk's rows change its bits, so chunks keep fixed
    /// boundaries whatever the load: the first prefilling sequence runs its whole chunk and
    /// the others wait while the chunk budget is spent, in arrival order (as before).
    fn budget_prompt_rows(&self, seqs: &mut [&mut Sequence], inputs: &mut [Option<StepInput>]) -> Vec<bool> {
        let mut deferred = vec![false; seqs.len()];
        let prefilling: Vec<usize> = (0..seqs.len())
            .filter(|&i| inputs[i].is_some() && seqs[i].is_prefilling())
            .collect();
        let rows = |inputs: &[Option<StepInput>], i: usize| inputs[i].as_ref().map_or(0, |inp| inp.tokens.len());
        if !self.batch_invariant() {
            let mut used = 0;
            for i in prefilling {
                let n = rows(inputs, i);
                if used > 0 && used + n > self.opts.prefill_chunk {
                    inputs[i] = None;
                    deferred[i] = true;
                } else {
                    used += n;
                }
            }
            return deferred;
        }
        let decoding = (0..seqs.len()).any(|i| inputs[i].is_some() && !seqs[i].is_prefilling());
        let budget = self
            .prefill_budget
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .rows(decoding, self.opts.prefill_chunk)
            .max(1);
        let mut grant = vec![0usize; seqs.len()];
        let mut left = budget;
        if let (Some(&oldest), true) = (prefilling.first(), prefilling.len() > 1) {
            let g = (budget / 4).max(1).min(rows(inputs, oldest));
            grant[oldest] = g;
            left -= g;
        }
        let mut order = prefilling.clone();
        order.sort_by_key(|&i| (seqs[i].prefill_remaining(), i));
        for &i in &order {
            let g = (rows(inputs, i) - grant[i]).min(left);
            grant[i] += g;
            left -= g;
        }
        for i in prefilling {
            if grant[i] == 0 {
                inputs[i] = None;
                deferred[i] = true;
            } else if grant[i] < rows(inputs, i) {
                inputs[i] = seqs[i].next_input_capped(grant[i]);
            }
        }
        deferred
    }

    /// Record a batched forward of `rows` rows that took `seconds` (`None`: it failed) and tell
    /// the `group`'s draft-length controllers the load it implies. Called before the group
    /// absorbs the forward. A forward that fed a prompt chunk is not recorded: a chunk's rows
    /// are one sequence's consecutive positions, cheaper per row than decode and verify rows of
    /// many sequences (SmolLM2 on two cores: 0.88 ms a prompt row in chunks of 512, 1.06 ms a
    /// row of a 32-stream decode step), and the budget prices decode and verify rows; with
    /// the chunks in the fit its slope came out low, so drafts at 32-64 streams looked cheap.
    fn note_batch(&self, seqs: &mut [&mut Sequence], group: &[usize], rows: usize, seconds: Option<f64>) {
        let prefill = group.iter().any(|&i| seqs[i].is_prefilling());
        if let Some(s) = seconds.filter(|_| prefill) {
            self.prefill_budget
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .observe(rows, s);
        }
        let load = {
            let mut bc = self.batch_cost.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(s) = seconds.filter(|_| !prefill) {
                bc.observe(rows, s);
            }
            bc.load(group.len()).filter(|_| load_aware())
        };
        for &i in group {
            seqs[i].set_load(load);
        }
    }
}

/// Seconds a step with prompt rows may take while other streams decode: their next token waits
/// for the whole step (vLLM's chunked prefill puts decode rows first for the same reason).
pub const PREFILL_STEP_S: f64 = 0.1;

/// The fewest prompt rows a step feeds beside decoding streams.
pub const MIN_PREFILL_ROWS: usize = 16;

/// How many prompt rows a step feeds ([`Engine::step`]): `LoadOptions::prefill_chunk` when no
/// stream is decoding (prefill alone, the fastest it goes); beside decoding streams, as many as
/// fit in [`PREFILL_STEP_S`] at the measured seconds per row of forwards that fed prompt rows
/// (at least [`MIN_PREFILL_ROWS`]; a quarter of the chunk until measured). On two CPU cores a
/// 512-row SmolLM2 chunk takes 0.8-1.4 s: a stream beside a long prefill got one token a
/// second; with the budget, about ten. The long prompt's prefill takes the steps' decode rows
/// longer. Where chunks end changes no bit (batch-invariant forwards).
#[derive(Debug, Clone, Default)]
pub struct PrefillBudget {
    /// Moving average of the seconds per row of forwards that fed prompt rows.
    row_s: Option<f64>,
}

impl PrefillBudget {
    /// A forward of `rows` rows (prompt rows among them) took `seconds`.
    pub fn observe(&mut self, rows: usize, seconds: f64) {
        if rows < MIN_PREFILL_ROWS || !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        let x = seconds / rows as f64;
        self.row_s = Some(self.row_s.map_or(x, |r| 0.5 * r + 0.5 * x));
    }

    /// Prompt rows for the next step, `chunk` being `LoadOptions::prefill_chunk`.
    pub fn rows(&self, decoding: bool, chunk: usize) -> usize {
        if !decoding {
            return chunk;
        }
        let fit = match self.row_s {
            Some(r) => (PREFILL_STEP_S / r) as usize,
            None => chunk / 4,
        };
        fit.clamp(MIN_PREFILL_ROWS.min(chunk), chunk)
    }
}

/// A batched forward failed: every sequence of `group` gets its error.
fn fail_group(results: &mut [Result<Option<StepOutcome>, RequestError>], group: &[usize], e: &anyhow::Error) {
    let msg = format!("{e:#}");
    for &i in group {
        results[i] = Err(RequestError::Internal(msg.clone()));
    }
}

/// `SPECULA_DRAFT_BUDGET=0` turns the batch's draft budget off (every draft a controller chose is
/// verified): a switch for side-by-side measurements only.
fn draft_budget_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPECULA_DRAFT_BUDGET").map_or(true, |v| v != "0"))
}

/// `SPECULA_LOAD_AWARE=0` makes the draft-length controllers ignore the batch (each decides from
/// its own solo timings, as before [`crate::speculative::controller::BatchCost`]): a switch for
/// side-by-side measurements only.
fn load_aware() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPECULA_LOAD_AWARE").map_or(true, |v| v != "0"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_budget_shrinks_beside_decoding_streams() {
        let mut b = PrefillBudget::default();
        assert_eq!(b.rows(false, 512), 512, "prefill alone: the whole chunk");
        assert_eq!(b.rows(true, 512), 128, "a quarter of the chunk until measured");
        b.observe(512, 1.0); // 1.95 ms a row: 51 rows in 0.1 s
        assert_eq!(b.rows(true, 512), 51);
        assert_eq!(b.rows(false, 512), 512);
        b.observe(8, 10.0);
        assert_eq!(b.rows(true, 512), 51, "a forward of few rows says little: ignored");
        for _ in 0..20 {
            b.observe(512, 0.001); // a fast device
        }
        assert_eq!(b.rows(true, 512), 512, "at most the chunk");
        let mut slow = PrefillBudget::default();
        slow.observe(100, 100.0);
        assert_eq!(slow.rows(true, 512), MIN_PREFILL_ROWS, "at least the minimum");
        assert_eq!(slow.rows(true, 8), 8, "never above the chunk");
    }
}
