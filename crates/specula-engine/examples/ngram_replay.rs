//! Replays greedy outputs through the n-gram lookup and reports tau (mean tokens committed per
//! target step) at a fixed draft length k, without running the model: with greedy decoding
//! and a deterministic drafter, a step commits the draft's longest prefix that equals the
//! output, plus one token of the target's, so tau depends only on the text.
//!
//! ```sh
//! # outputs: one JSON object per line with "id", "kind", "prompt_token_ids", "token_ids"
//! # (`specula generate --chat --json --spec off` gives the last two)
//! cargo run --release -p specula-engine --example ngram_replay -- MODEL.gguf outputs.jsonl [K] [MIN_N] [MAX_N] [ID]
//! ```
//!
//! Prints tau per prompt and per kind for exact lookup, structural matches without number
//! extrapolation, the lookup with numbers, the full lookup (which also wraps a draft past
//! the context's end), and the copy oracle (`replay_oracle`: the best copy of any context span,
//! knowing the output; it bounds what any prompt lookup can reach). With a prompt `ID`, also prints every position of that output where the
//! full lookup's draft is accepted less far than the one without wrapping, with both drafts.
//!
//! Then, per kind, four stateful policies through `NgramDrafter::propose_tokens` (min_n as
//! given, and 1; each without and with the confidence cut at `NGRAM_REPLAY_CONF`, default
//! 0.3), at fixed k and with the draft-length controller choosing k: tau, draft tokens verified
//! per step, and the speed-up over AR modeled with a verify of r rows costing
//! `1 + NGRAM_REPLAY_ROW·(r - 1)` one-row forwards (default 0.25). `NGRAM_REPLAY_HIDE_WEAK=1`
//! keeps drafts from one-token matches out of the controller's acceptance estimate.

use anyhow::{Context, Result};
use specula_engine::speculative::ngram::NgramDrafter;
use specula_engine::speculative::DraftLength;
use std::collections::BTreeMap;

/// Totals of a stateful replay: target steps, tokens committed, draft tokens verified, and the
/// modeled cost in one-row forwards.
#[derive(Default, Clone, Copy)]
struct Run {
    steps: usize,
    tokens: usize,
    drafted: usize,
    cost: f64,
}

impl Run {
    fn add(&mut self, o: Run) {
        self.steps += o.steps;
        self.tokens += o.tokens;
        self.drafted += o.drafted;
        self.cost += o.cost;
    }

    fn cell(&self) -> String {
        let s = self.steps.max(1) as f64;
        format!(
            "tau {:.2} d/step {:.2} x{:.2}",
            self.tokens as f64 / s,
            self.drafted as f64 / s,
            self.tokens as f64 / self.cost.max(1e-9)
        )
    }
}

/// A stateful replay through [`NgramDrafter::propose_tokens`] (the drafter learns from its own
/// drafts, as live): k fixed, or chosen per step by the draft-length controller (`adaptive`)
/// fed a modeled verify cost of `1 + row·(rows - 1)` one-row forwards and a free drafter.
fn replay_policy(d: &NgramDrafter, prompt: &[u32], out: &[u32], k: usize, adaptive: bool, row: f64) -> Run {
    let mut d = d.clone();
    let mut ctl = DraftLength::new(k, adaptive);
    let hide_weak = std::env::var("NGRAM_REPLAY_HIDE_WEAK").is_ok_and(|v| v == "1");
    let mut ctx = prompt.to_vec();
    let mut r = Run::default();
    let mut i = 0;
    while i < out.len() {
        let kk = ctl.next_k().min(k);
        let mut draft = if kk > 0 { d.propose_tokens(&ctx, kk) } else { Vec::new() };
        draft.truncate(kk);
        if kk > 0 {
            ctl.observe_draft(draft.len(), 0.0, 0.0);
        }
        let accepted = draft.iter().zip(&out[i..]).take_while(|(a, b)| a == b).count();
        let commit = (accepted + 1).min(out.len() - i);
        let rows = 1 + draft.len();
        let secs = 1.0 + row * (rows - 1) as f64;
        ctl.observe_forward(rows, secs);
        // NGRAM_REPLAY_HIDE_WEAK=1: drafts from one-token matches do not feed the controller.
        let weak = kk > 0 && d.pending_class().is_some_and(|c| c < 2);
        if !draft.is_empty() && (!hide_weak || !weak) {
            ctl.update(draft.len(), accepted);
        }
        ctx.extend_from_slice(&out[i..i + commit]);
        i += commit;
        r.steps += 1;
        r.drafted += draft.len();
        r.cost += secs;
    }
    r.tokens = out.len();
    r
}

