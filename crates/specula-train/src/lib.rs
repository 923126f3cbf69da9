//! `specula distill`: train a native draft head (an MTP head) for a target, by distillation from
//! the target itself.
//!
//! Pipeline (each stage cached in the output directory, so an interrupted run resumes):
//! 1. **Data** ([`data`]): text the user gives (`--data` files or directories, tokenized and cut
//!    into sequences) and/or the target's own greedy answers to a built-in prompt set (which
//!    shares no prompt with the benchmark set in `tests/fixtures/prompts.jsonl`).
//! 2. **Teacher** ([`teacher`]): one target forward per sequence, keeping the hidden state the head
//!    reads (f16) and the target's next-token distribution at every position (its top entries:
//!    soft labels).
//! 3. **Training** ([`train`]): the head's block is initialised from the target's last block, and
//!    trained with candle autograd on the KL divergence to the target's distribution of
//!    `t_{j+2}` (AdamW, linear warm-up then cosine decay, global-norm gradient clipping,
//!    checkpoints with the optimizer state, resume). The draft LM head is the target's, over a
//!    frequency-ranked subset of the vocabulary (FR-Spec, Zhao et al. 2025), frozen.
//! 4. **Output**: `config.json` (shape, hidden source, the training record: data, steps, final
//!    loss, held-out top-1 agreement) and `model.safetensors` in the DeepSeek-V3 layout, which
//!    [`specula_engine::speculative::mtp::MtpHead::load`] and `specula inspect` read.

pub mod data;
pub mod teacher;
pub mod train;

use std::path::PathBuf;

use specula_engine::speculative::mtp::HiddenSource;

/// What `specula distill` was asked to do.
#[derive(Debug, Clone)]
pub struct DistillOptions {
    /// Output directory (the head, its config, caches and checkpoints).
    pub out: PathBuf,
    /// Text files or directories to train on.
    pub data: Vec<PathBuf>,
    /// Training sequences made by another run (its `data/sequences.json`), e.g. answers decoded
    /// on a GPU ([`data::read_sequences`]).
    pub sequences: Vec<PathBuf>,
    /// Prompts of the built-in set whose greedy answers are generated (0 = none).
    pub prompts: usize,
    /// User prompts the target writes itself (Magpie: sampled from the chat template's opening
    /// of a user turn) and then answers greedily, as more training text (0 = none).
    pub self_prompts: usize,
    /// Most tokens per generated answer.
    pub answer_tokens: usize,
    /// Rows per training window.
    pub seq_len: usize,
    /// Windows per optimizer step.
    pub batch: usize,
    /// Optimizer steps in all (`None`: `epochs` passes over the training windows).
    pub steps: Option<usize>,
    pub epochs: f64,
    /// Peak learning rate, warm-up steps, AdamW weight decay, gradient-norm clip.
    pub lr: f64,
    pub warmup: usize,
    pub weight_decay: f64,
    pub clip: f64,
    /// Tokens in the draft vocabulary (most frequent in the data); 0 = the full vocabulary.
    pub draft_vocab: usize,
    /// Soft-label entries kept per position.
    pub top_k: usize,
    /// Fraction of sequences held out for the final evaluation.
    pub held_out: f64,
    /// Steps between checkpoints.
    pub checkpoint_every: usize,
    /// Stop after this many steps in this run (a checkpoint is written): for tests of resume.
    pub stop_after: Option<usize>,
    /// Ignore an existing checkpoint and start over.
    pub restart: bool,
    pub hidden_source: HiddenSource,
    /// MTP heads: chained steps trained per row (1 = the first draft only; 2 = also the second
    /// draft, fed the head's own output as at drafting time), the second weighted 0.5. Default 1:
    /// on SmolLM2, 2 raised second-draft acceptance but lowered the first's (docs/perf.md).
    pub chain_depth: usize,
    /// Train on the prompt rows too (rows whose input token is in a prompt). Default false:
    /// the head only ever drafts after generated tokens, so the loss covers the answers and
    /// the prompts are context (as EAGLE-style heads mask the loss to the assistant's turns).
    pub prompt_loss: bool,
    /// Block drafters: tokens per block (drafts `block_size - 1` per pass) and drafter layers.
    pub block_size: usize,
    pub block_layers: usize,
    /// The target layers the head reads, shallow to deep. Block drafters: `None` is
    /// [`default_block_taps`]. MTP heads: `Some` trains a fused-feature head (EAGLE-3) on these
    /// layers' outputs; `None` reads the one hidden state of `hidden_source`.
    pub target_layers: Option<Vec<usize>>,
    /// Run the teacher pass on the CPU model even when the engine has a device attached (the
    /// hidden states a head drafting on the CPU reads, bit for bit).
    pub teacher_on_cpu: bool,
    pub seed: u64,
    /// Where training runs (candle autograd): the CPU, or a CUDA GPU in a build with
    /// `--features cuda-train` (`candle_core::Device::new_cuda`). The data and teacher
    /// stages run on the engine's own devices; checkpoints and the head are written from the host.
    pub device: candle_core::Device,
}

