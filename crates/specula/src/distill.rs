//! `specula distill`: train a native draft head for a model (see
//! `specula_train`).

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use specula_engine::catalog::DEFAULT_MODEL;
use specula_engine::speculative::mtp::HiddenSource;
use specula_train::{self as distill, DistillOptions, Progress};

#[derive(Args, Debug)]
pub struct DistillArgs {
    /// The target: a GGUF file, a bundle directory or a catalog name (pulled if missing).
    #[arg(long, default_value = DEFAULT_MODEL)]
    target: String,
    /// What to train: `mtp` (a multi-token-prediction head, DeepSeek-V3 §2.2) or `block` (a
    /// block drafter, DFlash); or `vocab`: no training, only the draft vocabulary of a draft
    /// model for this target (its training text's token ids ranked by count, written to
    /// OUT/draft_vocab.json for `--draft-vocab`).
    #[arg(long, value_enum, default_value = "mtp")]
    kind: Kind,
    /// Block drafter: tokens per block (it drafts block_size - 1 per pass).
    #[arg(long, default_value_t = 8)]
    block_size: usize,
    /// Block drafter: transformer layers.
    #[arg(long, default_value_t = 1)]
    block_layers: usize,
    /// The target layers whose outputs the head reads, comma-separated, shallow to deep.
    /// Block drafter: default a third, two thirds and the last. MTP head: given, the head reads
    /// fused features (EAGLE-3: these layers' outputs concatenated and projected), e.g.
    /// `2,15,29` for a 30-layer target; default the one hidden state of --hidden-source.
    #[arg(long, value_delimiter = ',')]
    target_layers: Option<Vec<usize>>,
    /// Output directory: the head (config.json + model.safetensors), the training record, and
    /// the data cache and checkpoints that let an interrupted run resume.
    #[arg(long)]
    out: PathBuf,
    /// Text files or directories to train on (repeatable).
    #[arg(long)]
    data: Vec<PathBuf>,
    /// Token sequences made by another distill run (its OUT/data/sequences.json: say, answers
    /// decoded on a GPU), to train on here (repeatable). Their prompts stay context.
    #[arg(long)]
    sequences: Vec<PathBuf>,
    /// Built-in prompts whose greedy answers by the target are generated as training text
    /// (0 = only --data).
    #[arg(long, default_value_t = 400)]
    prompts: usize,
    /// User prompts the target writes for itself (Magpie: sampled from the chat template's
    /// opening of a user turn, at temperature 1, top-p 0.95) and then answers greedily, as more
    /// training text beside --prompts (0 = none).
    #[arg(long, default_value_t = 0)]
    self_prompts: usize,
    /// Most tokens per generated answer.
    #[arg(long, default_value_t = 256)]
    answer_tokens: usize,
    /// Optimizer steps (default: --epochs passes over the training rows).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    steps: Option<u64>,
    #[arg(long, default_value_t = 3.0)]
    epochs: f64,
    /// Windows per step.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Rows per window.
    #[arg(long, default_value_t = 256)]
    seq_len: usize,
    /// Peak learning rate (AdamW; linear warm-up, cosine decay to a tenth).
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    #[arg(long, default_value_t = 50)]
    warmup: usize,
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// Clip the gradient to this global L2 norm (0 = off).
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
    /// Draft vocabulary: the N most frequent tokens of the training text (FR-Spec); 0 = all.
    #[arg(long, default_value_t = 8192)]
    draft_vocab: usize,
    /// Soft-label entries kept per position from the target's distribution.
    #[arg(long, default_value_t = 16)]
    top_k: usize,
    /// Steps between checkpoints.
    #[arg(long, default_value_t = 50)]
    checkpoint_every: usize,
    /// Stop after N steps of this run (a checkpoint is written; run again to resume).
    #[arg(long)]
    stop_after: Option<usize>,
    /// Ignore the data cache and checkpoint in --out and start over.
    #[arg(long)]
    restart: bool,
    /// Start from an existing MTP head (its shapes must fit the target).
    #[arg(long)]
    init: Option<PathBuf>,
    /// MTP heads: chained steps trained per row (1: the first draft only; 2: also the second
    /// draft, fed the head's own output as when drafting).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=2))]
    chain_depth: u64,
    /// Also train on the prompt rows (by default the loss covers the answers only: the head
    /// drafts after generated tokens, never inside a prompt).
    #[arg(long)]
    prompt_loss: bool,
    /// Which target hidden state the head reads.
    #[arg(long, value_enum, default_value = "pre-norm")]
    hidden_source: Source,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where the work runs: cpu, or cuda:N (a build with `--features cuda-train`, docs/gpu.md).
    /// On cuda:N the target's answers are generated on that GPU, the teacher pass reads its
    /// logits and block outputs there (unless --teacher cpu; a post-norm tap runs on the CPU),
    /// and the head trains there on candle's CUDA backend.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Where the teacher pass runs with --device cuda:N: `device` (fast), or `cpu`: the CPU
    /// model's own hidden states and distributions, the bits a head drafting on the CPU reads
    /// (the GPU's bf16 forward differs from them slightly).
    #[arg(long, value_enum, default_value = "device")]
    teacher: TeacherOn,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum TeacherOn {
    Device,
    Cpu,
}

/// The candle device training runs on for `--device` (cpu or cuda:N). Errors: an unknown
/// device name, or cuda:N in a build whose candle has no CUDA backend (`--features cuda-train`).
fn train_device(device: &str) -> Result<candle_core::Device> {
    if device == "cpu" {
        return Ok(candle_core::Device::Cpu);
    }
    let ordinal = crate::cuda_ordinal(device)?;
    if !candle_core::utils::cuda_is_available() {
        bail!(
            "training on {device} needs candle's CUDA backend: build with `cargo build --release --features cuda-train` (docs/gpu.md)"
        );
    }
    candle_core::Device::new_cuda(ordinal).map_err(|e| anyhow::anyhow!("{device}: {e}"))
}

#[derive(clap::ValueEnum, Debug, Clone, Copy)]
enum Kind {
    Mtp,
    Block,
    Vocab,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy)]