/// (target steps, tokens committed) for one output under the copy oracle: each step drafts,
/// of every span of the context (an LZ77-style copy that may run into the tokens it drafts,
/// so periods repeat) and of `d`'s own draft (which adds counted-on numbers), the one that
/// matches the output furthest, up to `k` tokens. With `min_n` 0, tau here bounds any lookup
/// that copies from prompt + output (and a speed-up over AR cannot exceed it: a verify costs at
/// least one one-row forward); with `min_n` > 0, only copies that follow an earlier occurrence
/// of the context's last `min_n` tokens count: the best a lookup keyed on that suffix could do
/// by choosing among its matches.
fn replay_oracle(d: &NgramDrafter, prompt: &[u32], out: &[u32], k: usize, min_n: usize) -> (usize, usize) {
    let mut ctx = prompt.to_vec();
    let (mut steps, mut i) = (0, 0);
    while i < out.len() {
        let want = &out[i..(i + k).min(out.len())];
        let n = ctx.len();
        let mut best = 0;
        for j in 0..n {
            // With `min_n` > 0, only copies that follow an occurrence of the context's last
            // `min_n` tokens (what a lookup can find without knowing the output).
            if min_n > 0 && (j < min_n || ctx[j - min_n..j] != ctx[n - min_n..]) {
                continue;
            }
            // Copy from j onward; past the context's end the copy reads what it has drafted.
            let mut m = 0;
            while m < want.len() {
                let src = j + m;
                let t = if src < n { ctx[src] } else { want[src - n] };
                if t != want[m] {
                    break;
                }
                m += 1;
            }
            best = best.max(m);
            if best == want.len() {
                break;
            }
        }
        let draft = d.lookup(&ctx, k);
        best = best.max(draft.iter().zip(want).take_while(|(a, b)| a == b).count());
        let commit = (best + 1).min(out.len() - i);
        ctx.extend_from_slice(&out[i..i + commit]);
        i += commit;
        steps += 1;
    }
    (steps, out.len())
}

