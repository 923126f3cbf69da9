//! `specula bench --device cuda:N`: exactness checks and timings on the GPU, written as one JSON
//! receipt (device, driver, build commit, shape, dtype, numbers).
//!
//! Exactness (each a bitwise comparison of f32 logits, or of token ids):
//! * verify rows vs one-row decode, k = 1..max_verify_rows-1;
//! * a captured-graph forward vs the same forward launched kernel by kernel;
//! * several sequences decoded together, and a mixed batch (decode rows of some sequences next
//!   to a verify block of another), vs each sequence alone;
//! * greedy decoding with n-gram speculation vs AR, token ids;
//! * tiny random Llama (GGUF), Qwen2 and Qwen3 (HF) bundles: GPU logits against the CPU engine's
//!   (relative L2 error, bf16 weights vs f32), which checks the loader and the model math.
//!
//! Timings use the host clock around whole steps (upload, graph replay, argmax download), as a
//! server would see them.

use super::load::{self, Shape};
use super::{Gpu, GpuModel, Row, SeqWeights, StepOut, Wide, PIPE_NAMES};
use crate::speculative::ngram::NgramDrafter;
use anyhow::Result;
use serde_json::{json, Value};
use std::time::Instant;

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    pub ordinal: usize,
    pub shape: Shape,
    pub seed: u64,
    /// Concurrency levels for the aggregate decode measurement.
    pub streams: Vec<usize>,
    /// Verify widths measured: 1..=this many rows.
    pub max_verify_rows: usize,
    /// Decode steps timed at batch 1.
    pub decode_steps: usize,
    /// Prompt lengths for the prefill measurement.
    pub prefill_lens: Vec<usize>,
    /// Context before the decode and verify measurements.
    pub context: usize,
    /// The commit the binary was built from, for the receipt.
    pub build_commit: String,
    /// Storage of the synthetic projection weights.
    pub dtype: load::WeightDtype,
    /// Also time the reference FMA GEMV kernels (bf16 only) in the same call.
    pub compare_gemv: bool,
}

/// Deterministic pseudo-random token ids in `[0, vocab)`.
pub fn tokens(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Compare the rows of `out` against `expect` (one logits vector per row).
fn compare_rows(out: &StepOut, expect: &[&[f32]], vocab: usize) -> (usize, f32) {
    let mut differ = 0;
    let mut worst = 0f32;
    for (i, e) in expect.iter().enumerate() {
        let got = &out.logits[i * vocab..(i + 1) * vocab];
        if !same_bits(got, e) {
            differ += 1;
            worst = worst.max(max_abs_diff(got, e));
        }
    }
    (differ, worst)
}

/// splitmix64 → uniform in [-1, 1).
fn unit(seed: u64, i: u64) -> f64 {
    let mut z = seed.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 52) as f64 - 1.0
}

