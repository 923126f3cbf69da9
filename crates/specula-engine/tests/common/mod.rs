//! Shared helpers for tests that use the real catalog models.

#![allow(dead_code)]

use std::path::PathBuf;

use serde_json::Value;
use specula_engine::catalog;

/// Path of a pulled catalog model. Panics with the command to run when it is missing: these
/// tests must not pass silently without their model (`.ci/run` pulls every model first).
pub fn model_path(name: &str) -> PathBuf {
    let entry = catalog::lookup(name).unwrap_or_else(|| panic!("{name} is not in the catalog"));
    let path = specula_engine::cache::models_dir().join(entry.file_name);
    assert!(
        path.exists(),
        "model {name} is not pulled ({} missing): run `cargo run --release -- pull {name}` first",
        path.display()
    );
    path
}

/// Repository root (two levels above this crate).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Read a JSONL fixture under `tests/fixtures/`.
pub fn fixture_lines(rel: &str) -> Vec<Value> {
    let p = repo_root().join("tests/fixtures").join(rel);
    let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    s.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("fixture line is JSON"))
        .collect()
}

/// A trained native drafter committed under `heads/`: `heads/{model}.{kind}` (`mtp`: an MTP
/// head, `drafter`: a block drafter).
pub fn head_path(model: &str, kind: &str) -> PathBuf {
    let p = repo_root().join("heads").join(format!("{model}.{kind}"));
    assert!(
        p.exists(),
        "{} is missing (made by `specula distill`, see heads/README.md)",
        p.display()
    );
    p
}

/// A request of `prompt` with drafter `mode` at fixed draft length `k`: 100 tokens past EOS,
/// two logprobs per token (what the native-drafter and distill tests compare).
pub fn req(
    prompt: Vec<u32>,
    mode: specula_engine::speculative::SpecMode,
    k: usize,
    sampling: specula_engine::SamplingParams,
) -> specula_engine::GenerateRequest {
    specula_engine::GenerateRequest {
        prompt_tokens: prompt,
        sampling,
        max_tokens: Some(100),
        stop: vec![],
        logprobs: Some(2),
        ignore_eos: true,
        spec: specula_engine::speculative::SpecOptions {
            mode,
            draft_max: k,
            adaptive: false,
            sampled_verify: Default::default(),
        },
    }
}

/// Generate `r` to the end, ignoring the stream.
pub fn run(e: &mut specula_engine::Engine, r: &specula_engine::GenerateRequest) -> specula_engine::GenerateOutput {
    e.generate(r, &mut |_| true).expect("generate")
}

/// Two outputs agree on everything a client sees of them: text bytes, token ids, logprobs and
/// finish reason.
pub fn same(a: &specula_engine::GenerateOutput, b: &specula_engine::GenerateOutput, what: &str) {
    assert_eq!(a.text.as_bytes(), b.text.as_bytes(), "{what}: text");
    assert_eq!(a.token_ids, b.token_ids, "{what}: ids");
    assert_eq!(a.logprobs, b.logprobs, "{what}: logprobs");
    assert_eq!(a.finish_reason, b.finish_reason, "{what}: finish");
}

/// Start every request of `reqs` as one batch and step them together through
/// [`specula_engine::Engine::step`] until all finish (at most `max_steps` steps); returns the
/// outputs in request order.
pub fn run_batch(
    e: &mut specula_engine::Engine,
    reqs: &[specula_engine::GenerateRequest],
    max_steps: usize,
    what: &str,
) -> Vec<specula_engine::GenerateOutput> {
    let mut seqs: Vec<_> = reqs.iter().map(|r| e.start_sequence(r, None).expect("start")).collect();
    let mut steps = 0;
    while seqs.iter().any(|s| s.finished().is_none()) {
        let mut refs: Vec<_> = seqs.iter_mut().collect();
        for r in e.step(&mut refs) {
            r.expect("step");
        }
        steps += 1;
        assert!(steps < max_steps, "{what}: no progress");
    }
    seqs.into_iter().map(|s| e.retire(s, true)).collect()
}