/// (target steps, tokens committed) for one output.
fn replay(d: &NgramDrafter, prompt: &[u32], out: &[u32], k: usize) -> (usize, usize) {
    let mut ctx = prompt.to_vec();
    let (mut steps, mut i) = (0, 0);
    while i < out.len() {
        let draft = d.lookup(&ctx, k);
        let accepted = draft.iter().zip(&out[i..]).take_while(|(a, b)| a == b).count();
        let commit = (accepted + 1).min(out.len() - i);
        ctx.extend_from_slice(&out[i..i + commit]);
        i += commit;
        steps += 1;
    }
    (steps, out.len())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let model = args
        .get(1)
        .context("usage: ngram_replay MODEL.gguf OUTPUTS.jsonl [K] [MIN_N] [MAX_N]")?;
    let outputs = args.get(2).context("missing OUTPUTS.jsonl")?;
    let num = |i: usize, default: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(default);
    let (k, min_n, max_n) = (num(3, 8), num(4, 2), num(5, 8));
    let bundle = specula_engine::bundle::load(model.as_ref(), &candle_core::Device::Cpu)?;
    let numbers = bundle.tokenizer.numbers();
    let full = NgramDrafter::new(min_n, max_n).with_numbers(numbers.clone());
    // One lookup per draft, numbers extrapolated.
    let no_wrap = NgramDrafter {
        wrap: false,
        ..full.clone()
    };
    // Structural matches only: the same matches, the continuation's numbers copied.
    let structural = NgramDrafter {
        extrapolate: false,
        ..no_wrap.clone()
    };
    let exact = NgramDrafter {
        wrap: false,
        ..NgramDrafter::new(min_n, max_n)
    };
    let variants = [
        ("exact", &exact),
        ("structural", &structural),
        ("numbers", &no_wrap),
        ("wrap", &full),
        ("oracle", &full),
        ("oracle/n1", &full),
        ("oracle/n2", &full),
    ];
    // The confidence cut (NGRAM_REPLAY_CONF: min_confidence, default 0.3) with min_n 2 and 1,
    // against both without it; NGRAM_REPLAY_ROW: modeled cost of a verify row (default 0.25 of
    // a one-row forward, the 2-vCPU Xeon's for the small models).
    let envf = |name: &str, default: f64| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    let (conf, row) = (envf("NGRAM_REPLAY_CONF", 0.3), envf("NGRAM_REPLAY_ROW", 0.25));
    let policy = |n: usize, c: f64| NgramDrafter {
        min_n: n,
        min_confidence: c,
        ..full.clone()
    };
    let policies = [
        (format!("n{min_n}"), policy(min_n, 0.0)),
        ("n1".to_string(), policy(1, 0.0)),
        (format!("n{min_n}+cut"), policy(min_n, conf)),
        ("n1+cut".to_string(), policy(1, conf)),
    ];
    let mut policy_kind: BTreeMap<String, Vec<(Run, Run)>> = BTreeMap::new();
    let mut by_kind: BTreeMap<String, Vec<(usize, usize)>> = BTreeMap::new();
    println!("k = {k}, n = {min_n}..={max_n}");
    for line in std::fs::read_to_string(outputs)?.lines() {
        let v: serde_json::Value = serde_json::from_str(line)?;
        let ids = |key: &str| -> Vec<u32> {
            v[key].as_array().map_or_else(Vec::new, |a| {
                a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect()
            })
        };
        let (prompt, out) = (ids("prompt_token_ids"), ids("token_ids"));
        let kind = v["kind"].as_str().unwrap_or("?").to_string();
        if args.get(6).is_some_and(|id| v["id"].as_str() == Some(id)) {
            let tok = &bundle.tokenizer;
            let mut ctx = prompt.clone();
            for i in 0..out.len() {
                let run = |d: &NgramDrafter| {
                    let draft = d.lookup(&ctx, k);
                    let n = draft.iter().zip(&out[i..]).take_while(|(a, b)| a == b).count();
                    (draft, n)
                };
                let ((ds, ns), (df, nf)) = (run(&no_wrap), run(&full));
                if nf < ns {
                    let tail = &ctx[ctx.len().saturating_sub(12)..];
                    println!(
                        "at {i}: after {:?} one lookup {:?} ({ns}) wrapped {:?} ({nf})",
                        tok.decode(tail),
                        tok.decode(&ds),
                        tok.decode(&df)
                    );
                }
                ctx.push(out[i]);
            }
        }
        let mut line_out = format!("{:>4} {:<13}", v["id"].as_str().unwrap_or("?"), kind);
        let acc = by_kind.entry(kind).or_insert_with(|| vec![(0, 0); variants.len()]);
        for (j, (name, d)) in variants.iter().enumerate() {
            let (steps, tokens) = if let Some(o) = name.strip_prefix("oracle") {
                let n = o.strip_prefix("/n").and_then(|n| n.parse().ok()).unwrap_or(0);
                replay_oracle(d, &prompt, &out, k, n)
            } else {
                replay(d, &prompt, &out, k)
            };
            acc[j].0 += steps;
            acc[j].1 += tokens;
            line_out += &format!(" | {name} {:.2}", tokens as f64 / steps.max(1) as f64);
        }
        println!("{line_out}");
        let acc = policy_kind
            .entry(v["kind"].as_str().unwrap_or("?").to_string())
            .or_insert_with(|| vec![(Run::default(), Run::default()); policies.len()]);
        for (j, (_, d)) in policies.iter().enumerate() {
            acc[j].0.add(replay_policy(d, &prompt, &out, k, false, row));
            acc[j].1.add(replay_policy(d, &prompt, &out, k, true, row));
        }
    }
    println!();
    println!("policies (cut at confidence {conf}, verify row {row}; x = modeled speed-up over AR):");
    for (kind, acc) in &policy_kind {
        for ((name, _), (fixed, adaptive)) in policies.iter().zip(acc) {
            println!(
                "{kind:<13} {name:<8} fixed k={k}: {} | adaptive: {}",
                fixed.cell(),
                adaptive.cell()
            );
        }
    }
    println!();
    for (kind, acc) in by_kind {
        let cells: Vec<String> = variants
            .iter()
            .zip(&acc)
            .map(|((name, _), (s, t))| format!("{name} {:.2}", *t as f64 / (*s).max(1) as f64))
            .collect();
        println!("{kind:<13} tau {}", cells.join(" | "));
    }
    Ok(())
}
