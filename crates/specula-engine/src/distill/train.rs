//! Training an MTP head on the teacher's outputs (candle autograd).
//!
//! Row `j` of a sequence feeds the head `h_j` (the target's tapped hidden state after `t_j`) and
//! `t_{j+1}`; the label is the target's distribution of `t_{j+2}` (its soft labels after
//! `t_{j+1}`), restricted to the draft vocabulary. Loss: cross-entropy of the head's draft
//! distribution against those probabilities (the KL divergence up to the target's entropy),
//! averaged over rows. Optimizer: AdamW (Loshchilov & Hutter 2019) with decoupled weight decay on
//! matrices, linear warm-up then cosine decay to a tenth of the peak rate, and the gradient
//! clipped to a global L2 norm. Checkpoints hold the weights and both Adam moments, so a resumed
//! run continues exactly where it stopped.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var, D};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::teacher::Teacher;
use super::{DistillOptions, Progress};
use crate::model::Model;
use crate::spec::block::{BlockConfig, BlockWeights};
use crate::spec::head::AttnMask;
use crate::spec::head::{rms_norm, BlockShape, DraftVocab, NamedTensors};
use crate::spec::mtp::{MtpConfig, MtpWeights};

/// What a finished (or stopped) training run reports.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainReport {
    pub steps_done: usize,
    pub total_steps: usize,
    pub final_loss: f64,
    /// Held-out rows where the head's argmax is the target's argmax (greedy depth-1 acceptance
    /// on teacher-forced text).
    pub held_out_top1: Option<f64>,
    pub held_out_rows: usize,
    pub train_rows: usize,
    pub seconds: f64,
    pub finished: bool,
}

/// One training window: rows `start .. start + len` (global teacher positions).
#[derive(Debug, Clone, Copy)]
struct Window {
    start: usize,
    len: usize,
}

/// Windows of `seq_len` rows over the given sequences (row j needs positions j + 1 and j + 2 of
/// its sequence... its label is the distribution after t_{j+1}).
fn windows(t: &Teacher, seqs: &[usize], seq_len: usize) -> Vec<Window> {
    let mut w = Vec::new();
    for &s in seqs {
        let (a, b) = (t.offsets[s], t.offsets[s + 1]);
        if b < a + 2 {
            continue;
        }
        let rows = b - a - 1; // rows j = 0 .. n - 2
        let mut j = 0;
        while j < rows {
            let len = seq_len.min(rows - j);
            w.push(Window { start: a + j, len });
            j += len;
        }
    }
    w
}

/// The draft vocabulary: the `n` most frequent tokens of the training text (ties by id),
/// always with the end-of-generation ids; `None` for the full vocabulary.
pub fn draft_vocab(t: &Teacher, n: usize, vocab: usize, eos: &[u32]) -> Option<Vec<u32>> {
    if n == 0 || n >= vocab {
        return None;
    }
    let mut count = vec![0u64; vocab];
    for &tok in &t.tokens {
        if (tok as usize) < vocab {
            count[tok as usize] += 1;
        }
    }
    for &e in eos {
        if (e as usize) < vocab {
            count[e as usize] = u64::MAX;
        }
    }
    let mut ids: Vec<u32> = (0..vocab as u32).collect();
    ids.sort_by(|&a, &b| count[b as usize].cmp(&count[a as usize]).then(a.cmp(&b)));
    ids.truncate(n);
    ids.sort_unstable();
    Some(ids)
}

/// Normal(0, std) values from a seeded stream (Box-Muller).
fn normal(rng: &mut ChaCha8Rng, n: usize, std: f32) -> Vec<f32> {
    use rand::Rng;
    (0..n)
        .map(|_| {
            let u1: f64 = rng.gen::<f64>().max(1e-12);
            let u2: f64 = rng.gen::<f64>();
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32 * std
        })
        .collect()
}

/// The weights of the target's blocks `layers`, dense f32, named relative to the layer as in HF
/// checkpoints (`self_attn.q_proj.weight`, ...): from the GGUF file, or from a bundle directory's
/// safetensors (read once for all the layers).
fn target_blocks(model_path: &Path, layers: std::ops::Range<usize>) -> Result<Vec<Vec<(String, Tensor)>>> {
    if !model_path.is_dir() {
        return layers
            .map(|l| crate::bundle::gguf::dense_block(model_path, l))
            .collect();
    }
    let t = NamedTensors::read(model_path)?;
    Ok(layers
        .map(|l| {
            let p = format!("model.layers.{l}.");
            t.map
                .iter()
                .filter_map(|(k, v)| k.strip_prefix(&p).map(|r| (r.to_string(), v.clone())))
                .collect()
        })
        .collect())
}