/// The projection kernels alone: Y = X·Wᵀ for up to 70 rows against an f64 host reference of
/// the same bf16 / Q8_0 values (which catches a wrong fragment layout), and the bits of every
/// row against the same row computed with fewer rows, alone, and with the other wide tile
/// (batch invariance across every tile shape and the row tiling above 64).
fn check_gemm(gpu: &Gpu) -> Result<Value> {
    let to_bf16 = |x: f64| half::bf16::from_f64(x);
    let mmax = 70usize;
    let mut ok = true;
    let mut cases = Vec::new();
    for (q8, n, k) in [
        (false, 72, 136),
        (false, 200, 1000),
        (false, 96, 4096),
        (true, 200, 1000),
        (true, 96, 4096),
    ] {
        let seed = 17 + n as u64 * 31 + k as u64 + q8 as u64;
        let xs: Vec<half::bf16> = (0..mmax * k).map(|i| to_bf16(unit(seed, i as u64))).collect();
        let chunks = k.div_ceil(32);
        let scale = 1.0 / (k as f64).sqrt();
        let (wdata, wscale, wref): (Vec<u8>, Vec<f32>, Vec<f64>) = if q8 {
            let q: Vec<i8> = (0..n * k)
                .map(|i| (unit(seed ^ 1, i as u64) * 127.0).round() as i8)
                .collect();
            let d: Vec<f32> = (0..n * chunks)
                .map(|i| (scale / 127.0 * (1.0 + 0.5 * unit(seed ^ 2, i as u64))) as f32)
                .collect();
            let r = (0..n * k)
                .map(|i| q[i] as f64 * d[(i / k) * chunks + (i % k) / 32] as f64)
                .collect();
            (q.iter().map(|&v| v as u8).collect(), d, r)
        } else {
            let w: Vec<half::bf16> = (0..n * k).map(|i| to_bf16(scale * unit(seed ^ 3, i as u64))).collect();
            let r = w.iter().map(|v| v.to_f64()).collect();
            (
                w.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
                Vec::new(),
                r,
            )
        };
        let wd = super::DevBuf::new(wdata.len())?;
        gpu.upload(wd.at(0), &wdata)?;
        let sd = super::DevBuf::new((wscale.len() * 4).max(4))?;
        if q8 {
            gpu.upload(sd.at(0), &wscale)?;
        }
        let w = (wd.at(0), if q8 { sd.at(0) } else { 0 });
        let xd = super::DevBuf::new(mmax * k * 2)?;
        let xbits: Vec<u16> = xs.iter().map(|v| v.to_bits()).collect();
        gpu.upload(xd.at(0), &xbits)?;
        let yd = super::DevBuf::new(mmax * n * 4)?;
        let run = |x_row: usize, rows: usize| -> Result<Vec<f32>> {
            gpu.gemm(w, xd.at(x_row * k * 2), None, yd.at(0), rows, n, k)?;
            let mut y = vec![0f32; rows * n];
            gpu.download(&mut y, yd.at(0))?;
            Ok(y)
        };
        let full = run(0, mmax)?;
        // Accuracy: |y - ref| against the sum of |w x| (f32 accumulation error is ~1e-6 of it).
        let mut worst = 0f64;
        for m in 0..mmax {
            for f in 0..n {
                let (mut r, mut mag) = (0f64, 0f64);
                for i in 0..k {
                    let p = wref[f * k + i] * xs[m * k + i].to_f64();
                    r += p;
                    mag += p.abs();
                }
                worst = worst.max((full[m * n + f] as f64 - r).abs() / mag.max(1e-30));
            }
        }
        let accurate = worst < 1e-4;
        let mut differing = Vec::new();
        for rows in [1, 2, 3, 5, 8, 9, 15, 16, 17, 24, 31, 32, 33, 40, 63, 64, 65, 69] {
            if !same_bits(&run(0, rows)?, &full[..rows * n]) {
                differing.push(format!("first {rows} rows"));
            }
        }
        for j in [1, 37, 69] {
            if !same_bits(&run(j, 1)?, &full[j * n..(j + 1) * n]) {
                differing.push(format!("row {j} alone"));
            }
        }
        // Every kernel above 32 rows, and the seq kernels with each K split over blocks (1, 2,
        // 4, 8).
        let (wide, blocks) = (gpu.wide(), gpu.seq_blocks());
        let tiles = |rt: usize| mmax.div_ceil(rt) * n.div_ceil(128);
        let mut configs = vec![(Wide::Tile2, blocks), (Wide::Tile4, blocks)];
        configs.extend([1, 2, 4, 8].map(|ks| (Wide::Seq, tiles(64) * ks)));
        configs.extend([1, 2, 4, 8].map(|ks| (Wide::Seq32, tiles(32) * ks)));
        let sw = gpu.seq_w();
        let mut configs: Vec<_> = configs.into_iter().map(|(w, b)| (w, b, SeqWeights::Reg4)).collect();
        for w in [SeqWeights::Reg6, SeqWeights::Ring] {
            configs.extend([1, 2, 4, 8].map(|ks| (Wide::Seq, tiles(64) * ks, w)));
        }
        for (w2, b2, s2) in configs {
            gpu.set_wide(w2);
            gpu.set_seq_blocks(b2);
            gpu.set_seq_w(s2);
            let other = run(0, mmax);
            gpu.set_wide(wide);
            gpu.set_seq_blocks(blocks);
            gpu.set_seq_w(sw);
            if !same_bits(&other?, &full) {
                differing.push(format!("{} tile ({b2} blocks, weights {})", w2.name(), s2.name()));
            }
        }
        // The 2x8 tile with each way of streaming its operands, with and without the 2x4 tile
        // for narrow layers at 33..64 rows (n = 72 is narrow; run at 33..64 rows too).
        let (pipe, narrow) = (gpu.pipe(), gpu.narrow64());
        gpu.set_wide(Wide::Tile2);
        for p in 0..=super::PIPE_AUTO {
            for nw in [false, true] {
                gpu.set_pipe(p);
                gpu.set_narrow64(nw);
                let other = run(0, mmax).and_then(|a| Ok((a, run(0, 40)?, run(0, 64)?)));
                gpu.set_pipe(pipe);
                gpu.set_narrow64(narrow);
                let (a, b, c) = other?;
                if !same_bits(&a, &full) || !same_bits(&b, &full[..40 * n]) || !same_bits(&c, &full[..64 * n]) {
                    differing.push(format!("2x8 tile (pipe {p}, narrow64 {nw})"));
                }
            }
        }
        gpu.set_wide(wide);
        let pass = accurate && differing.is_empty();
        ok &= pass;
        cases.push(json!({
            "dtype": if q8 { "q8_0" } else { "bf16" },
            "n": n, "k": k, "rows": mmax,
            "max_error_relative_to_sum_abs": worst,
            "invariance_failures": differing,
            "pass": pass,
        }));
    }
    Ok(json!({"pass": ok, "cases": cases}))
}