impl Default for DistillOptions {
    fn default() -> Self {
        Self {
            out: PathBuf::from("mtp-head"),
            data: Vec::new(),
            sequences: Vec::new(),
            prompts: 400,
            self_prompts: 0,
            answer_tokens: 256,
            seq_len: 256,
            batch: 4,
            steps: None,
            epochs: 3.0,
            lr: 1e-3,
            warmup: 50,
            weight_decay: 0.01,
            clip: 1.0,
            draft_vocab: 8192,
            top_k: 16,
            held_out: 0.05,
            checkpoint_every: 50,
            stop_after: None,
            restart: false,
            hidden_source: HiddenSource::PreNorm,
            chain_depth: 1,
            prompt_loss: false,
            block_size: 8,
            block_layers: 1,
            target_layers: None,
            teacher_on_cpu: false,
            seed: 0,
            device: candle_core::Device::Cpu,
        }
    }
}

/// Progress events for the caller's display (the CLI draws them with a progress bar).
#[derive(Debug, Clone)]
pub enum Progress {
    /// A stage starts: its name and how many units it has (sequences, steps).
    Stage { name: &'static str, total: u64 },
    /// Units done in the current stage, with the training loss and tokens/s when training.
    Advance {
        done: u64,
        loss: Option<f64>,
        tokens_per_s: Option<f64>,
    },
    /// A line worth printing.
    Note(String),
}

/// Which head `specula distill` trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadKind {
    Mtp,
    Block,
}

/// Everything `specula distill` does for an MTP head: data, teacher pass, training, output.
/// See [`run`].
pub fn run_mtp(
    engine: &mut specula_engine::Engine,
    model_path: &std::path::Path,
    init: Option<&std::path::Path>,
    opts: &DistillOptions,
    progress: &mut dyn FnMut(Progress),
) -> anyhow::Result<train::TrainReport> {
    run(engine, model_path, init, HeadKind::Mtp, opts, progress)
}

/// What [`draft_vocab`] measured and wrote.
#[derive(Debug, Clone, serde::Serialize)]
pub struct VocabReport {
    /// The file written (`draft_vocab.json` in the output directory).
    pub path: PathBuf,
    /// Tokens counted, and how many distinct token ids occurred.
    pub tokens: usize,
    pub distinct: usize,
}

/// The draft vocabulary of a draft model for this target (FR-Spec, Zhao et al. 2025): the
/// target's training text of `opts` (its greedy answers to the built-in prompts and/or `--data`
/// files, [`data::sequences`]) tokenized, and every token id that occurs ranked by count (ties
/// by id). Written to `opts.out/draft_vocab.json` as `{"model", "sources", "tokens",
/// "ranked_ids"}`; `--draft-vocab FILE` on `serve` / `generate` reads it
/// ([`specula_engine::speculative::draft_model::draft_vocab_ids`]).
pub fn draft_vocab(
    engine: &mut specula_engine::Engine,
    opts: &DistillOptions,
    progress: &mut dyn FnMut(Progress),
) -> anyhow::Result<VocabReport> {
    std::fs::create_dir_all(&opts.out)?;
    let seqs = data::sequences(engine, opts, progress)?;
    let vocab = engine.config().vocab_size;
    let mut count = vec![0u64; vocab];
    let mut tokens = 0;
    for &t in seqs.sequences.iter().flatten() {
        if let Some(c) = count.get_mut(t as usize) {
            *c += 1;
            tokens += 1;
        }
    }
    let mut ranked: Vec<u32> = (0..vocab as u32).filter(|&t| count[t as usize] > 0).collect();
    ranked.sort_by(|&a, &b| count[b as usize].cmp(&count[a as usize]).then(a.cmp(&b)));
    let path = opts.out.join("draft_vocab.json");
    let doc = serde_json::json!({
        "model": engine.model_id(),
        "sources": seqs.sources,
        "tokens": tokens,
        "ranked_ids": ranked,
    });
    std::fs::write(&path, serde_json::to_string(&doc)?)?;
    Ok(VocabReport {
        path,
        tokens,
        distinct: ranked.len(),
    })
}

