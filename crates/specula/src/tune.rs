//! `specula tune`: measure plain decoding (AR) and every available drafter at k = 1..K (fixed)
//! and adaptive (k <= K) on a small built-in prompt set, check that each speculative output is
//! token-for-token identical to AR, and write `specula_tuning.json` (see
//! `specula_engine::tuning`) with every configuration's tok/s, tau and equivalence and the chosen
//! best: AR unless an output-equivalent configuration beats it by `--min-gain`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use specula_engine::inspect::{self, InspectOptions};
use specula_engine::speculative::{SpecMode, SpecOptions};
use specula_engine::tuning::{self, Build, Machine, TunedConfig, TuningFile};
use specula_engine::{ChatMessage, Engine, GenerateRequest, LoadOptions, SamplingParams};

use crate::pull;

/// The built-in prompt set: (name, user message).
const PROMPTS: [(&str, &str); 3] = [
    (
        "prose",
        "Write a short paragraph about a lighthouse keeper who finds a message in a bottle.",
    ),
    (
        "code",
        "Write a Python function `fib(n)` that returns the n-th Fibonacci number iteratively, with a docstring and two doctest examples.",
    ),
    (
        "easy-code",
        "Here is a Python class:\n\n```python\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __repr__(self):\n        return f\"Point({self.x}, {self.y})\"\n```\n\nRepeat the class exactly, and add a method `norm(self)` that returns the distance from the origin.",
    ),
];

