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
//! extrapolation, the lookup with numbers, and the full lookup (which also wraps a draft past
//! the context's end). With a prompt `ID`, also prints every position of that output where the
//! full lookup's draft is accepted less far than the one without wrapping, with both drafts.

use anyhow::{Context, Result};
use specula_engine::spec::ngram::NgramDrafter;
use std::collections::BTreeMap;

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
    ];
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
        let mut row = format!("{:>4} {:<13}", v["id"].as_str().unwrap_or("?"), kind);
        let acc = by_kind.entry(kind).or_insert_with(|| vec![(0, 0); variants.len()]);
        for (j, (name, d)) in variants.iter().enumerate() {
            let (steps, tokens) = replay(d, &prompt, &out, k);
            acc[j].0 += steps;
            acc[j].1 += tokens;
            row += &format!(" | {name} {:.2}", tokens as f64 / steps.max(1) as f64);
        }
        println!("{row}");
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