/// The target layers a block drafter reads by default: three, spread from a third of the depth
/// to the last block.
pub fn default_block_taps(num_layers: usize) -> Vec<usize> {
    let mut v = vec![num_layers / 3, 2 * num_layers / 3, num_layers - 1];
    v.dedup();
    v
}

/// Everything `specula distill` does: data, teacher pass, training, output, for a head of
/// `kind`. `model_path`: the target's GGUF file or bundle directory (for the initial block);
/// `init`: an existing head to continue from. Errors before any training step when a head or
/// checkpoint does not fit the target (the message names the file and the tensor).
pub fn run(
    engine: &mut specula_engine::Engine,
    model_path: &std::path::Path,
    init: Option<&std::path::Path>,
    kind: HeadKind,
    opts: &DistillOptions,
    progress: &mut dyn FnMut(Progress),
) -> anyhow::Result<train::TrainReport> {
    let layers = engine.config().num_layers;
    let (spec, taps) = match kind {
        HeadKind::Mtp => {
            // A head to start from must fit before anything expensive runs.
            if let Some(p) = init {
                let head = specula_engine::speculative::mtp::MtpHead::load(p, engine.model())?;
                // A fused head continues on the layers it was trained on.
                if let (Some(ids), Some(want)) = (&head.config.target_layer_ids, &opts.target_layers) {
                    if ids != want {
                        anyhow::bail!(
                            "{}: the head reads target layers {ids:?}, not --target-layers {want:?}",
                            p.display()
                        );
                    }
                }
            }
            match &opts.target_layers {
                Some(fused) => {
                    check_layers(fused, layers)?;
                    let spec = train::HeadSpec::Mtp {
                        fused: Some(fused.clone()),
                    };
                    (spec, fused.clone())
                }
                None => (
                    train::HeadSpec::Mtp { fused: None },
                    vec![opts.hidden_source.tap(layers)],
                ),
            }
        }
        HeadKind::Block => {
            let taps = opts.target_layers.clone().unwrap_or_else(|| default_block_taps(layers));
            check_layers(&taps, layers)?;
            if opts.block_size < 2 {
                anyhow::bail!("--block-size must be at least 2");
            }
            let spec = train::HeadSpec::Block {
                block_size: opts.block_size,
                taps: taps.clone(),
                layers: opts.block_layers.max(1),
                mask_token: mask_token(engine),
            };
            if let Some(p) = init {
                specula_engine::speculative::block::BlockDrafterModel::load(p, engine.model())?;
            }
            (spec, taps)
        }
    };
    std::fs::create_dir_all(&opts.out)?;
    let seqs = data::sequences(engine, opts, progress)?;
    let teacher = teacher::teacher(
        engine,
        &seqs,
        &taps,
        !opts.teacher_on_cpu,
        opts.top_k.max(1),
        &opts.out.join("data"),
        progress,
    )?;
    let eos = engine.eos_ids().to_vec();
    let report = train::train(engine.model(), &eos, model_path, init, &spec, &teacher, opts, progress)?;
    if report.finished {
        let rec = opts.out.join("training.json");
        std::fs::write(
            &rec,
            serde_json::to_string_pretty(&serde_json::json!({
                "report": report,
                "data": seqs.sources,
                "positions": teacher.positions(),
            }))?,
        )?;
    }
    Ok(report)
}

/// `--target-layers`: at least one layer, each inside the target, shallow to deep, no repeats.
fn check_layers(taps: &[usize], layers: usize) -> anyhow::Result<()> {
    if taps.is_empty() {
        anyhow::bail!("--target-layers is empty");
    }
    if let Some(&bad) = taps.iter().find(|&&t| t >= layers) {
        anyhow::bail!("--target-layers names layer {bad}, but the target has layers 0..{layers}");
    }
    if taps.windows(2).any(|w| w[0] >= w[1]) {
        anyhow::bail!("--target-layers must go from shallow to deep without repeats: {taps:?}");
    }
    Ok(())
}

/// The block drafter's mask token: a special token the chat format does not use (the first
/// control token that is neither an end-of-generation id nor in the chat template's markers),
/// else the last id of the vocabulary.
fn mask_token(engine: &specula_engine::Engine) -> u32 {
    let tok = engine.tokenizer();
    let eos = engine.eos_ids();
    let v = engine.config().vocab_size as u32;
    let chat_markers = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"];
    (0..v.min(512))
        .find(|&id| {
            let text = tok.token_text(id);
            !eos.contains(&id)
                && text.starts_with('<')
                && text.ends_with('>')
                && text.len() > 2
                && !chat_markers.contains(&text.as_str())
        })
        .unwrap_or(v - 1)
}