enum Source {
    PreNorm,
    PostNorm,
}

pub fn run(a: DistillArgs) -> Result<()> {
    if a.batch == 0 || a.seq_len < 2 {
        bail!("--batch must be at least 1 and --seq-len at least 2");
    }
    // The training device first: a build that cannot train there fails before anything runs.
    let device = train_device(&a.device)?;
    if a.device != "cpu" {
        crate::check_device(&a.device)?;
    }
    let path = crate::pull::resolve_model(&a.target, true)?;
    let mut engine = crate::load(&a.target, None)?;
    // Answers are generated in batches of up to 64 sequences, one KV slot each.
    crate::attach_device(&mut engine, &a.device, Some(&path), 64)?;
    let opts = DistillOptions {
        out: a.out.clone(),
        data: a.data.clone(),
        sequences: a.sequences.clone(),
        prompts: a.prompts,
        self_prompts: a.self_prompts,
        answer_tokens: a.answer_tokens,
        seq_len: a.seq_len,
        batch: a.batch,
        steps: a.steps.map(|n| n as usize),
        epochs: a.epochs,
        lr: a.lr,
        warmup: a.warmup,
        weight_decay: a.weight_decay,
        clip: a.clip,
        draft_vocab: a.draft_vocab,
        top_k: a.top_k,
        held_out: 0.05,
        checkpoint_every: a.checkpoint_every,
        stop_after: a.stop_after,
        restart: a.restart,
        hidden_source: match a.hidden_source {
            Source::PreNorm => HiddenSource::PreNorm,
            Source::PostNorm => HiddenSource::PostNorm,
        },
        chain_depth: a.chain_depth as usize,
        prompt_loss: a.prompt_loss,
        block_size: a.block_size,
        block_layers: a.block_layers,
        target_layers: a.target_layers.clone(),
        teacher_on_cpu: a.teacher == TeacherOn::Cpu,
        seed: a.seed,
        device,
    };
    let mut bar: Option<ProgressBar> = None;
    // Without a terminal (a log file), a line per stage and every 15 s instead of a bar.
    let tty = std::io::stderr().is_terminal();
    let mut last_line = std::time::Instant::now();
    let mut stage_total = 0u64;
    let mut on_progress = |p: Progress| match p {
        Progress::Stage { name, total } if !tty => {
            eprintln!("{name}: {total}");
            stage_total = total;
        }
        Progress::Advance {
            done,
            loss,
            tokens_per_s,
        } if !tty => {
            if last_line.elapsed().as_secs() >= 15 || done == stage_total {
                last_line = std::time::Instant::now();
                eprintln!(
                    "  {done}/{stage_total}{}{}",
                    loss.map_or(String::new(), |l| format!(" loss {l:.4}")),
                    tokens_per_s.map_or(String::new(), |t| format!(" {t:.0} tok/s"))
                );
            }
        }
        Progress::Stage { name, total } => {
            if let Some(b) = bar.take() {
                b.finish();
            }
            let b = ProgressBar::new(total);
            b.set_style(
                ProgressStyle::with_template("{msg:<40} [{bar:30}] {pos}/{len} {prefix} ({elapsed} / ~{eta})")
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
            );
            b.set_message(name);
            bar = Some(b);
        }
        Progress::Advance {
            done,
            loss,
            tokens_per_s,
        } => {
            if let Some(b) = &bar {
                b.set_position(done);
                let mut s = String::new();
                if let Some(l) = loss {
                    s.push_str(&format!("loss {l:.4} "));
                }
                if let Some(t) = tokens_per_s {
                    s.push_str(&format!("{t:.0} tok/s"));
                }
                b.set_prefix(s);
            }
        }
        Progress::Note(n) => match &bar {
            Some(b) => b.println(n),
            None => eprintln!("{n}"),
        },
    };
    let kind = match a.kind {
        Kind::Mtp => distill::HeadKind::Mtp,
        Kind::Block => distill::HeadKind::Block,
        Kind::Vocab => {
            let r = distill::draft_vocab(&mut engine, &opts, &mut on_progress)?;
            if let Some(b) = bar.take() {
                b.finish();
            }
            eprintln!(
                "{} token ids ranked over {} tokens; written to {}",
                r.distinct,
                r.tokens,
                r.path.display()
            );
            eprintln!(
                "use it: specula serve {} --draft-model DRAFT --draft-vocab {}",
                a.target,
                r.path.display()
            );
            println!("{}", serde_json::to_string(&r)?);
            return Ok(());
        }
    };
    let report = distill::run(&mut engine, &path, a.init.as_deref(), kind, &opts, &mut on_progress)?;
    if let Some(b) = bar.take() {
        b.finish();
    }
    if report.finished {
        eprintln!(
            "trained {} steps in {:.0} s: final loss {:.4}, held-out top-1 agreement with the target {} on answers ({} rows), {} on all rows; head written to {}",
            report.steps_done,
            report.seconds,
            report.final_loss,
            report
                .held_out_top1_answers
                .map_or("n/a".to_string(), |a| format!("{a:.3}")),
            report.held_out_answer_rows,
            report
                .held_out_top1
                .map_or("n/a".to_string(), |a| format!("{a:.3}")),
            a.out.display()
        );
        if let Some(d2) = report.held_out_depth2_answers {
            eprintln!(
                "second chained draft: agreement {d2:.3} where the first agreed ({} answer rows)",
                report.held_out_depth2_rows
            );
        }
        eprintln!(
            "use it: specula serve {} --drafter {} --spec {}",
            a.target,
            a.out.display(),
            match a.kind {
                Kind::Mtp => "mtp",
                Kind::Block => "block",
                Kind::Vocab => unreachable!("returned above"),
            }
        );
    } else {
        eprintln!(
            "stopped at step {} of {}; the checkpoint is in {} (run the same command again to resume)",
            report.steps_done,
            report.total_steps,
            a.out.join("checkpoint").display()
        );
    }
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn training_devices_are_checked_before_anything_runs() {
        assert!(matches!(train_device("cpu"), Ok(candle_core::Device::Cpu)));
        let e = format!("{:#}", train_device("tpu:0").expect_err("unknown"));
        assert!(e.contains("unknown device 'tpu:0'"), "{e}");
        if !candle_core::utils::cuda_is_available() {
            let e = format!("{:#}", train_device("cuda:0").expect_err("no CUDA in this build"));
            assert!(e.contains("--features cuda-train"), "{e}");
        }
    }
}