/// Initial weights of a head for `target` (DeepSeek-V3 names under `prefix`): the block copied
/// from the target's last block (read from `model_path`), both input norms at one, `eh_proj`
/// passing the hidden state through (identity) plus a small random embedding part, the final
/// norm the target's.
pub fn initial_weights(target: &Model, model_path: &Path, prefix: &str, seed: u64) -> Result<HashMap<String, Tensor>> {
    let c = target.config();
    let h = c.hidden_size;
    let last = c.num_layers - 1;
    let block = target_blocks(model_path, last..last + 1)?.pop().unwrap_or_default();
    let dev = Device::Cpu;
    let mut m: HashMap<String, Tensor> = block
        .into_iter()
        .map(|(k, v)| Ok((format!("{prefix}{k}"), v.to_dtype(DType::F32)?)))
        .collect::<Result<_>>()?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let emb_part = Tensor::from_vec(normal(&mut rng, h * h, 0.02), (h, h), &dev)?;
    let eye = Tensor::eye(h, DType::F32, &dev)?;
    m.insert(format!("{prefix}eh_proj.weight"), Tensor::cat(&[&emb_part, &eye], 1)?);
    m.insert(format!("{prefix}enorm.weight"), Tensor::ones(h, DType::F32, &dev)?);
    m.insert(format!("{prefix}hnorm.weight"), Tensor::ones(h, DType::F32, &dev)?);
    m.insert(
        format!("{prefix}shared_head.norm.weight"),
        target.output_norm.to_dtype(DType::F32)?,
    );
    Ok(m)
}

