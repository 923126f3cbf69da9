//! The teacher pass of `specula distill`: the target's hidden states and next-token
//! distributions over the training sequences. Cached as `data/teacher.safetensors`.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use half::f16;
use rayon::prelude::*;

use super::data::Sequences;
use super::Progress;
use specula_engine::model::LogitsRows;

/// Teacher outputs for every position of every sequence.
#[derive(Debug, Clone)]
pub struct Teacher {
    pub hidden_size: usize,
    pub top_k: usize,
    /// The taps the hidden states come from (each row holds them concatenated, in order).
    pub taps: Vec<usize>,
    /// All sequences' tokens, concatenated.
    pub tokens: Vec<u32>,
    /// Sequence `s` is `tokens[offsets[s] .. offsets[s + 1]]`.
    pub offsets: Vec<usize>,
    /// Per sequence, the global position of its first generated token (`offsets[s]` for user
    /// text): training rows whose input token comes before it are context, not drafts.
    pub answer_from: Vec<usize>,
    /// `[N, taps × hidden]`: the tapped hidden states after each token.
    pub hidden: Vec<f16>,
    /// `[N, top_k]`: the target's most likely next tokens after each position, and their
    /// probabilities (softmax at temperature 1 over the full vocabulary).
    pub label_ids: Vec<u32>,
    pub label_p: Vec<f16>,
    /// Where the pass ran: `cpu`, or the attached device's name.
    pub made_on: String,
}

impl Teacher {
    pub fn positions(&self) -> usize {
        self.tokens.len()
    }

    pub fn sequences(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Values per position in `hidden` (taps × hidden size).
    pub fn width(&self) -> usize {
        self.taps.len() * self.hidden_size
    }
}

/// The `k` largest entries of a logits row as (id, probability).
pub fn top_probs(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
    for (i, &l) in row.iter().enumerate() {
        if best.len() == k && l <= best[k - 1].0 {
            continue;
        }
        let at = best.partition_point(|&(v, _)| v >= l);
        best.insert(at, (l, i as u32));
        best.truncate(k);
    }
    best.into_iter()
        .map(|(l, i)| (i, (((l - max) as f64).exp() / sum) as f32))
        .collect()
}

fn fingerprint(seqs: &Sequences, taps: &[usize], top_k: usize, on_device: bool) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |x: u64| {
        h ^= x;
        h = h.wrapping_mul(0x100_0000_01b3);
    };
    // A device's pass (other kernels, bf16 weights) is another teacher than the CPU model's.
    if on_device {
        eat(0xd3_71ce);
    }
    if let [one] = taps {
        eat(*one as u64);
    } else {
        for &t in taps {
            eat(t as u64 + 1);
        }
    }
    eat(top_k as u64);
    for (i, s) in seqs.sequences.iter().enumerate() {
        eat(seqs.answer_start(i) as u64);
        eat(s.len() as u64);
        for &t in s {
            eat(t as u64);
        }
    }
    h
}

/// Run the target over `seqs` (or read the cache in `dir`), keeping the hidden states at `taps`
/// and the top `top_k` next-token probabilities of every position.
///
/// On the engine's attached device ([`specula_engine::Engine::device_forward_hidden`]) when it has one,
/// `use_device` allows it and every tap is a block's output (not `post_norm`); else on the CPU
/// model. Errors: the device or the model fails, or the cache cannot be written.
pub fn teacher(
    engine: &specula_engine::Engine,
    seqs: &Sequences,
    taps: &[usize],
    use_device: bool,
    top_k: usize,
    dir: &Path,
    progress: &mut dyn FnMut(Progress),
) -> Result<Teacher> {
    let model = engine.model();
    let layers = model.config().num_layers;
    let on_device = use_device && engine.device_name().is_some() && taps.iter().all(|&t| t < layers);
    if let (Some(d), false, true) = (engine.device_name(), on_device, use_device) {
        progress(Progress::Note(format!(
            "the teacher pass runs on the CPU: {d} returns block outputs only, and these taps are {taps:?} (the post-norm tap is {layers})"
        )));
    }
    let key = fingerprint(seqs, taps, top_k, on_device);
    let path = dir.join("teacher.safetensors");
    let made_on = match (on_device, engine.device_name()) {
        (true, Some(d)) => d.to_string(),
        _ => "cpu".to_string(),
    };
    if let Some(mut t) = read_cache(&path, key)? {
        // The key covers where the pass ran.
        t.made_on = made_on;
        progress(Progress::Note(format!(
            "reusing the teacher pass ({} positions) from {}",
            t.positions(),
            path.display()
        )));
        return Ok(t);
    }
    let h = model.config().hidden_size;
    let ctx = model.config().context_length;
    let vocab = model.config().vocab_size;
    let mut t = Teacher {
        made_on,
        hidden_size: h,
        top_k,
        taps: taps.to_vec(),
        tokens: Vec::new(),
        offsets: vec![0],
        answer_from: Vec::new(),
        hidden: Vec::new(),
        label_ids: Vec::new(),
        label_p: Vec::new(),
    };
    progress(Progress::Stage {
        name: "teacher pass (target hidden states and distributions)",
        total: seqs.sequences.len() as u64,
    });
    let started = std::time::Instant::now();
    for (si, seq) in seqs.sequences.iter().enumerate() {
        let seq = &seq[..seq.len().min(ctx)];
        let mut push = |logits: &[f32], hid: &[f32]| -> Result<()> {
            // The cache keeps hidden states in f16: a value past its range would train on inf.
            if let Some(&x) = hid.iter().find(|x| x.is_nan() || x.abs() > f16::MAX.to_f32()) {
                anyhow::bail!(
                    "sequence {si}: a hidden state at taps {taps:?} is {x}, outside f16's range (the teacher cache's type)"
                );
            }
            t.hidden.extend(hid.iter().map(|&x| f16::from_f32(x)));
            let labels: Vec<Vec<(u32, f32)>> = logits.par_chunks(vocab).map(|row| top_probs(row, top_k)).collect();
            for l in labels {
                for i in 0..top_k {
                    let (id, p) = l.get(i).copied().unwrap_or((0, 0.0));
                    t.label_ids.push(id);
                    t.label_p.push(f16::from_f32(p));
                }
            }
            Ok(())
        };
        match on_device.then(|| engine.device_forward_hidden(seq, taps)).flatten() {
            Some(out) => {
                let (logits, hid) = out?;
                push(&logits, &hid)?;
            }
            None => {
                let mut kv = model.new_kv_cache();
                for chunk in seq.chunks(256) {
                    let out = model.forward(chunk, &mut kv, LogitsRows::All, taps)?;
                    let logits = out.logits.flatten_all()?.to_vec1::<f32>()?;
                    let hid = Tensor::cat(&out.hidden, 1)?.flatten_all()?.to_vec1::<f32>()?;
                    push(&logits, &hid)?;
                }
            }
        }
        t.answer_from
            .push(t.tokens.len() + seqs.answer_start(si).min(seq.len()));
        t.tokens.extend_from_slice(seq);
        t.offsets.push(t.tokens.len());
        let secs = started.elapsed().as_secs_f64();
        progress(Progress::Advance {
            done: si as u64 + 1,
            loss: None,
            tokens_per_s: Some(t.tokens.len() as f64 / secs.max(1e-9)),
        });
    }
    write_cache(&path, key, &t)?;
    Ok(t)
}

