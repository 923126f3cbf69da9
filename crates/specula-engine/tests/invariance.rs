//! Batch invariance on the real catalog models: the logits of row i of a (k+1)-row forward (a
//! verify pass) are bitwise equal to a one-row decode forward at the same position, at a short
//! position and after a prefill of more than 1000 tokens, for k = 1..=8. This is the property
//! greedy speculation's exactness rests on (DESIGN.md, "The promise").
//!
//! A model that is not pulled is skipped with a note (`cargo run --release -- pull NAME`).
//! `cargo test --release -p specula-engine --test invariance -- --nocapture` prints timings;
//! `-- --ignored verify_cost` times a (k+1)-row forward against a one-row decode.

mod common;

use std::time::Instant;

use candle_core::Device;
use specula_engine::bundle;
use specula_engine::kv_cache::KvCache;
use specula_engine::model::{LogitsRows, Model};

const MODELS: [&str; 3] = [
    "smollm2-135m-instruct",
    "qwen2.5-coder-0.5b-instruct",
    "qwen2.5-coder-1.5b-instruct",
];

/// The largest draft length checked (verify passes of 2..=9 rows).
const MAX_K: usize = 8;

/// Load a catalog model, or `None` (with a note) when it is not pulled.
fn load(name: &str) -> Option<(Model, specula_engine::tokenizer::Tokenizer)> {
    let entry = specula_engine::catalog::lookup(name).unwrap_or_else(|| panic!("{name} is not in the catalog"));
    let path = specula_engine::cache::models_dir().join(entry.file_name);
    if !path.exists() {
        eprintln!(
            "SKIP {name}: {} is not pulled (run `cargo run --release -- pull {name}`)",
            path.display()
        );
        return None;
    }
    let b = bundle::load(&path, &Device::Cpu).expect("model loads");
    Some((b.model, b.tokenizer))
}

/// A real text of at least `n` tokens: the fixture prompts' texts, concatenated.
fn long_prompt(tok: &specula_engine::tokenizer::Tokenizer, n: usize) -> Vec<u32> {
    let mut text = String::new();
    for p in common::fixture_lines("prompts.jsonl") {
        for m in p["messages"].as_array().into_iter().flatten() {
            text.push_str(m["content"].as_str().unwrap_or(""));
            text.push_str("\n\n");
        }
    }
    let ids = tok.encode(&text).expect("tokenize");
    assert!(ids.len() >= n, "the fixture prompts give only {} tokens", ids.len());
    ids[..n].to_vec()
}

fn bits(row: &[f32]) -> Vec<u32> {
    row.iter().map(|v| v.to_bits()).collect()
}

fn rows(model: &Model, tokens: &[u32], kv: &mut KvCache, which: LogitsRows) -> Vec<Vec<f32>> {
    model
        .forward(tokens, kv, which, &[])
        .expect("forward")
        .logits
        .to_vec2()
        .expect("logits")
}

/// With `kv` holding `pos` tokens: one-row decodes of `next[0..=MAX_K]` (the reference), then for
/// every k a (k+1)-row forward of `next[0..=k]`, each compared row by row, bit for bit. Leaves
/// `kv` at `pos` tokens.
fn check_at(name: &str, model: &Model, kv: &mut KvCache, next: &[u32]) {
    let pos = kv.len();
    let decode: Vec<Vec<u32>> = next[..=MAX_K]
        .iter()
        .map(|&t| bits(&rows(model, &[t], kv, LogitsRows::Last)[0]))
        .collect();
    kv.truncate(pos);
    for k in 1..=MAX_K {
        let verify = rows(model, &next[..=k], kv, LogitsRows::All);
        kv.truncate(pos);
        assert_eq!(verify.len(), k + 1);
        for (i, row) in verify.iter().enumerate() {
            if bits(row) != decode[i] {
                let max = row
                    .iter()
                    .zip(&decode[i])
                    .map(|(a, &b)| (a - f32::from_bits(b)).abs())
                    .fold(0f32, f32::max);
                panic!(
                    "{name}: position {}: row {i} of a {}-row forward differs from the one-row decode (max |diff| {max})",
                    pos + i,
                    k + 1
                );
            }
        }
    }
}