#[derive(Args, Debug)]
pub struct TuneArgs {
    /// A GGUF file, a Hugging Face bundle directory, or a catalog name (pulled if missing).
    pub model: String,
    /// A draft model to measure as a drafter (GGUF file, bundle directory or catalog name).
    #[arg(long)]
    pub draft_model: Option<String>,
    /// Largest draft length measured (k = 1..=K, and adaptive with k <= K).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=32))]
    pub k_max: u64,
    /// Tokens generated per prompt.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_tokens: u64,
    /// A configuration is chosen only when it is at least this fraction faster than AR.
    #[arg(long, default_value_t = 0.03)]
    pub min_gain: f64,
    /// Where to write the tuning file (default: next to the bundle; in the cache for catalog
    /// models and read-only bundles).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the tuning file as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

/// The commit the binary was built from (`build.rs`), or "unknown".
pub fn build_commit() -> String {
    option_env!("SPECULA_BUILD_COMMIT")
        .filter(|s| !s.is_empty())
        .unwrap_or("unknown")
        .to_string()
}

struct Measured {
    tokens: Vec<Vec<u32>>,
    config: TunedConfig,
}

fn measure(engine: &mut Engine, prompts: &[Vec<u32>], spec: SpecOptions, max_tokens: usize) -> Result<Measured> {
    let mut tokens = Vec::new();
    let (mut gen, mut secs, mut committed, mut steps, mut drafted, mut accepted) = (0usize, 0f64, 0, 0, 0, 0);
    let mut per_prompt = Vec::new();
    let mut path = String::new();
    for p in prompts {
        let req = GenerateRequest {
            prompt_tokens: p.clone(),
            sampling: SamplingParams::greedy(),
            max_tokens: Some(max_tokens),
            stop: vec![],
            logprobs: None,
            ignore_eos: false,
            spec,
        };
        let out = engine.generate(&req, &mut |_| true)?;
        let s = &out.stats;
        // Decode rate: tokens after the first (which comes from the prefill) per decode second.
        let n = s.completion_tokens.saturating_sub(1);
        per_prompt.push(n as f64 / s.decode_s.max(1e-9));
        gen += n;
        secs += s.decode_s;
        committed += s.spec.committed;
        steps += s.spec.target_steps;
        drafted += s.spec.drafted;
        accepted += s.spec.accepted;
        if path.is_empty() {
            path = s.spec.decode_path.clone();
        }
        tokens.push(out.token_ids);
    }
    let (drafter, k) = match spec.mode {
        SpecMode::Off => ("ar", 0),
        SpecMode::Draft => ("draft", spec.draft_max),
        _ => ("ngram", spec.draft_max),
    };
    Ok(Measured {
        tokens,
        config: TunedConfig {
            drafter: drafter.to_string(),
            k,
            adaptive: spec.mode != SpecMode::Off && spec.adaptive,
            tok_s: gen as f64 / secs.max(1e-9),
            tau: if steps == 0 {
                0.0
            } else {
                committed as f64 / steps as f64
            },
            acceptance: if drafted == 0 {
                0.0
            } else {
                accepted as f64 / drafted as f64
            },
            equivalent: true,
            decode_path: path,
            per_prompt_tok_s: per_prompt,
        },
    })
}

/// Run `specula tune`.
pub fn run(a: TuneArgs) -> Result<()> {
    let path = pull::resolve_model(&a.model, true)?;
    let draft_path = a
        .draft_model
        .as_deref()
        .map(|m| pull::resolve_model(m, true))
        .transpose()?;
    let report = inspect::inspect(
        &path,
        &InspectOptions {
            draft_model: draft_path.clone(),
            ..Default::default()
        },
    )?;
    if let Some(e) = report.errors().next() {
        bail!("{}: cannot tune an incompatible bundle: {e}", path.display());
    }
    let t = std::time::Instant::now();
    let mut engine =
        Engine::load(&path, &a.model, LoadOptions::default()).with_context(|| format!("loading {}", path.display()))?;
    if let (Some(dp), Some(name)) = (&draft_path, &a.draft_model) {
        engine
            .attach_draft_model(dp, name)
            .with_context(|| format!("loading draft model {}", dp.display()))?;
    }
    tracing::info!("loaded in {:.1}s", t.elapsed().as_secs_f64());
    if !engine.batch_invariant() {
        tracing::warn!("this model's kernels are not batch-invariant: every speculative configuration decodes AR");
    }
    let max_tokens = a.max_tokens as usize;
    let mut names = Vec::new();
    let mut prompts: Vec<Vec<u32>> = Vec::new();
    for (name, p) in PROMPTS {
        let toks = engine.chat_prompt_tokens(&[ChatMessage::new("user", p)])?;
        if toks.len() + max_tokens > engine.context_length() {
            tracing::warn!(
                "prompt '{name}' ({} tokens) + {max_tokens} does not fit the {}-token context; skipped",
                toks.len(),
                engine.context_length()
            );
            continue;
        }
        names.push(name.to_string());
        prompts.push(toks);
    }
    if prompts.is_empty() {
        bail!(
            "no built-in prompt fits the model's context of {} tokens",
            engine.context_length()
        );
    }
    let k_max = a.k_max as usize;

    // Warm up (page in the weights, size the caches), then AR; AR again at the end, and the
    // faster of the two is the bar (drift on a shared machine must not favour speculation).
    let ar_spec = SpecOptions {
        mode: SpecMode::Off,
        ..Default::default()
    };
    measure(&mut engine, &prompts[..1], ar_spec, 16)?;
    let ar = measure(&mut engine, &prompts, ar_spec, max_tokens)?;
    eprintln!("{:<24} {:>8.1} tok/s", "ar", ar.config.tok_s);
    let mut specs = Vec::new();
    let mut drafters = vec![SpecMode::Ngram];
    if engine.draft_model_id().is_some() {
        drafters.push(SpecMode::Draft);
    }
    for &mode in &drafters {
        for k in 1..=k_max {
            specs.push(SpecOptions {
                mode,
                draft_max: k,
                adaptive: false,
                sampled_verify: Default::default(),
            });
        }
        specs.push(SpecOptions {
            mode,
            draft_max: k_max,
            adaptive: true,
            sampled_verify: Default::default(),
        });
    }
    let mut configs = vec![ar.config.clone()];
    for spec in specs {
        let mut m = measure(&mut engine, &prompts, spec, max_tokens)?;
        m.config.equivalent = m.tokens == ar.tokens;
        eprintln!(
            "{:<24} {:>8.1} tok/s  tau {:.2}  acceptance {:.2}  {}  [{}]",
            m.config.label(),
            m.config.tok_s,
            m.config.tau,
            m.config.acceptance,
            if m.config.equivalent {
                "identical to AR"
            } else {
                "DIFFERS FROM AR"
            },
            m.config.decode_path
        );
        configs.push(m.config);
    }
    let ar2 = measure(&mut engine, &prompts, ar_spec, max_tokens)?;
    eprintln!("{:<24} {:>8.1} tok/s (again)", "ar", ar2.config.tok_s);
    if ar2.tokens != ar.tokens {
        bail!("plain decoding is not deterministic on this build: two AR runs differ");
    }
    let mut ar_cfg = ar.config.clone();
    ar_cfg.tok_s = ar.config.tok_s.max(ar2.config.tok_s);
    ar_cfg.per_prompt_tok_s = ar
        .config
        .per_prompt_tok_s
        .iter()
        .zip(&ar2.config.per_prompt_tok_s)
        .map(|(x, y)| x.max(*y))
        .collect();
    configs[0] = ar_cfg.clone();
    let best = configs
        .iter()
        .skip(1)
        .filter(|c| c.equivalent && c.tok_s > ar_cfg.tok_s * (1.0 + a.min_gain))
        .max_by(|x, y| x.tok_s.total_cmp(&y.tok_s))
        .cloned()
        .unwrap_or_else(|| ar_cfg.clone());
    let draft_id = report.capabilities.draft_model.as_ref().map(|d| tuning::BundleId {
        path: d.path.clone(),
        bytes: d.weight_bytes,
        fingerprint: d.fingerprint.clone(),
    });
    let file = TuningFile {
        format: tuning::FORMAT,
        bundle: report.bundle_id(),
        draft_model: draft_id,
        machine: Machine::current(),
        build: Build {
            version: env!("CARGO_PKG_VERSION").to_string(),
            commit: build_commit(),
        },
        date: tuning::now_rfc3339(),
        prompts: names,
        max_tokens,
        min_gain: a.min_gain,
        configs,
        best: best.clone(),
    };
    let json = serde_json::to_string_pretty(&file)?;
    let target = a.out.clone().unwrap_or_else(|| tuning::write_location(&path));
    let written = write(&target, &json).or_else(|e| {
        let [_, cached] = tuning::locations(&path);
        if a.out.is_none() && cached != target {
            tracing::warn!("cannot write {}: {e:#}; writing to the cache instead", target.display());
            write(&cached, &json).map(|_| cached)
        } else {
            Err(e)
        }
    })?;
    if a.json {
        println!("{json}");
    }
    let speedup = best.tok_s / ar_cfg.tok_s.max(1e-9);
    eprintln!(
        "best: {} ({:.1} tok/s, {:.2}x AR{}); wrote {}",
        best.label(),
        best.tok_s,
        speedup,
        if best.drafter == "ar" {
            ": no output-equivalent configuration beat AR by the margin"
        } else {
            ""
        },
        written.display()
    );
    Ok(())
}

fn write(path: &std::path::Path, json: &str) -> Result<PathBuf> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
    Ok(path.to_path_buf())
}