/// A wide decode batch (one row in each of up to 40 slots, tiles above 32 rows) against each
/// row alone.
fn check_wide(m: &mut GpuModel) -> Result<Value> {
    let v = m.config.vocab;
    let n = m.slots().min(40);
    let toks = tokens(n, 91, v);
    let rows: Vec<Row> = (0..n)
        .map(|i| Row {
            token: toks[i],
            slot: i as u32,
            pos: 5 + (i % 7) as u32,
        })
        .collect();
    let together = m.forward(&rows, true)?;
    let mut differ = 0;
    for (i, r) in rows.iter().enumerate() {
        let alone = m.forward(std::slice::from_ref(r), true)?;
        differ += !same_bits(&alone.logits, &together.logits[i * v..(i + 1) * v]) as usize;
    }
    Ok(json!({"pass": differ == 0, "rows": n, "rows_differing": differ}))
}

/// Prompt length of the long-context verify check: 1,000 keys, split into 4 ranges.
const LONG_CHECK_PROMPT: usize = 1000;

/// Verify rows vs one-row decode, and graph vs direct launches, in `slot`, after a prompt of
/// `prompt_len` tokens (past 256, the attention splits each row's keys into ranges).
fn check_verify(m: &mut GpuModel, slot: u32, max_rows: usize, prompt_len: usize) -> Result<Value> {
    let v = m.config.vocab;
    let p = tokens(prompt_len, 7, v);
    let p0 = p.len() as u32;
    let mut toks = vec![m.prefill(slot, 0, &p, false)?.argmax[0]];
    let mut single = Vec::new();
    for i in 0..max_rows {
        let out = m.forward(
            &[Row {
                token: toks[i],
                slot,
                pos: p0 + i as u32,
            }],
            true,
        )?;
        toks.push(out.argmax[0]);
        single.push(out.logits);
    }
    let rows_of = |r: usize| -> Vec<Row> {
        (0..r)
            .map(|i| Row {
                token: toks[i],
                slot,
                pos: p0 + i as u32,
            })
            .collect()
    };
    let mut per_k = Vec::new();
    let mut ok = true;
    for r in 2..=max_rows {
        let out = m.forward(&rows_of(r), true)?;
        let expect: Vec<&[f32]> = single[..r].iter().map(|x| x.as_slice()).collect();
        let (differ, worst) = compare_rows(&out, &expect, v);
        ok &= differ == 0;
        per_k.push(json!({"k": r - 1, "rows": r, "bitwise_equal": differ == 0, "rows_differing": differ, "max_abs_diff": worst}));
    }
    // The same 5-row forward without the graph.
    let r = 5.min(max_rows);
    let graphs = m.use_graphs;
    m.use_graphs = false;
    let direct = m.forward(&rows_of(r), true);
    m.use_graphs = graphs;
    let direct = direct?;
    let expect: Vec<&[f32]> = single[..r].iter().map(|x| x.as_slice()).collect();
    let (gd, _) = compare_rows(&direct, &expect, v);
    ok &= gd == 0;
    Ok(json!({"pass": ok, "prompt_tokens": prompt_len, "per_k": per_k, "graph_vs_direct_equal": gd == 0}))
}

