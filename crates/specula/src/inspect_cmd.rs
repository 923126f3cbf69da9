//! `specula inspect`: the bundle report from headers only (see `specula_engine::inspect`), as
//! text or JSON; `--measure` also loads the model and compares the memory estimate with the
//! measured resident size.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use specula_engine::inspect::{self, memory, InspectOptions, Tier};
use specula_engine::{Engine, GenerateRequest, LoadOptions, SamplingParams};

use crate::pull;

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// A GGUF file, a Hugging Face bundle directory, or a catalog name (must be pulled: inspect
    /// never downloads).
    pub model: String,
    /// A draft model to check against the target (tokenizer, vocabulary).
    #[arg(long)]
    pub draft_model: Option<String>,
    /// A drafter sidecar: a block-drafter folder or an MTP sidecar (folder or .safetensors).
    #[arg(long)]
    pub drafter: Option<PathBuf>,
    /// Tokens of context for the KV-cache estimate (default: the model's context window).
    #[arg(long)]
    pub kv_context: Option<usize>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Also load the model and measure its resident size (VmRSS) after load, and after a prefill
    /// of `--measure-tokens` tokens, next to the estimate.
    #[arg(long)]
    pub measure: bool,
    /// Prompt tokens for `--measure` (0 = only measure after load).
    #[arg(long, default_value_t = 0)]
    pub measure_tokens: usize,
}

/// Run `specula inspect`. Exits non-zero (an error) when the tier is `incompatible`.
pub fn run(a: InspectArgs) -> Result<()> {
    let path = pull::resolve_model(&a.model, false)?;
    let draft = a
        .draft_model
        .as_deref()
        .map(|m| pull::resolve_model(m, false))
        .transpose()?;
    let opts = InspectOptions {
        draft_model: draft,
        drafter: a.drafter.clone(),
        kv_context: a.kv_context,
    };
    // Measure first, in a fresh process, so the baseline holds nothing of the inspection.
    let measured = if a.measure {
        Some(measure(&path, &opts, a.measure_tokens)?)
    } else {
        None
    };
    let report = inspect::inspect(&path, &opts)?;
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        if let (Some(m), Some(o)) = (measured, v.as_object_mut()) {
            o.insert("measured".into(), m);
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("{report}");
        if let Some(m) = measured {
            println!("measured: {}", serde_json::to_string_pretty(&m)?);
        }
    }
    if report.tier == Tier::Incompatible {
        let first = report.errors().next().map(|d| d.to_string()).unwrap_or_default();
        anyhow::bail!("{}: incompatible bundle: {first}", path.display());
    }
    Ok(())
}

/// Load the model and read VmRSS before and after, and after a prefill of `tokens` tokens.
fn measure(path: &std::path::Path, opts: &InspectOptions, tokens: usize) -> Result<serde_json::Value> {
    let before = memory::resident_bytes().unwrap_or(0);
    let t = std::time::Instant::now();
    let mut engine =
        Engine::load(path, "measure", LoadOptions::default()).with_context(|| format!("loading {}", path.display()))?;
    let load_s = t.elapsed().as_secs_f64();
    let after = memory::resident_bytes().unwrap_or(0);
    let report = inspect::inspect(path, opts)?;
    let est = report.memory.clone().unwrap_or_default();
    let mut v = serde_json::json!({
        "load_s": load_s,
        "vm_rss_before_load_bytes": before,
        "vm_rss_after_load_bytes": after,
        "loaded_bytes": after.saturating_sub(before),
        "estimate_resident_after_load_bytes": est.resident_after_load_bytes,
        "estimate_over_loaded": est.resident_after_load_bytes as f64 / after.saturating_sub(before).max(1) as f64,
        "estimate_over_vm_rss": est.resident_after_load_bytes as f64 / after.max(1) as f64,
    });
    if tokens > 0 {
        let n = tokens.min(engine.context_length().saturating_sub(2));
        let base = engine.tokenize("The harbour town woke slowly under a grey sky. ")?;
        let prompt: Vec<u32> = base.iter().copied().cycle().take(n).collect();
        let req = GenerateRequest {
            prompt_tokens: prompt,
            sampling: SamplingParams::greedy(),
            max_tokens: Some(1),
            stop: vec![],
            logprobs: None,
            ignore_eos: true,
            spec: Default::default(),
        };
        engine.generate(&req, &mut |_| true)?;
        let after_prefill = memory::resident_bytes().unwrap_or(0);
        let c = engine.config();
        let est_n = memory::estimate(
            c,
            est.weights_bytes,
            report.tokenizer.vocab_size.unwrap_or(0),
            report.tokenizer.merges.unwrap_or(0),
            Some(n),
        );
        if let Some(o) = v.as_object_mut() {
            o.insert("prefill_tokens".into(), n.into());
            o.insert("vm_rss_after_prefill_bytes".into(), after_prefill.into());
            o.insert(
                "estimate_with_kv_and_scratch_bytes".into(),
                (est_n.resident_after_load_bytes + est_n.kv_bytes + est_n.scratch_bytes).into(),
            );
            o.insert("estimate_kv_bytes".into(), est_n.kv_bytes.into());
        }
    }
    Ok(v)
}