fn check_model(name: &str) {
    let Some((model, tok)) = load(name) else {
        return;
    };
    assert!(
        model.batch_invariant(),
        "{name}: some projection is not on a batch-invariant kernel"
    );
    let (short, long) = (40, 1100);
    let ids = long_prompt(&tok, long + MAX_K + 1);
    let t0 = Instant::now();
    let mut kv = model.new_kv_cache();
    model
        .forward(&ids[..short], &mut kv, LogitsRows::None, &[])
        .expect("prefill");
    check_at(name, &model, &mut kv, &ids[short..]);
    let t1 = Instant::now();
    model
        .forward(&ids[short..long], &mut kv, LogitsRows::None, &[])
        .expect("prefill");
    let t2 = Instant::now();
    check_at(name, &model, &mut kv, &ids[long..]);
    eprintln!(
        "{name}: invariant at positions {short} and {long} for k = 1..={MAX_K} \
         (checks {:.1} s + {:.1} s, prefill of {} tokens {:.1} s)",
        (t1 - t0).as_secs_f64(),
        t2.elapsed().as_secs_f64(),
        long - short,
        (t2 - t1).as_secs_f64()
    );
}

#[test]
fn smollm2_verify_rows_equal_decode_rows() {
    check_model(MODELS[0]);
}

#[test]
fn qwen_0_5b_verify_rows_equal_decode_rows() {
    check_model(MODELS[1]);
}

#[test]
fn qwen_1_5b_verify_rows_equal_decode_rows() {
    check_model(MODELS[2]);
}

/// Process CPU time in seconds (all threads), where the platform gives it: on a shared machine
/// it is steadier than wall time, and with `RAYON_NUM_THREADS=1` it is the work done.
fn cpu_seconds() -> Option<f64> {
    #[cfg(target_os = "linux")]
    {
        #[repr(C)]
        struct Timespec {
            sec: i64,
            nsec: i64,
        }
        extern "C" {
            fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
        }
        const CLOCK_PROCESS_CPUTIME_ID: i32 = 2;
        let mut ts = Timespec { sec: 0, nsec: 0 };
        // SAFETY: `ts` is a valid out-pointer of the C layout clock_gettime writes.
        let rc = unsafe { clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
        (rc == 0).then_some(ts.sec as f64 + ts.nsec as f64 * 1e-9)
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// The cost of a verify pass: median wall time (and process CPU time) of a (k+1)-row forward
/// against a one-row decode at position 512, for k = 1, 3, 7. Run
/// `RAYON_NUM_THREADS=1 cargo test --release -p specula-engine --test invariance -- --ignored verify_cost --nocapture`
/// for the work ratio, without `RAYON_NUM_THREADS` for the 2-thread wall time.
#[test]
#[ignore]
fn verify_cost() {
    for name in MODELS {
        let Some((model, tok)) = load(name) else {
            continue;
        };
        let ids = long_prompt(&tok, 512 + 8);
        let mut kv = model.new_kv_cache();
        model
            .forward(&ids[..512], &mut kv, LogitsRows::None, &[])
            .expect("prefill");
        let time = |kv: &mut KvCache, n: usize, which: LogitsRows| {
            let (mut wall, mut cpu): (Vec<f64>, Vec<f64>) = (0..7)
                .map(|_| {
                    let (s, c) = (Instant::now(), cpu_seconds().unwrap_or(0.0));
                    model.forward(&ids[512..512 + n], kv, which, &[]).expect("forward");
                    kv.truncate(512);
                    (s.elapsed().as_secs_f64(), cpu_seconds().unwrap_or(0.0) - c)
                })
                .unzip();
            wall.sort_by(f64::total_cmp);
            cpu.sort_by(f64::total_cmp);
            (wall[wall.len() / 2], cpu[cpu.len() / 2])
        };
        let (one, one_cpu) = time(&mut kv, 1, LogitsRows::Last);
        let mut line = format!("{name}: 1 row {:.1} ms (cpu {:.1} ms)", one * 1e3, one_cpu * 1e3);
        for k in [1, 3, 7] {
            let (t, c) = time(&mut kv, k + 1, LogitsRows::All);
            line += &format!(
                " | {} rows {:.1} ms = {:.2}x (cpu {:.2}x)",
                k + 1,
                t * 1e3,
                t / one,
                c / one_cpu.max(1e-9)
            );
        }
        eprintln!("{line}");
    }
}