/// Four sequences decoded alone, then together, then a mixed batch (decode rows of three next
/// to a 3-row verify block of the fourth).
fn check_batch(m: &mut GpuModel, slots: [u32; 4], steps: usize) -> Result<Value> {
    let v = m.config.vocab;
    let prompts: Vec<Vec<u32>> = [20usize, 33, 47, 60]
        .iter()
        .enumerate()
        .map(|(i, &n)| tokens(n, 100 + i as u64, v))
        .collect();
    // Solo: tokens fed and logits per step.
    let mut fed: Vec<Vec<u32>> = Vec::new();
    let mut solo: Vec<Vec<Vec<f32>>> = Vec::new();
    for (s, p) in slots.iter().zip(&prompts) {
        let mut t = m.prefill(*s, 0, p, false)?.argmax[0];
        let (mut f, mut l) = (Vec::new(), Vec::new());
        for j in 0..steps {
            let out = m.forward(
                &[Row {
                    token: t,
                    slot: *s,
                    pos: (p.len() + j) as u32,
                }],
                true,
            )?;
            f.push(t);
            l.push(out.logits);
            t = out.argmax[0];
        }
        fed.push(f);
        solo.push(l);
    }
    let mut together_ok = true;
    for (s, p) in slots.iter().zip(&prompts) {
        m.prefill(*s, 0, p, false)?;
    }
    for j in 0..steps {
        let rows: Vec<Row> = (0..4)
            .map(|i| Row {
                token: fed[i][j],
                slot: slots[i],
                pos: (prompts[i].len() + j) as u32,
            })
            .collect();
        let out = m.forward(&rows, true)?;
        let expect: Vec<&[f32]> = (0..4).map(|i| solo[i][j].as_slice()).collect();
        together_ok &= compare_rows(&out, &expect, v).0 == 0;
    }
    // Mixed: sequence 0 decodes step 0, sequence 1 verifies steps 0..3, sequences 2 and 3 decode.
    for (s, p) in slots.iter().zip(&prompts) {
        m.prefill(*s, 0, p, false)?;
    }
    let mut rows = vec![Row {
        token: fed[0][0],
        slot: slots[0],
        pos: prompts[0].len() as u32,
    }];
    let mut expect: Vec<&[f32]> = vec![&solo[0][0]];
    for j in 0..3 {
        rows.push(Row {
            token: fed[1][j],
            slot: slots[1],
            pos: (prompts[1].len() + j) as u32,
        });
        expect.push(&solo[1][j]);
    }
    for i in 2..4 {
        rows.push(Row {
            token: fed[i][0],
            slot: slots[i],
            pos: prompts[i].len() as u32,
        });
        expect.push(&solo[i][0]);
    }
    let out = m.forward(&rows, true)?;
    let (mixed_differ, _) = compare_rows(&out, &expect, v);
    Ok(json!({
        "pass": together_ok && mixed_differ == 0,
        "together_equal_solo": together_ok,
        "mixed_batch_equal_solo": mixed_differ == 0,
        "steps": steps,
    }))
}

/// Greedy AR vs greedy n-gram speculation (k drafts), token ids.
fn check_ngram(m: &mut GpuModel, slot_ar: u32, slot_spec: u32, gen: usize, k: usize) -> Result<Value> {
    let v = m.config.vocab;
    let base = tokens(24, 5, v);
    let prompt: Vec<u32> = base.iter().chain(&base).chain(&base).copied().collect();
    let mut t = m.prefill(slot_ar, 0, &prompt, false)?.argmax[0];
    let mut ar = vec![t];
    while ar.len() < gen {
        let pos = (prompt.len() + ar.len() - 1) as u32;
        t = m
            .forward(
                &[Row {
                    token: t,
                    slot: slot_ar,
                    pos,
                }],
                false,
            )?
            .argmax[0];
        ar.push(t);
    }
    let first = m.prefill(slot_spec, 0, &prompt, false)?.argmax[0];
    let mut ctx = prompt.clone();
    ctx.push(first);
    let drafter = NgramDrafter::default();
    let (mut steps, mut drafted, mut accepted) = (0usize, 0usize, 0usize);
    while ctx.len() - prompt.len() < gen {
        let d = drafter.lookup(&ctx, k);
        let base_pos = (ctx.len() - 1) as u32;
        let mut rows = vec![Row {
            token: ctx[ctx.len() - 1],
            slot: slot_spec,
            pos: base_pos,
        }];
        for (i, &tok) in d.iter().enumerate() {
            rows.push(Row {
                token: tok,
                slot: slot_spec,
                pos: base_pos + 1 + i as u32,
            });
        }
        let out = m.forward(&rows, false)?;
        let mut i = 0;
        while i < d.len() && d[i] == out.argmax[i] {
            i += 1;
        }
        ctx.extend_from_slice(&d[..i]);
        ctx.push(out.argmax[i]);
        steps += 1;
        drafted += d.len();
        accepted += i;
    }
    let spec: Vec<u32> = ctx[prompt.len()..prompt.len() + gen].to_vec();
    Ok(json!({
        "pass": spec == ar,
        "tokens": gen,
        "k": k,
        "target_steps": steps,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": if drafted > 0 { accepted as f64 / drafted as f64 } else { 0.0 },
        "tau": gen as f64 / steps.max(1) as f64,
    }))
}

