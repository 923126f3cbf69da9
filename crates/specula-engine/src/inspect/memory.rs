//! Memory preflight: what a load will take (weights as held in memory, runtime tables, KV cache,
//! scratch), what the machine has (`/proc/meminfo` MemAvailable) and what the process holds
//! (`/proc/self/status` VmRSS).

use serde::Serialize;

use crate::model::ModelConfig;

/// The most rows a verify forward has (`engine::MAX_DRAFT` + 1).
const MAX_VERIFY_ROWS: u64 = crate::engine::MAX_DRAFT as u64 + 1;
/// Prompt tokens per prefill forward (`LoadOptions::default().prefill_chunk`).
const PREFILL_CHUNK: u64 = 512;

/// Estimated memory of one model load, in bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct MemoryEstimate {
    /// Weights as the loader holds them: quantized GGUF matrices as stored, norms and dense
    /// matrices as f32, Hugging Face tensors as f32, a tied LM head copied into its kernel's layout.
    pub weights_bytes: u64,
    /// RoPE tables (`context × head_dim × 4` bytes) and the tokenizer.
    pub runtime_bytes: u64,
    /// `weights_bytes + runtime_bytes`: the resident size right after loading (the KV cache grows
    /// on demand as tokens are processed).
    pub resident_after_load_bytes: u64,
    /// KV cache per token: `2 × layers × kv_heads × head_dim × 4` (f32 keys and values).
    pub kv_bytes_per_token: u64,
    /// Tokens of context the KV estimate covers (the model's context window unless asked).
    pub kv_context: usize,
    /// `kv_bytes_per_token × kv_context`.
    pub kv_bytes: u64,
    /// Activations of a prefill chunk (512 rows through the widest layer) and of a verify pass
    /// (33 rows of logits).
    pub scratch_bytes: u64,
    /// The same total for a configured draft model (its own weights, KV and scratch), else 0.
    pub draft_model_bytes: u64,
    /// Everything: resident after load + KV + scratch + draft model.
    pub total_bytes: u64,
}

/// Estimate a load of a model with `config` whose weights take `weights_bytes` in memory and
/// whose tokenizer has `vocab_tokens` tokens and `merges` BPE merges; the KV term covers
/// `kv_context` tokens (default: the context window).
pub fn estimate(
    config: &ModelConfig,
    weights_bytes: u64,
    vocab_tokens: usize,
    merges: usize,
    kv_context: Option<usize>,
) -> MemoryEstimate {
    let c = config;
    let ctx = kv_context.unwrap_or(c.context_length).min(c.context_length);
    // The sizes come from a file's header: saturating arithmetic, so a header with absurd
    // values gives an absurd (huge) estimate, never an overflow.
    let u = |x: usize| x as u64;
    let mul = |xs: &[u64]| xs.iter().fold(1u64, |a, &x| a.saturating_mul(x));
    let add = |xs: &[u64]| xs.iter().fold(0u64, |a, &x| a.saturating_add(x));
    let rope = mul(&[u(c.context_length), u(c.head_dim), 4]);
    // The tokenizers crate's BPE (vocab map, reverse map, merge map, added tokens, and our
    // special-token list), plus what the header strings leave in the allocator: ~175 bytes per
    // token and per merge, fitted to VmRSS after loading the catalog models (120-190 measured;
    // docs/perf.md, "Bundle inspection and memory").
    let tokenizer = mul(&[175, add(&[u(vocab_tokens), u(merges)])]);
    let runtime = add(&[rope, tokenizer]);
    let kv_tok = mul(&[
        2,
        u(c.num_layers),
        u(c.num_kv_heads),
        u(c.head_dim),
        crate::kv_cache::KV_ELEM_BYTES as u64,
    ]);
    let kv = mul(&[kv_tok, u(ctx)]);
    // The widest MLP activation of a row: the dense MLP's, or an MoE's experts run by one token
    // (and its shared expert).
    let moe_width = c.moe.as_ref().map_or(0, |m| {
        add(&[
            mul(&[u(m.experts_per_token), u(m.expert_intermediate_size)]),
            u(m.shared_intermediate_size.unwrap_or(0)),
        ])
    });
    let (h, i) = (u(c.hidden_size), u(c.intermediate_size).max(moe_width));
    let qkv = mul(&[add(&[u(c.num_heads), mul(&[2, u(c.num_kv_heads)])]), u(c.head_dim)]);
    // Per row: residual + normed input + attention output (4h), q/k/v, gate/up/product (3i), and
    // the int8 activation copies of our kernels (~h + i bytes).
    let per_row = add(&[mul(&[4, add(&[mul(&[4, h]), qkv, mul(&[3, i])])]), h, i]);
    let scratch = add(&[
        mul(&[PREFILL_CHUNK, per_row]),
        mul(&[MAX_VERIFY_ROWS, u(c.vocab_size), 4, 2]),
    ]);
    let resident = add(&[weights_bytes, runtime]);
    MemoryEstimate {
        weights_bytes,
        runtime_bytes: runtime,
        resident_after_load_bytes: resident,
        kv_bytes_per_token: kv_tok,
        kv_context: ctx,
        kv_bytes: kv,
        scratch_bytes: scratch,
        draft_model_bytes: 0,
        total_bytes: add(&[resident, kv, scratch]),
    }
}