/// AdamW state for one parameter.
struct Param {
    name: String,
    var: Var,
    m: Tensor,
    v: Tensor,
    decay: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct CheckpointMeta {
    step: usize,
    /// Options and data that must match for a resume.
    key: serde_json::Value,
    loss_history: Vec<(usize, f64)>,
}

fn checkpoint_dir(out: &Path) -> PathBuf {
    out.join("checkpoint")
}

fn save_checkpoint(out: &Path, params: &[Param], vocab: Option<&[u32]>, meta: &CheckpointMeta) -> Result<()> {
    let dir = checkpoint_dir(out);
    std::fs::create_dir_all(&dir)?;
    let mut map: HashMap<String, Tensor> = HashMap::new();
    for p in params {
        map.insert(p.name.clone(), p.var.as_tensor().clone());
        map.insert(format!("adam_m.{}", p.name), p.m.clone());
        map.insert(format!("adam_v.{}", p.name), p.v.clone());
    }
    if let Some(ids) = vocab {
        map.insert("draft_vocab".into(), DraftVocab::ids_tensor(ids)?);
    }
    let tmp = dir.join("state.safetensors.tmp");
    candle_core::safetensors::save(&map, &tmp)?;
    std::fs::rename(&tmp, dir.join("state.safetensors"))?;
    let tmp = dir.join("state.json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(meta)?)?;
    std::fs::rename(&tmp, dir.join("state.json"))?;
    Ok(())
}

/// The layer prefix the head's tensors use (DeepSeek-V3: after the trunk's layers).
pub fn layer_prefix(target: &Model) -> String {
    format!("model.layers.{}.", target.config().num_layers)
}

/// What kind of head to train.
#[derive(Debug, Clone, PartialEq)]
pub enum HeadSpec {
    /// An MTP head ([`crate::spec::mtp`]).
    Mtp,
    /// A block drafter ([`crate::spec::block`]) of `layers` layers drafting `block_size - 1`
    /// tokens per pass from the target taps `taps`, with `mask_token` filling the block.
    Block {
        block_size: usize,
        taps: Vec<usize>,
        layers: usize,
        mask_token: u32,
    },
}

/// The head being trained (its tensors are the optimizer's variables).
enum Built {
    Mtp(Box<MtpWeights>),
    Block(BlockWeights),
}

impl HeadSpec {
    /// The prefix of the head's tensor names.
    fn prefix(&self, target: &Model) -> String {
        match self {
            HeadSpec::Mtp => layer_prefix(target),
            HeadSpec::Block { .. } => String::new(),
        }
    }

    /// Build the head from named tensors; errors name the tensor and the shapes.
    fn build(&self, t: &NamedTensors, target: &Model) -> Result<Built> {
        let shape = BlockShape::of_target(target);
        Ok(match self {
            HeadSpec::Mtp => Built::Mtp(Box::new(MtpWeights::from_named(t, &self.prefix(target), &shape)?)),
            HeadSpec::Block { taps, layers, .. } => Built::Block(BlockWeights::from_named(
                t,
                "",
                &shape,
                taps.len(),
                target.config().hidden_size,
                *layers,
            )?),
        })
    }
}

/// Train a head of kind `spec` on `teacher` and write it to `opts.out`. `model_path`: the
/// target's file or directory (the head's block starts from its last block). `init`: start from
/// an existing head instead (its shapes must fit the target).
#[allow(clippy::too_many_arguments)]
pub fn train(
    target: &Model,
    eos: &[u32],
    model_path: &Path,
    init: Option<&Path>,
    spec: &HeadSpec,
    teacher: &Teacher,
    opts: &DistillOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<TrainReport> {
    let dev = Device::Cpu;
    let c = target.config();
    let h = c.hidden_size;
    if teacher.hidden_size != h {
        bail!(
            "the teacher data has hidden size {}, the target {h} (delete {})",
            teacher.hidden_size,
            opts.out.join("data").display()
        );
    }
    let shape = BlockShape::of_target(target);
    let prefix = spec.prefix(target);
    // Train / held-out split by sequence (every n-th sequence held out).
    let n_seq = teacher.sequences();
    let every = if opts.held_out > 0.0 {
        ((1.0 / opts.held_out).round() as usize).max(2)
    } else {
        usize::MAX
    };
    // Held out by a hash of the index, not a stride (the built-in prompts cycle through tasks).
    let (held, train_seqs): (Vec<usize>, Vec<usize>) = (0..n_seq).partition(|&s| {
        n_seq > 1 && (((s as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as usize).is_multiple_of(every)
    });
    let train_w = windows(teacher, &train_seqs, opts.seq_len.max(2));
    let held_w = windows(teacher, &held, opts.seq_len.max(2));
    if train_w.is_empty() {
        bail!("no training rows: the sequences are too short");
    }
    let batch = opts.batch.max(1);
    let total_steps = opts
        .steps
        .unwrap_or_else(|| ((opts.epochs * train_w.len() as f64) / batch as f64).ceil() as usize)
        .max(1);
    let vocab_ids = draft_vocab(teacher, opts.draft_vocab, c.vocab_size, eos);
    let key = serde_json::json!({
        "positions": teacher.positions(),
        "taps": teacher.taps,
        "total_steps": total_steps,
        "batch": batch,
        "seq_len": opts.seq_len,
        "lr": opts.lr,
        "warmup": opts.warmup,
        "weight_decay": opts.weight_decay,
        "clip": opts.clip,
        "draft_vocab": opts.draft_vocab,
        "seed": opts.seed,
        "hidden_size": h,
        "vocab_size": c.vocab_size,
        "head": format!("{spec:?}"),
        "chain_depth": opts.chain_depth,
    });
    // Weights: a checkpoint (resume), an initial head, or the target's last block.
    let ck = checkpoint_dir(&opts.out);
    let mut step = 0;
    let mut loss_history = Vec::new();
    let mut moments: Option<NamedTensors> = None;
    let weights: HashMap<String, Tensor> = if ck.join("state.json").exists() && !opts.restart {
        let meta: CheckpointMeta = serde_json::from_str(&std::fs::read_to_string(ck.join("state.json"))?)
            .with_context(|| format!("{}", ck.join("state.json").display()))?;
        if meta.key != key {
            bail!(
                "{} holds a checkpoint of a different training run ({} vs {}); pass --restart to start over",
                ck.display(),
                meta.key,
                key
            );
        }
        let t = NamedTensors::read(&ck.join("state.safetensors"))?;
        // Shapes are checked against the target before any step.
        spec.build(&t, target)?;
        step = meta.step;
        loss_history = meta.loss_history;
        progress(Progress::Note(format!(
            "resuming from the checkpoint at step {step} of {total_steps}"
        )));
        let w = t
            .map
            .iter()
            .filter(|(k, _)| !k.starts_with("adam_") && k.as_str() != "draft_vocab")
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        moments = Some(t);
        w
    } else if let (Some(p), HeadSpec::Block { .. }) = (init, spec) {
        let t = NamedTensors::read(p)?;
        let strip = if t.map.contains_key("model.fc.weight") {
            "model."
        } else {
            ""
        };
        let w: HashMap<String, Tensor> = t
            .map
            .iter()
            .filter_map(|(k, v)| k.strip_prefix(strip).map(|r| (r.to_string(), v.clone())))
            .filter(|(k, _)| k != "draft_vocab")
            .collect();
        spec.build(
            &NamedTensors {
                file: t.file.clone(),
                map: w.clone(),
            },
            target,
        )?;
        w
    } else if let Some(p) = init {
        let t = NamedTensors::read(p)?;
        let layer = t
            .map
            .keys()
            .filter_map(|k| {
                let (n, rest) = k.strip_prefix("model.layers.")?.split_once('.')?;
                (rest == "eh_proj.weight").then(|| n.parse::<usize>().ok()).flatten()
            })
            .min()
            .with_context(|| format!("{}: not an MTP head in the DeepSeek-V3 layout", t.file))?;
        let from = format!("model.layers.{layer}.");
        MtpWeights::from_named(&t, &from, &shape)?;
        t.map
            .iter()
            .filter_map(|(k, v)| k.strip_prefix(&from).map(|r| (format!("{prefix}{r}"), v.clone())))
            .collect()
    } else {
        match spec {
            HeadSpec::Mtp => initial_weights(target, model_path, &prefix, opts.seed)?,
            HeadSpec::Block { taps, layers, .. } => {
                initial_block_weights(target, model_path, taps.len(), *layers, opts.seed)?
            }
        }
    };
    // Check every shape against the target before training.
    spec.build(
        &NamedTensors {
            file: "initial weights".into(),
            map: weights.clone(),
        },
        target,
    )?;
    let mut names: Vec<String> = weights.keys().cloned().collect();
    names.sort();
    let mut params = Vec::with_capacity(names.len());
    let mut var_map = HashMap::new();
    for name in names {
        let t = weights[&name].to_dtype(DType::F32)?.contiguous()?;
        let (m, v) = match &moments {
            Some(ck) => (
                ck.get(&format!("adam_m.{name}"), t.dims(), "an Adam moment")?,
                ck.get(&format!("adam_v.{name}"), t.dims(), "an Adam moment")?,
            ),
            None => (t.zeros_like()?, t.zeros_like()?),
        };
        let var = Var::from_tensor(&t)?;
        var_map.insert(name.clone(), var.as_tensor().clone());
        params.push(Param {
            decay: t.rank() >= 2,
            name,
            var,
            m,
            v,
        });
    }
    let head = spec.build(
        &NamedTensors {
            file: "training".into(),
            map: var_map,
        },
        target,
    )?;
    let vocab = DraftVocab::from_target(target, vocab_ids.clone())?;
    let vrows = vocab.rows.dim(0)?;
    // Full id → draft row.
    let mut to_row = vec![u32::MAX; c.vocab_size];
    for i in 0..vrows {
        to_row[vocab.token(i) as usize] = i as u32;
    }
    // The window order of every step: a fresh permutation per epoch.
    // Windows of similar length share a batch (less padding): each epoch shuffles, sorts runs of
    // 16 batches by length, and shuffles the batches.
    let mut order: Vec<usize> = Vec::with_capacity(total_steps * batch + train_w.len());
    let mut epoch = 0u64;
    while order.len() < total_steps * batch {
        let mut rng = ChaCha8Rng::seed_from_u64(opts.seed ^ epoch.wrapping_mul(0x9E37_79B9));
        let mut perm: Vec<usize> = (0..train_w.len()).collect();
        perm.shuffle(&mut rng);
        for run in perm.chunks_mut(16 * batch) {
            run.sort_by_key(|&i| train_w[i].len);
        }
        let mut batches: Vec<&[usize]> = perm.chunks(batch).collect();
        batches.shuffle(&mut rng);
        for b in batches {
            order.extend_from_slice(b);
            // A short last batch is topped up so every step has `batch` windows.
            for j in b.len()..batch {
                order.push(perm[j % perm.len()]);
            }
        }
        epoch += 1;
    }
    progress(Progress::Stage {
        name: "training",
        total: total_steps as u64,
    });
    progress(Progress::Advance {
        done: step as u64,
        loss: None,
        tokens_per_s: None,
    });
    let started = std::time::Instant::now();
    let mut rows_done = 0usize;
    let mut last_loss = loss_history.last().map(|&(_, l)| l).unwrap_or(f64::NAN);
    let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8f64);
    let stop_at = opts
        .stop_after
        .map(|n| (step + n).min(total_steps))
        .unwrap_or(total_steps);
    let embedding = &target.embedding;
    while step < stop_at {
        let ws: Vec<Window> = order[step * batch..(step + 1) * batch]
            .iter()
            .map(|&i| train_w[i])
            .collect();
        let (loss, rows) = match (&head, spec) {
            (Built::Mtp(head), _) => {
                let (emb, hid, labels, n_rows) = batch_tensors(teacher, &ws, opts.seq_len, embedding, &to_row, vrows)?;
                let (out, k1, v1) = head.forward(&emb, &hid, 0, None)?;
                let logits = vocab.logits(&rms_norm(&out, &head.norm, shape.rms_norm_eps)?)?;
                let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
                let mut loss = ((labels * logp)?.sum_all()? * (-1.0 / n_rows.max(1) as f64))?;
                let mut rows = n_rows;
                if opts.chain_depth >= 2 {
                    // The second draft: row j is fed the head's own output h'_j and t_{j+2} at
                    // position j + 1, and sees the first step's rows up to j and itself, as a
                    // chained step sees the committed rows and itself when drafting.
                    let tl = emb.dim(1)?;
                    let (emb2, labels2, n2) = chain_tensors(teacher, &ws, tl, embedding, &to_row, vrows)?;
                    let mut bias = vec![-1e9f32; tl * 2 * tl];
                    for i in 0..tl {
                        for j in 0..=i {
                            bias[i * 2 * tl + j] = 0.0;
                        }
                        bias[i * 2 * tl + tl + i] = 0.0;
                    }
                    let bias = Tensor::from_vec(bias, (tl, 2 * tl), &dev)?;
                    let positions: Vec<usize> = (1..=tl).collect();
                    let (out2, _, _) =
                        head.forward_masked(&emb2, &out, &positions, Some((&k1, &v1)), &AttnMask::Bias(bias))?;
                    let logits2 = vocab.logits(&rms_norm(&out2, &head.norm, shape.rms_norm_eps)?)?;
                    let logp2 = candle_nn::ops::log_softmax(&logits2, D::Minus1)?;
                    let loss2 = ((labels2 * logp2)?.sum_all()? * (-0.5 / n2.max(1) as f64))?;
                    loss = (loss + loss2)?;
                    rows += n2;
                }
                (loss, rows)
            }
            (
                Built::Block(bw),
                HeadSpec::Block {
                    block_size, mask_token, ..
                },
            ) => {
                let anchor0 = 1 + (step * 7919 + opts.seed as usize) % (*block_size / 2).max(1);
                let bb = block_batch(
                    teacher,
                    &ws,
                    opts.seq_len,
                    *block_size,
                    anchor0,
                    *mask_token,
                    embedding,
                    &to_row,
                    vrows,
                )?;
                let logp = block_logp(bw, &vocab, &bb)?;
                let loss = ((bb.labels * logp)?.sum_all()? * (-1.0 / bb.rows.max(1) as f64))?;
                (loss, bb.rows)
            }
            _ => bail!("internal: head and spec disagree"),
        };
        let grads = loss.backward()?;
        // Global-norm clipping.
        let mut sq = 0f64;
        for p in &params {
            if let Some(g) = grads.get(p.var.as_tensor()) {
                sq += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
            }
        }
        let norm = sq.sqrt();
        let scale = if opts.clip > 0.0 && norm > opts.clip {
            opts.clip / norm
        } else {
            1.0
        };
        let lr = lr_at(step, total_steps, opts.lr, opts.warmup);
        let t = (step + 1) as i32;
        let (c1, c2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        for p in params.iter_mut() {
            let Some(g) = grads.get(p.var.as_tensor()) else {
                continue;
            };
            let g = (g * scale)?;
            p.m = ((&p.m * b1)? + (&g * (1.0 - b1))?)?;
            p.v = ((&p.v * b2)? + (g.sqr()? * (1.0 - b2))?)?;
            let update = ((&p.m / c1)? / ((&p.v / c2)?.sqrt()? + eps)?)?;
            let w = p.var.as_tensor();
            let w = if p.decay {
                (w * (1.0 - lr * opts.weight_decay))?
            } else {
                w.clone()
            };
            p.var.set(&(w - (update * lr)?)?)?;
        }
        last_loss = loss.to_scalar::<f32>()? as f64;
        step += 1;
        rows_done += rows;
        if step % 10 == 0 || step == stop_at {
            loss_history.push((step, last_loss));
        }
        progress(Progress::Advance {
            done: step as u64,
            loss: Some(last_loss),
            tokens_per_s: Some(rows_done as f64 / started.elapsed().as_secs_f64().max(1e-9)),
        });
        if step % opts.checkpoint_every.max(1) == 0 || step == stop_at {
            let meta = CheckpointMeta {
                step,
                key: key.clone(),
                loss_history: loss_history.clone(),
            };
            save_checkpoint(&opts.out, &params, vocab_ids.as_deref(), &meta)?;
        }
    }
    let finished = step >= total_steps;
    let (held_out_top1, held_rows) = match (&head, spec) {
        (Built::Mtp(head), _) if finished => {
            evaluate(teacher, &held_w, opts.seq_len, head, &vocab, &to_row, embedding, &shape)?
        }
        (
            Built::Block(bw),
            HeadSpec::Block {
                block_size, mask_token, ..
            },
        ) if finished => evaluate_block(
            teacher,
            &held_w,
            opts.seq_len,
            *block_size,
            *mask_token,
            bw,
            &vocab,
            &to_row,
            embedding,
        )?,
        _ => (None, 0),
    };
    let report = TrainReport {
        steps_done: step,
        total_steps,
        final_loss: last_loss,
        held_out_top1,
        held_out_rows: held_rows,
        train_rows: train_w.iter().map(|w| w.len).sum(),
        seconds: started.elapsed().as_secs_f64(),
        finished,
    };
    if finished {
        match (&head, spec) {
            (Built::Mtp(head), _) => write_head(
                &opts.out,
                target,
                head,
                vocab_ids.as_deref(),
                opts,
                &report,
                &loss_history,
            )?,
            (Built::Block(bw), _) => write_block(
                &opts.out,
                target,
                bw,
                spec,
                vocab_ids.as_deref(),
                opts,
                &report,
                &loss_history,
            )?,
        }
    }
    Ok(report)
}

/// Linear warm-up to `peak` over `warmup` steps, then cosine decay to `peak / 10`.
pub fn lr_at(step: usize, total: usize, peak: f64, warmup: usize) -> f64 {
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let span = total.saturating_sub(warmup).max(1) as f64;
    let x = ((step - warmup) as f64 / span).min(1.0);
    let floor = peak / 10.0;
    floor + (peak - floor) * 0.5 * (1.0 + (std::f64::consts::PI * x).cos())
}

/// The inputs of a batch of windows, padded to `seq_len` rows: embeddings of `t_{j+1}`
/// `[b, T, h]`, hidden states `h_j` `[b, T, h]`, label probabilities `[b, T, draft rows]`
/// (zero on padding rows), and the number of real rows.
fn batch_tensors(
    t: &Teacher,
    ws: &[Window],
    seq_len: usize,
    embedding: &crate::model::Embedding,
    to_row: &[u32],
    vrows: usize,
) -> Result<(Tensor, Tensor, Tensor, usize)> {
    let dev = Device::Cpu;
    let longest = ws.iter().map(|w| w.len).max().unwrap_or(1);
    let (b, tl, h) = (ws.len(), longest.min(seq_len.max(1)), t.width());
    let mut ids = vec![0u32; b * tl];
    let mut hid = vec![0f32; b * tl * h];
    let mut lab = vec![0f32; b * tl * vrows];
    let mut n = 0;
    for (wi, w) in ws.iter().enumerate() {
        for r in 0..w.len {
            let g = w.start + r; // position j (global)
            let row = wi * tl + r;
            ids[row] = t.tokens[g + 1];
            for (dst, src) in hid[row * h..(row + 1) * h]
                .iter_mut()
                .zip(&t.hidden[g * h..(g + 1) * h])
            {
                *dst = src.to_f32();
            }
            // The distribution of t_{j+2}: the teacher's row after t_{j+1}.
            add_label(t, g + 1, to_row, &mut lab[row * vrows..(row + 1) * vrows]);
            n += 1;
        }
    }
    let emb = embedding.forward(&ids, &dev)?.reshape((b, tl, t.hidden_size))?;
    Ok((
        emb,
        Tensor::from_vec(hid, (b, tl, h), &dev)?,
        Tensor::from_vec(lab, (b, tl, vrows), &dev)?,
        n,
    ))
}

/// Add the teacher's soft labels after position `l` (its top entries inside the draft
/// vocabulary) to `out` (one row over the draft vocabulary).
fn add_label(t: &Teacher, l: usize, to_row: &[u32], out: &mut [f32]) {
    let k = t.top_k;
    for i in 0..k {
        let id = t.label_ids[l * k + i] as usize;
        let p = t.label_p[l * k + i].to_f32();
        let dr = to_row.get(id).copied().unwrap_or(u32::MAX);
        if dr != u32::MAX && p > 0.0 {
            out[dr as usize] += p;
        }
    }
}

/// The second chained step of a batch of windows (`tl` rows each): embeddings of `t_{j+2}`
/// `[b, tl, h]`, the labels after `t_{j+2}` `[b, tl, draft rows]` (zero where the window has no
/// `t_{j+3}`), and the number of labelled rows.
fn chain_tensors(
    t: &Teacher,
    ws: &[Window],
    tl: usize,
    embedding: &crate::model::Embedding,
    to_row: &[u32],
    vrows: usize,
) -> Result<(Tensor, Tensor, usize)> {
    let dev = Device::Cpu;
    let b = ws.len();
    let mut ids = vec![0u32; b * tl];
    let mut lab = vec![0f32; b * tl * vrows];
    let mut n = 0;
    for (wi, w) in ws.iter().enumerate() {
        for r in 0..w.len.min(tl).saturating_sub(1) {
            let g = w.start + r;
            let row = wi * tl + r;
            ids[row] = t.tokens[g + 2];
            add_label(t, g + 2, to_row, &mut lab[row * vrows..(row + 1) * vrows]);
            n += 1;
        }
    }
    Ok((
        embedding.forward(&ids, &dev)?.reshape((b, tl, t.hidden_size))?,
        Tensor::from_vec(lab, (b, tl, vrows), &dev)?,
        n,
    ))
}

/// Top-1 agreement of the head with the teacher on `ws` (padding rows excluded).
#[allow(clippy::too_many_arguments)]
fn evaluate(
    t: &Teacher,
    ws: &[Window],
    seq_len: usize,
    head: &MtpWeights,
    vocab: &DraftVocab,
    to_row: &[u32],
    embedding: &crate::model::Embedding,
    shape: &BlockShape,
) -> Result<(Option<f64>, usize)> {
    if ws.is_empty() {
        return Ok((None, 0));
    }
    let (mut hit, mut total) = (0usize, 0usize);
    for chunk in ws.chunks(4) {
        let (emb, hid, _, _) = batch_tensors(t, chunk, seq_len, embedding, to_row, vocab.rows.dim(0)?)?;
        let (out, _, _) = head.forward(&emb, &hid, 0, None)?;
        let logits = vocab.logits(&rms_norm(&out, &head.norm, shape.rms_norm_eps)?)?;
        let best = logits.argmax(D::Minus1)?.to_vec2::<u32>()?;
        for (w, row) in chunk.iter().zip(&best) {
            for (r, &b) in row.iter().enumerate().take(w.len) {
                let l = w.start + r + 1;
                let target_top = t.label_ids[l * t.top_k];
                if vocab.token(b as usize) == target_top {
                    hit += 1;
                }
                total += 1;
            }
        }
    }
    Ok((Some(hit as f64 / total.max(1) as f64), total))
}

/// Write the trained head: `model.safetensors` (DeepSeek-V3 layout, f32, with `draft_vocab`)
/// and `config.json` with the shape, hidden source and training record.
fn write_head(
    out: &Path,
    target: &Model,
    head: &MtpWeights,
    vocab: Option<&[u32]>,
    opts: &DistillOptions,
    report: &TrainReport,
    loss_history: &[(usize, f64)],
) -> Result<()> {
    let c = target.config();
    let mut map: HashMap<String, Tensor> = HashMap::new();
    for (k, v) in head.tensors(c.num_layers) {
        map.insert(k, v.detach().to_dtype(DType::F16)?);
    }
    if let Some(ids) = vocab {
        map.insert("draft_vocab".into(), DraftVocab::ids_tensor(ids)?);
    }
    std::fs::create_dir_all(out)?;
    candle_core::safetensors::save(&map, out.join("model.safetensors"))?;
    let config = MtpConfig {
        model_type: Some("specula_mtp".into()),
        num_nextn_predict_layers: Some(1),
        hidden_source: opts.hidden_source,
        shape: Some(BlockShape::of_target(target)),
        num_hidden_layers: Some(c.num_layers),
        vocab_size: Some(c.vocab_size),
        attention_window: Some(opts.seq_len),
        training: Some(training_record(report, opts, vocab, loss_history)),
    };
    std::fs::write(out.join("config.json"), serde_json::to_string_pretty(&config)?)?;
    Ok(())
}

/// Initial weights of a block drafter: its layers copied from the target's last `layers` blocks,
/// `fc` passing the deepest tap through (identity) plus small random weights on the others, the
/// context norm at one, the final norm the target's.
pub fn initial_block_weights(
    target: &Model,
    model_path: &Path,
    n_taps: usize,
    layers: usize,
    seed: u64,
) -> Result<HashMap<String, Tensor>> {
    let c = target.config();
    let h = c.hidden_size;
    if layers == 0 || layers > c.num_layers {
        bail!("a block drafter needs 1..={} layers, got {layers}", c.num_layers);
    }
    let dev = Device::Cpu;
    let mut m = HashMap::new();
    let blocks = target_blocks(model_path, c.num_layers - layers..c.num_layers)?;
    for (i, block) in blocks.into_iter().enumerate() {
        for (k, v) in block {
            m.insert(format!("layers.{i}.{k}"), v.to_dtype(DType::F32)?);
        }
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut parts = Vec::with_capacity(n_taps);
    for i in 0..n_taps {
        parts.push(if i + 1 == n_taps {
            Tensor::eye(h, DType::F32, &dev)?
        } else {
            Tensor::from_vec(normal(&mut rng, h * h, 0.02), (h, h), &dev)?
        });
    }
    m.insert("fc.weight".into(), Tensor::cat(&parts, 1)?);
    m.insert("hidden_norm.weight".into(), Tensor::ones(h, DType::F32, &dev)?);
    m.insert("norm.weight".into(), target.output_norm.to_dtype(DType::F32)?);
    Ok(m)
}

/// The inputs of one block-drafter training batch.
struct BlockBatch {
    /// Concatenated target taps of the context rows `[b, T, taps × h]`.
    ctx: Tensor,
    /// Embeddings of the blocks' rows `[b, A × B, h]` (anchor, then mask tokens).
    x: Tensor,
    /// Positions of the block rows (the same in every window).
    positions: Vec<usize>,
    /// Attention bias `[A × B, T + A × B]`.
    bias: Tensor,
    /// Label probabilities `[b, A × B, draft rows]` (zero on the anchor row and padding).
    labels: Tensor,
    rows: usize,
    /// Per block row: (window, row index, depth r, label position) of the rows with a label.
    labelled: Vec<(usize, usize, usize, usize)>,
}

/// Anchors every `block_size / 2` positions from `anchor0`, each followed by `block_size - 1`
/// mask rows; block rows see the context rows before their anchor and their own block.
#[allow(clippy::too_many_arguments)]
fn block_batch(
    t: &Teacher,
    ws: &[Window],
    seq_len: usize,
    bs: usize,
    anchor0: usize,
    mask_token: u32,
    embedding: &crate::model::Embedding,
    to_row: &[u32],
    vrows: usize,
) -> Result<BlockBatch> {
    let dev = Device::Cpu;
    let longest = ws.iter().map(|w| w.len).max().unwrap_or(1).min(seq_len.max(1));
    let (b, tl, wd, k) = (ws.len(), longest, t.width(), t.top_k);
    let stride = (bs / 2).max(1);
    let anchors: Vec<usize> = (anchor0.max(1)..tl).step_by(stride).collect();
    let anchors = if anchors.is_empty() {
        vec![tl.saturating_sub(1).max(1)]
    } else {
        anchors
    };
    let r_all = anchors.len() * bs;
    let mut ctx = vec![0f32; b * tl * wd];
    let mut ids = vec![mask_token; b * r_all];
    let mut lab = vec![0f32; b * r_all * vrows];
    let mut labelled = Vec::new();
    for (wi, w) in ws.iter().enumerate() {
        for r in 0..w.len.min(tl) {
            let g = w.start + r;
            for (dst, src) in ctx[(wi * tl + r) * wd..(wi * tl + r + 1) * wd]
                .iter_mut()
                .zip(&t.hidden[g * wd..(g + 1) * wd])
            {
                *dst = src.to_f32();
            }
        }
        for (ai, &a) in anchors.iter().enumerate() {
            if a >= w.len {
                continue;
            }
            ids[wi * r_all + ai * bs] = t.tokens[w.start + a];
            for r in 1..bs {
                if a + r > w.len {
                    break;
                }
                let l = w.start + a + r - 1; // the distribution of the token at a + r
                let row = wi * r_all + ai * bs + r;
                for i in 0..k {
                    let id = t.label_ids[l * k + i] as usize;
                    let p = t.label_p[l * k + i].to_f32();
                    let dr = to_row.get(id).copied().unwrap_or(u32::MAX);
                    if dr != u32::MAX && p > 0.0 {
                        lab[row * vrows + dr as usize] += p;
                    }
                }
                labelled.push((wi, ai * bs + r, r, l));
            }
        }
    }
    let mut bias = vec![-1e9f32; r_all * (tl + r_all)];
    let mut positions = Vec::with_capacity(r_all);
    for (ai, &a) in anchors.iter().enumerate() {
        for r in 0..bs {
            let q = ai * bs + r;
            positions.push(a + r);
            for p in 0..a.min(tl) {
                bias[q * (tl + r_all) + p] = 0.0;
            }
            for r2 in 0..bs {
                bias[q * (tl + r_all) + tl + ai * bs + r2] = 0.0;
            }
        }
    }
    let x = embedding.forward(&ids, &dev)?.reshape((b, r_all, t.hidden_size))?;
    Ok(BlockBatch {
        ctx: Tensor::from_vec(ctx, (b, tl, wd), &dev)?,
        x,
        positions,
        bias: Tensor::from_vec(bias, (r_all, tl + r_all), &dev)?,
        labels: Tensor::from_vec(lab, (b, r_all, vrows), &dev)?,
        rows: labelled.len(),
        labelled,
    })
}

/// Log-probabilities `[b, A × B, draft rows]` of a block batch.
fn block_logp(bw: &BlockWeights, vocab: &DraftVocab, bb: &BlockBatch) -> Result<Tensor> {
    let tl = bb.ctx.dim(1)?;
    let c = bw.context(&bb.ctx)?;
    let kv = bw.context_kv(&c, &crate::spec::head::span(0, tl))?;
    let out = bw.forward(&bb.x, &bb.positions, &kv, &AttnMask::Bias(bb.bias.clone()))?;
    Ok(candle_nn::ops::log_softmax(&vocab.logits(&out)?, D::Minus1)?)
}

/// Depth-1 top-1 agreement of a block drafter with the teacher on `ws`.
#[allow(clippy::too_many_arguments)]
fn evaluate_block(
    t: &Teacher,
    ws: &[Window],
    seq_len: usize,
    bs: usize,
    mask_token: u32,
    bw: &BlockWeights,
    vocab: &DraftVocab,
    to_row: &[u32],
    embedding: &crate::model::Embedding,
) -> Result<(Option<f64>, usize)> {
    if ws.is_empty() {
        return Ok((None, 0));
    }
    let (mut hit, mut total) = (0usize, 0usize);
    for chunk in ws.chunks(4) {
        let bb = block_batch(
            t,
            chunk,
            seq_len,
            bs,
            1,
            mask_token,
            embedding,
            to_row,
            vocab.rows.dim(0)?,
        )?;
        let best = block_logp(bw, vocab, &bb)?.argmax(D::Minus1)?.to_vec2::<u32>()?;
        for &(wi, row, depth, l) in &bb.labelled {
            if depth != 1 {
                continue;
            }
            if vocab.token(best[wi][row] as usize) == t.label_ids[l * t.top_k] {
                hit += 1;
            }
            total += 1;
        }
    }
    Ok((Some(hit as f64 / total.max(1) as f64), total))
}

/// Write a trained block drafter: `model.safetensors` (f16, with `draft_vocab`) and
/// `config.json` (block size, target layers, mask token, shape, training record).
#[allow(clippy::too_many_arguments)]
fn write_block(
    out: &Path,
    target: &Model,
    bw: &BlockWeights,
    spec: &HeadSpec,
    vocab: Option<&[u32]>,
    opts: &DistillOptions,
    report: &TrainReport,
    loss_history: &[(usize, f64)],
) -> Result<()> {
    let HeadSpec::Block {
        block_size,
        taps,
        layers,
        mask_token,
    } = spec
    else {
        bail!("internal: not a block drafter");
    };
    let c = target.config();
    let mut map: HashMap<String, Tensor> = HashMap::new();
    for (k, v) in bw.tensors() {
        map.insert(k, v.detach().to_dtype(DType::F16)?);
    }
    if let Some(ids) = vocab {
        map.insert("draft_vocab".into(), DraftVocab::ids_tensor(ids)?);
    }
    std::fs::create_dir_all(out)?;
    candle_core::safetensors::save(&map, out.join("model.safetensors"))?;
    let config = BlockConfig {
        model_type: Some("specula_block_drafter".into()),
        block_size: Some(*block_size),
        target_layer_ids: Some(taps.clone()),
        mask_token_id: Some(*mask_token),
        num_hidden_layers: Some(*layers),
        vocab_size: Some(c.vocab_size),
        shape: Some(BlockShape::of_target(target)),
        dflash_config: None,
        attention_window: Some(opts.seq_len),
        training: Some(training_record(report, opts, vocab, loss_history)),
    };
    std::fs::write(out.join("config.json"), serde_json::to_string_pretty(&config)?)?;
    Ok(())
}

/// The training record written into a head's config.
fn training_record(
    report: &TrainReport,
    opts: &DistillOptions,
    vocab: Option<&[u32]>,
    loss_history: &[(usize, f64)],
) -> serde_json::Value {
    serde_json::json!({
        "steps": report.steps_done,
        "final_loss": report.final_loss,
        "held_out_top1_agreement": report.held_out_top1,
        "held_out_rows": report.held_out_rows,
        "train_rows": report.train_rows,
        "seconds": report.seconds,
        "batch": opts.batch,
        "seq_len": opts.seq_len,
        "lr": opts.lr,
        "warmup": opts.warmup,
        "weight_decay": opts.weight_decay,
        "clip": opts.clip,
        "draft_vocab": vocab.map(<[u32]>::len),
        "soft_label_top_k": opts.top_k,
        "seed": opts.seed,
        "loss_history": loss_history,
    })
}