/// Tiny random bundles of each family: GPU logits against the CPU engine's.
pub fn check_tiny_bundles(ordinal: usize) -> Result<Value> {
    use crate::model::Family;
    use crate::testing::{write_tiny_gguf, write_tiny_hf, TinySpec};
    /// Removes the tiny bundles however the check ends.
    struct Scratch(std::path::PathBuf);
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let scratch = Scratch(std::env::temp_dir().join(format!("specula-gpu-check-{}", std::process::id())));
    let dir = scratch.0.clone();
    std::fs::create_dir_all(&dir)?;
    let mut results = Vec::new();
    let mut ok = true;
    // The dense families, and the MoE ones (tiny Qwen3-MoE / Qwen2-MoE with a dense layer).
    let bundles = [
        (Family::Llama, true),
        (Family::Qwen2, false),
        (Family::Qwen3, false),
        (Family::Other("qwen3moe"), true),
        (Family::Other("qwen2moe"), false),
    ];
    for (family, gguf) in bundles {
        let moe = matches!(family, Family::Other(_));
        let spec = TinySpec::new(family);
        let path = match (moe, gguf) {
            (false, true) => {
                let p = dir.join(format!("{}.gguf", family.as_str()));
                write_tiny_gguf(&p, &spec)?;
                p
            }
            (false, false) => {
                let p = dir.join(family.as_str());
                write_tiny_hf(&p, &spec)?;
                p
            }
            (true, true) => {
                let c = crate::testing::tiny_moe_config(family.as_str());
                let p = dir.join(format!("{}.gguf", family.as_str()));
                let arch = crate::arch::of(&c);
                crate::testing::write_random_gguf(
                    &p,
                    arch,
                    family.as_str(),
                    &c,
                    candle_core::quantized::GgmlDType::F32,
                    11,
                )?;
                p
            }
            (true, false) => {
                let c = crate::testing::tiny_moe_config(family.as_str());
                let p = dir.join(family.as_str());
                crate::testing::write_random_hf(&p, crate::arch::of(&c), &c, 11)?;
                p
            }
        };
        super::trace(&format!("tiny {}: CPU load", family.as_str()));
        let cpu = crate::bundle::load(&path, &candle_core::Device::Cpu)?.model;
        super::trace("GPU load");
        let mut gpu = load::from_bundle(Gpu::open(ordinal)?, &path, cpu.config(), 1, 128)?;
        let vocab = cpu.config().vocab_size;
        let prompt = tokens(17, 3, vocab);
        let mut kv = cpu.new_kv_cache();
        let mut worst_rel = 0f64;
        let mut top1 = 0usize;
        let steps = 12;
        let mut feed = prompt.clone();
        let mut pos = 0u32;
        for step in 0..=steps {
            super::trace(&format!("tiny step {step}"));
            let c = cpu.forward(&feed, &mut kv, crate::model::LogitsRows::Last, &[])?;
            let c: Vec<f32> = c.logits.flatten_all()?.to_vec1()?;
            let g = if step == 0 {
                gpu.prefill(0, 0, &feed, true)?
            } else {
                gpu.forward(
                    &[Row {
                        token: feed[0],
                        slot: 0,
                        pos,
                    }],
                    true,
                )?
            };
            let num: f64 = c.iter().zip(&g.logits).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
            let den: f64 = c.iter().map(|a| (*a as f64).powi(2)).sum();
            worst_rel = worst_rel.max((num / den.max(1e-30)).sqrt());
            let cpu_top = c
                .iter()
                .enumerate()
                .fold(
                    (0usize, f32::NEG_INFINITY),
                    |b, (i, &x)| if x > b.1 { (i, x) } else { b },
                )
                .0;
            top1 += (cpu_top as u32 == g.argmax[0]) as usize;
            pos += feed.len() as u32;
            feed = vec![cpu_top as u32];
        }
        // bf16 weights against the CPU's f32: about 2-3% relative error on these tiny random
        // models; a wrong formula (RoPE, norm, bias, GQA mapping) gives O(1).
        let pass = worst_rel < 0.1 && top1 + 2 > steps;
        ok &= pass;
        results.push(json!({
            "family": family.as_str(),
            "format": if gguf { "gguf f32" } else { "hf f32" },
            "max_relative_l2_error": worst_rel,
            "top1_agreement": format!("{top1}/{}", steps + 1),
            "pass": pass,
        }));
    }
    drop(scratch);
    Ok(json!({"pass": ok, "bundles": results}))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Time `reps` forwards of `rows` after `warm` untimed ones; seconds per forward.
fn time_rows(m: &mut GpuModel, rows: &[Row], warm: usize, reps: usize) -> Result<f64> {
    for _ in 0..warm {
        m.forward(rows, false)?;
    }
    let t = Instant::now();
    for _ in 0..reps {
        m.forward(rows, false)?;
    }
    Ok(t.elapsed().as_secs_f64() / reps as f64)
}

/// Device-to-device copy bandwidth (bytes read + written per second) over two 2 GiB buffers.
fn copy_bandwidth(gpu: &Gpu) -> Result<f64> {
    let bytes = 2usize << 30;
    let a = super::DevBuf::new(bytes)?;
    let b = super::DevBuf::new(bytes)?;
    gpu.fill_uniform_bf16(a.at(0), bytes / 2, 1, 1.0, 0.0)?;
    gpu.copy(b.at(0), a.at(0), bytes)?;
    gpu.synchronize()?;
    let reps = 10;
    let t = Instant::now();
    for _ in 0..reps {
        gpu.copy(b.at(0), a.at(0), bytes)?;
    }
    gpu.synchronize()?;
    Ok(2.0 * bytes as f64 * reps as f64 / t.elapsed().as_secs_f64())
}

/// Batch-1 decode, verify widths 1..=max_verify_rows, and aggregate decode at each stream
/// count, with the model's current kernels: `{step_s, verify_cost, aggregate}`.
fn time_decode(m: &mut GpuModel, o: &BenchOptions, prompt: &[u32]) -> Result<Value> {
    let v = m.config.vocab;
    let max_streams = o.streams.iter().copied().max().unwrap_or(1).max(8);
    let mut t = m.prefill(0, 0, prompt, false)?.argmax[0];
    let mut pos = prompt.len() as u32;
    for _ in 0..8 {
        t = m.forward(&[Row { token: t, slot: 0, pos }], false)?.argmax[0];
        pos += 1;
    }
    let start = Instant::now();
    for _ in 0..o.decode_steps {
        t = m.forward(&[Row { token: t, slot: 0, pos }], false)?.argmax[0];
        pos += 1;
    }
    let step_s = start.elapsed().as_secs_f64() / o.decode_steps as f64;

    let base = prompt.len() as u32;
    let mut verify_cost = Vec::new();
    let mut one_row = 0.0;
    for r in 1..=o.max_verify_rows {
        let rows: Vec<Row> = (0..r)
            .map(|i| Row {
                token: prompt[i],
                slot: 0,
                pos: base + i as u32,
            })
            .collect();
        let s = median((0..3).map(|_| time_rows(m, &rows, 3, 20)).collect::<Result<Vec<_>>>()?);
        if r == 1 {
            one_row = s;
        }
        verify_cost.push(json!({"rows": r, "k": r - 1, "ms": s * 1e3, "relative_to_one_row": s / one_row}));
    }

    let mut firsts = Vec::new();
    for b in 0..max_streams {
        let p = tokens(o.context, 1000 + b as u64, v);
        firsts.push(m.prefill(b as u32, 0, &p, false)?.argmax[0]);
    }
    let mut aggregate = Vec::new();
    for &b in &o.streams {
        let mut toks: Vec<u32> = firsts[..b].to_vec();
        let steps = 30;
        let mut elapsed = 0.0;
        for (step, pos) in (0..steps + 3).zip(o.context as u32..) {
            let rows: Vec<Row> = (0..b)
                .map(|i| Row {
                    token: toks[i],
                    slot: i as u32,
                    pos,
                })
                .collect();
            let t = Instant::now();
            let out = m.forward(&rows, false)?;
            if step >= 3 {
                elapsed += t.elapsed().as_secs_f64();
            }
            toks = out.argmax;
        }
        let s = elapsed / steps as f64;
        aggregate.push(
            json!({"streams": b, "ms_per_step": s * 1e3, "tok_s_aggregate": b as f64 / s, "tok_s_per_stream": 1.0 / s}),
        );
    }

    Ok(json!({"step_s": step_s, "verify_cost": verify_cost, "aggregate": aggregate}))
}

/// Run the checks and the timings; `log` gets one line per stage.
pub fn run(o: &BenchOptions, log: &dyn Fn(&str)) -> Result<Value> {
    let t0 = Instant::now();
    // Open the device first: no driver is the likeliest error, and it should come before work.
    let gpu = Gpu::open(o.ordinal)?;
    log("checking tiny bundles against the CPU engine");
    let tiny = check_tiny_bundles(o.ordinal)?;
    let device = json!({
        "name": gpu.name(),
        "driver_cuda_version": gpu.driver_version(),
        "memory_bytes": gpu.total_memory(),
        "ordinal": o.ordinal,
    });
    log("measuring copy bandwidth");
    let bw = copy_bandwidth(&gpu)?;
    let max_streams = o.streams.iter().copied().max().unwrap_or(1).max(8);
    // Room for the long-context verify check too.
    let ctx = (o.context + o.decode_steps + 64).max(LONG_CHECK_PROMPT + 64);
    log(&format!("generating {} weights on the device", o.shape.name));
    log("exactness: the GEMM kernels against a host reference and across row counts");
    let gemm = check_gemm(&gpu)?;
    let mut m = load::synthetic(gpu, o.shape.config(), o.seed, max_streams, ctx, o.dtype)?;
    let wb = m.weight_bytes();
    // The bytes a one-row step reads: every weight, except that an MoE layer reads only the
    // experts a token is routed to (and its router and shared expert).
    let step_bytes = m.step_bytes();
    let floor_s = step_bytes as f64 / bw;
    let v = m.config.vocab;

    log("exactness: verify rows vs one-row decode");
    let verify = check_verify(&mut m, 0, o.max_verify_rows.clamp(2, 16), 100)?;
    log("exactness: verify rows vs one-row decode at a long context (split attention)");
    let verify_long = check_verify(&mut m, 7, o.max_verify_rows.clamp(2, 16), LONG_CHECK_PROMPT)?;
    log("exactness: batched and mixed rows vs solo");
    let batch = check_batch(&mut m, [1, 2, 3, 4], 6)?;
    log("exactness: greedy n-gram speculation vs AR");
    let ngram = check_ngram(&mut m, 5, 6, 96, 4)?;
    log("exactness: a 40-row decode batch vs each row alone");
    let wide = check_wide(&mut m)?;
    let all_exact = [&verify, &verify_long, &batch, &ngram, &tiny, &gemm, &wide]
        .iter()
        .all(|x| x["pass"] == true);

    let prompt = tokens(o.context, 11, v);
    log("timing batch-1 decode, verify widths, aggregate decode");
    let timed = time_decode(&mut m, o, &prompt)?;
    let gemm_path = m.gpu.gemm_path();

    log("kernel profile at 1, 8 and 64 rows");
    let mut profile = Vec::new();
    let (keep, keep_w, keep_p, keep_n) = (m.gpu.wide(), m.gpu.seq_w(), m.gpu.pipe(), m.gpu.narrow64());
    // At 64 rows, every wide kernel (the 2x8 tile with each way of streaming its operands, the
    // seq tile with each way of holding its weights).
    let mut at64: Vec<_> = (0..=super::PIPE_AUTO).map(|p| (Wide::Tile2, keep_w, p)).collect();
    at64.push((Wide::Seq32, keep_w, keep_p));
    at64.extend([SeqWeights::Reg4, SeqWeights::Reg6, SeqWeights::Ring].map(|w| (Wide::Seq, w, keep_p)));
    let runs = [
        (1usize, keep, keep_w, keep_p),
        (8, keep, keep_w, keep_p),
        (64, keep, keep_w, keep_p),
    ]
    .into_iter()
    .chain(
        at64.into_iter()
            .filter(|&c| c != (keep, keep_w, keep_p))
            .map(|(w, sw, p)| (64, w, sw, p)),
    );
    // And the default with the other choice for narrow layers at 64 rows.
    let runs = runs
        .map(|(r, w, sw, p)| (r, w, sw, p, keep_n))
        .chain([(64, keep, keep_w, keep_p, !keep_n)]);
    for (r, wide, sw, pipe, narrow) in runs {
        let rows: Vec<Row> = (0..r.min(m.slots()))
            .map(|i| Row {
                token: prompt[i],
                slot: i as u32,
                pos: o.context as u32,
            })
            .collect();
        m.gpu.set_wide(wide);
        m.gpu.set_seq_w(sw);
        m.gpu.set_pipe(pipe);
        m.gpu.set_narrow64(narrow);
        let p = m.profile(&rows);
        m.gpu.set_wide(keep);
        m.gpu.set_seq_w(keep_w);
        m.gpu.set_pipe(keep_p);
        m.gpu.set_narrow64(keep_n);
        let p = p?;
        let total: f64 = p.iter().map(|e| e.2).sum();
        let label = match wide {
            Wide::Seq => format!("seq/w{}", sw.name()),
            Wide::Tile2 => format!(
                "{}/p{}{}",
                wide.name(),
                PIPE_NAMES[pipe as usize],
                if narrow { "/narrow64" } else { "" }
            ),
            _ => wide.name().to_string(),
        };
        profile.push(json!({
            "rows": rows.len(),
            "gemm_wide": label,
            "total_ms": total,
            "kernels": p.iter().map(|(k, n, ms)| json!({"kernel": k, "launches": n, "ms": ms})).collect::<Vec<_>>(),
        }));
    }

    let gemv_ref = if o.compare_gemv && o.dtype == load::WeightDtype::Bf16 {
        log("timing the reference GEMV kernels");
        m.set_gemm_path(super::GemmPath::Gemv);
        let t = time_decode(&mut m, o, &prompt)?;
        m.set_gemm_path(gemm_path);
        t
    } else {
        Value::Null
    };

    log("timing prefill");
    let longest = o.prefill_lens.iter().copied().max().unwrap_or(512);
    m.resize_kv(1, longest + 8)?;
    let mut prefill = Vec::new();
    for &n in &o.prefill_lens {
        let p = tokens(n, 77, v);
        m.prefill(0, 0, &p, false)?;
        let s = median(
            (0..3)
                .map(|_| {
                    let t = Instant::now();
                    m.prefill(0, 0, &p, false).map(|_| t.elapsed().as_secs_f64())
                })
                .collect::<Result<Vec<_>>>()?,
        );
        prefill.push(json!({"tokens": n, "seconds": s, "tok_s": n as f64 / s}));
    }

    Ok(json!({
        "specula_build_commit": o.build_commit,
        "device": device,
        "dtype": o.dtype,
        "weights": "synthetic (generated on the device)",
        "shape": m.config,
        "weight_bytes": wb,
        "step_bytes": step_bytes,
        "copy_bandwidth_tb_s": bw / 1e12,
        "floor_ms_per_token": floor_s * 1e3,
        "floor_tok_s": 1.0 / floor_s,
        "decode_batch1": {
            "context": o.context,
            "steps": o.decode_steps,
            "ms_per_step": timed["step_s"].as_f64().unwrap_or(0.0) * 1e3,
            "tok_s": 1.0 / timed["step_s"].as_f64().unwrap_or(f64::NAN),
            "fraction_of_floor": floor_s / timed["step_s"].as_f64().unwrap_or(f64::NAN),
        },
        "verify_cost": timed["verify_cost"],
        "aggregate_decode": timed["aggregate"],
        "prefill": prefill,
        "exactness": {
            "all_pass": all_exact,
            "verify_rows_vs_one_row": verify,
            "verify_rows_vs_one_row_long_context": verify_long,
            "batched_vs_solo": batch,
            "ngram_spec_vs_ar": ngram,
            "tiny_bundles_vs_cpu": tiny,
            "gemm_vs_host_and_row_counts": gemm,
            "wide_batch_vs_solo": wide,
        },
        "gemm_path": gemm_path,
        "gemm_wide": m.gpu.wide().name(),
        "gemm_seq_blocks": m.gpu.seq_blocks(),
        "gemm_seq_weights": m.gpu.seq_w().name(),
        "gemm_pipe": PIPE_NAMES[m.gpu.pipe() as usize],
        "gemm_narrow64": m.gpu.narrow64(),
        "kernel_profile": profile,
        "gemv_reference": gemv_ref,
        "wall_seconds": t0.elapsed().as_secs_f64(),
    }))
}