fn write_cache(path: &Path, key: u64, t: &Teacher) -> Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let dev = Device::Cpu;
    let n = t.positions();
    let offsets: Vec<i64> = t.offsets.iter().map(|&o| o as i64).collect();
    let answer_from: Vec<i64> = t.answer_from.iter().map(|&o| o as i64).collect();
    let mut meta: Vec<i64> = vec![key as i64, t.top_k as i64, t.hidden_size as i64, t.taps.len() as i64];
    meta.extend(t.taps.iter().map(|&x| x as i64));
    let n_meta = meta.len();
    let map: HashMap<String, Tensor> = [
        ("meta", Tensor::from_vec(meta, n_meta, &dev)?),
        ("tokens", Tensor::from_vec(t.tokens.clone(), n, &dev)?),
        ("offsets", Tensor::from_vec(offsets, t.offsets.len(), &dev)?),
        ("answer_from", Tensor::from_vec(answer_from, t.answer_from.len(), &dev)?),
        ("hidden", Tensor::from_vec(t.hidden.clone(), (n, t.width()), &dev)?),
        ("label_ids", Tensor::from_vec(t.label_ids.clone(), (n, t.top_k), &dev)?),
        ("label_p", Tensor::from_vec(t.label_p.clone(), (n, t.top_k), &dev)?),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let tmp = path.with_extension("tmp");
    candle_core::safetensors::save(&map, &tmp)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

fn read_cache(path: &Path, key: u64) -> Result<Option<Teacher>> {
    if !path.exists() {
        return Ok(None);
    }
    let m = candle_core::safetensors::load(path, &Device::Cpu).with_context(|| format!("{}", path.display()))?;
    let get = |k: &str| {
        m.get(k)
            .cloned()
            .with_context(|| format!("{}: missing '{k}'", path.display()))
    };
    let meta = get("meta")?.to_vec1::<i64>()?;
    if meta.len() < 4 || meta[0] != key as i64 {
        return Ok(None);
    }
    // [key, top_k, hidden, n_taps, taps...], or the one-tap form [key, tap, top_k, hidden].
    let (top_k, h, taps) = if meta.len() == 4 {
        (meta[2] as usize, meta[3] as usize, vec![meta[1] as usize])
    } else {
        (
            meta[1] as usize,
            meta[2] as usize,
            meta[4..].iter().map(|&x| x as usize).collect(),
        )
    };
    let offsets: Vec<usize> = get("offsets")?
        .to_vec1::<i64>()?
        .into_iter()
        .map(|o| o as usize)
        .collect();
    let answer_from: Vec<usize> = get("answer_from")?
        .to_vec1::<i64>()?
        .into_iter()
        .map(|o| o as usize)
        .collect();
    let t = Teacher {
        made_on: "cpu".into(),
        hidden_size: h,
        top_k,
        taps,
        tokens: get("tokens")?.to_vec1::<u32>()?,
        offsets,
        answer_from,
        hidden: get("hidden")?.flatten_all()?.to_vec1::<f16>()?,
        label_ids: get("label_ids")?.flatten_all()?.to_vec1::<u32>()?,
        label_p: get("label_p")?.to_dtype(DType::F16)?.flatten_all()?.to_vec1::<f16>()?,
    };
    if t.hidden.len() != t.positions() * t.width()
        || t.label_ids.len() != t.positions() * top_k
        || t.answer_from.len() + 1 != t.offsets.len()
    {
        bail!("{}: inconsistent teacher cache (delete it)", path.display());
    }
    Ok(Some(t))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_probs_are_the_largest_normalised_entries() {
        let row = [0.0f32, 2.0, 1.0, 3.0, -1.0];
        let p = top_probs(&row, 3);
        assert_eq!(p.iter().map(|x| x.0).collect::<Vec<_>>(), vec![3, 1, 2]);
        let z: f64 = row.iter().map(|&l| (l as f64).exp()).sum();
        assert!((p[0].1 as f64 - 3f64.exp() / z).abs() < 1e-6);
        assert!((p[2].1 as f64 - 1f64.exp() / z).abs() < 1e-6);
    }
}