fn proc_kb(file: &str, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(file).ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line[key.len()..]
        .trim_start_matches(':')
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// Memory available for new allocations without swapping (`MemAvailable` in `/proc/meminfo`),
/// in bytes; `None` where the file is absent (not Linux).
pub fn available_memory() -> Option<u64> {
    proc_kb("/proc/meminfo", "MemAvailable")
}

/// This process's resident set size (`VmRSS` in `/proc/self/status`), in bytes.
pub fn resident_bytes() -> Option<u64> {
    proc_kb("/proc/self/status", "VmRSS")
}

/// `1.23 GB`, `456.7 MB`, `12.0 KB` (decimal units).
pub fn human_bytes(b: u64) -> String {
    let b = b as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} KB", b / 1e3)
    } else {
        format!("{b} B")
    }
}

/// What the preflight does when the estimate exceeds available memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MemoryCheck {
    /// Don't check.
    Off,
    /// Log a warning with the numbers and load anyway (the default).
    #[default]
    Advisory,
    /// Refuse to load, with the numbers.
    Strict,
}

impl MemoryCheck {
    /// Parse `off|advisory|strict`.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "off" => Self::Off,
            "advisory" => Self::Advisory,
            "strict" => Self::Strict,
            _ => return None,
        })
    }
}

/// The outcome of a preflight that allows the load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preflight {
    /// The estimate's total, bytes.
    pub needed: u64,
    /// MemAvailable, bytes (`None`: unknown on this OS).
    pub available: Option<u64>,
    /// The estimate exceeds what is available (only possible in advisory mode).
    pub over: bool,
    /// One line with the numbers, for logs.
    pub summary: String,
}

/// Compare an estimate with available memory. Strict mode errors when the estimate exceeds
/// MemAvailable; advisory mode returns `over = true` and leaves the warning to the caller.
pub fn preflight(est: &MemoryEstimate, available: Option<u64>, check: MemoryCheck) -> anyhow::Result<Preflight> {
    let summary = format!(
        "estimated {} = weights {} + runtime {} + KV cache {} ({} tokens × {}/token, f16) + scratch {}{}; available {}",
        human_bytes(est.total_bytes),
        human_bytes(est.weights_bytes),
        human_bytes(est.runtime_bytes),
        human_bytes(est.kv_bytes),
        est.kv_context,
        human_bytes(est.kv_bytes_per_token),
        human_bytes(est.scratch_bytes),
        if est.draft_model_bytes > 0 {
            format!(" + draft model {}", human_bytes(est.draft_model_bytes))
        } else {
            String::new()
        },
        available.map(human_bytes).unwrap_or_else(|| "unknown".into()),
    );
    let over = check != MemoryCheck::Off && available.is_some_and(|a| est.total_bytes > a);
    if over && check == MemoryCheck::Strict {
        anyhow::bail!(
            "memory check (strict): the load needs more memory than is available: {summary}. \
             Free memory, use a smaller model, or pass --memory-check advisory to load anyway"
        );
    }
    Ok(Preflight {
        needed: est.total_bytes,
        available,
        over,
        summary,
    })
}
