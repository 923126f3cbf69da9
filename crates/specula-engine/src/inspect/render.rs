//! The report as text (`specula inspect` without `--json`).

use super::*;

/// A layer plan in words, runs of equal layers counted: "30 x full attention, SwiGLU MLP".
fn layer_plan_line(plan: &[LayerPlan]) -> String {
    let words = |p: &LayerPlan| {
        let mut w = vec![match p.attention {
            AttentionKind::Full => "full attention".to_string(),
            AttentionKind::Sliding { window } => format!("sliding-window attention ({window})"),
        }];
        if p.qkv_bias {
            w.push("q/k/v bias".into());
        }
        if p.qk_norm {
            w.push("QK-norm".into());
        }
        w.push(
            match p.mlp {
                MlpKind::DenseSwiGlu => "SwiGLU MLP",
                MlpKind::DenseGeGlu => "GeGLU MLP",
                MlpKind::Moe => "MoE MLP",
                MlpKind::MoeShared => "MoE MLP with a shared expert",
            }
            .into(),
        );
        if p.post_norms {
            w.push("post-norms".into());
        }
        if p.parallel {
            w.push("in parallel from one norm".into());
        }
        w.join(", ")
    };
    let mut runs: Vec<(usize, &LayerPlan)> = Vec::new();
    for p in plan {
        match runs.last_mut() {
            Some((n, q)) if *q == p => *n += 1,
            _ => runs.push((1, p)),
        }
    }
    runs.iter()
        .map(|(n, p)| format!("{n} x {}", words(p)))
        .collect::<Vec<_>>()
        .join("; ")
}

fn millions(n: u64) -> String {
    if n >= 1_000_000_000 {
        format!("{:.2} B", n as f64 / 1e9)
    } else {
        format!("{:.1} M", n as f64 / 1e6)
    }
}

fn mode_line(m: &ModeResolution) -> String {
    let k = match (m.k, m.adaptive) {
        (None, _) => String::new(),
        (Some(k), true) => format!(" k<={k} adaptive"),
        (Some(k), false) => format!(" k={k}"),
    };
    format!("{}{k}: {}", m.drafter, m.reason)
}

impl std::fmt::Display for BundleReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use memory::human_bytes as hb;
        writeln!(f, "{} ({})", self.name, self.path)?;
        let files = self.files.len();
        writeln!(
            f,
            "  format         {} ({} weight file{}, {})",
            match self.format {
                BundleFormat::Gguf => "GGUF",
                BundleFormat::Hf => "Hugging Face (safetensors)",
            },
            files,
            if files == 1 { "" } else { "s" },
            hb(self.files.iter().map(|x| x.bytes).sum())
        )?;
        writeln!(
            f,
            "  architecture   {}{}",
            self.architecture.as_deref().unwrap_or("unknown"),
            match self.family {
                Some(fam) => format!(" (family {})", fam.as_str()),
                None => " (not supported)".to_string(),
            }
        )?;
        let n_tensors: usize = self.quantization.iter().map(|q| q.tensors).sum();
        writeln!(
            f,
            "  parameters     {} ({} tensors)",
            millions(self.parameters),
            n_tensors
        )?;
        let q: Vec<String> = self
            .quantization
            .iter()
            .map(|q| {
                format!(
                    "{} x{} ({} params, {})",
                    q.dtype,
                    q.tensors,
                    millions(q.parameters),
                    hb(q.bytes)
                )
            })
            .collect();
        writeln!(f, "  quantization   {}", q.join("; "))?;
        if let Some(c) = &self.config {
            writeln!(
                f,
                "  context        {} tokens; {} layers, hidden {}, {} heads / {} KV heads x {}, vocab {}",
                c.context_length, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size
            )?;
            if let Some(m) = &c.moe {
                let moe_layers = m.layers.iter().filter(|&&b| b).count();
                let shared = m
                    .shared_intermediate_size
                    .map_or(String::new(), |s| format!(", a shared expert of {s}"));
                writeln!(
                    f,
                    "  experts        {} per MoE layer ({moe_layers} of {} layers), {} active per token, expert FFN {}{shared}{}",
                    m.experts,
                    c.num_layers,
                    m.experts_per_token,
                    m.expert_intermediate_size,
                    if m.norm_topk_prob { ", top-k weights renormalized" } else { "" }
                )?;
                writeln!(
                    f,
                    "  active         {} of {} block parameters per token (attention, router, {} experts{})",
                    millions(c.block_params() as u64),
                    millions(c.total_block_params() as u64),
                    m.experts_per_token,
                    if m.shared_intermediate_size.is_some() {
                        ", shared expert"
                    } else {
                        ""
                    }
                )?;
            }
        }
        if !self.layer_plan.is_empty() {
            writeln!(f, "  layers         {}", layer_plan_line(&self.layer_plan))?;
        }
        let t = &self.tokenizer;
        if t.found {
            writeln!(
                f,
                "  tokenizer      {}, {} tokens{}, from {}",
                t.kind.as_deref().unwrap_or("?"),
                t.vocab_size.unwrap_or(0),
                t.merges.map(|m| format!(", {m} merges")).unwrap_or_default(),
                t.source.as_deref().unwrap_or("?")
            )?;
        } else {
            writeln!(f, "  tokenizer      not found")?;
        }
        writeln!(
            f,
            "  chat template  {}",
            self.chat_template
                .as_deref()
                .unwrap_or("none (ChatML where the vocabulary has its tokens; else chat is refused: completions only)")
        )?;
        if let Some(k) = &self.kernels {
            writeln!(
                f,
                "  kernels        {}: {}",
                if k.batch_invariant {
                    "batch-invariant"
                } else {
                    "not batch-invariant"
                },
                k.reason
            )?;
        }
        writeln!(f, "speculative capabilities")?;
        let m = &self.capabilities.mtp;
        writeln!(f, "  MTP head       {}", m.describe())?;
        match &self.capabilities.block_drafter {
            None => writeln!(f, "  block drafter  none")?,
            Some(b) => writeln!(f, "  block drafter  {}", b.describe())?,
        }
        match &self.capabilities.draft_model {
            None => writeln!(f, "  draft model    none configured (--draft-model)")?,
            Some(d) => writeln!(
                f,
                "  draft model    {} ({}, {} params, {}): {}",
                d.path,
                d.architecture.as_deref().unwrap_or("?"),
                millions(d.parameters),
                d.quantization,
                if d.compatible {
                    "compatible (same tokenizer, same vocabulary)".to_string()
                } else {
                    "INCOMPATIBLE (see diagnostics)".to_string()
                }
            )?,
        }
        writeln!(f, "  n-gram lookup  available")?;
        match &self.tuning {
            None => writeln!(f, "  tuning file    none (run `specula tune` to measure)")?,
            Some(t) => writeln!(
                f,
                "  tuning file    {}: {}{}",
                t.path,
                if t.applies {
                    format!(
                        "applies (measured {}, {} configs, best {})",
                        t.date.as_deref().unwrap_or("?"),
                        t.configs,
                        t.best.as_deref().unwrap_or("?")
                    )
                } else {
                    "does not apply".to_string()
                },
                t.reason.as_ref().map(|r| format!(": {r}")).unwrap_or_default()
            )?,
        }
        if let Some(m) = &self.memory {
            writeln!(f, "memory estimate")?;
            writeln!(
                f,
                "  resident after load {} (weights {} + runtime {})",
                hb(m.resident_after_load_bytes),
                hb(m.weights_bytes),
                hb(m.runtime_bytes)
            )?;
            writeln!(
                f,
                "  KV cache {} ({} tokens x {}/token, f16), scratch {}{}",
                hb(m.kv_bytes),
                m.kv_context,
                hb(m.kv_bytes_per_token),
                hb(m.scratch_bytes),
                if m.draft_model_bytes > 0 {
                    format!(", draft model {}", hb(m.draft_model_bytes))
                } else {
                    String::new()
                }
            )?;
            writeln!(
                f,
                "  total {} (available now: {})",
                hb(m.total_bytes),
                memory::available_memory().map(hb).unwrap_or_else(|| "unknown".into())
            )?;
        }
        writeln!(f, "tier: {}", self.tier.describe())?;
        writeln!(f, "effective mode")?;
        writeln!(f, "  off      {}", mode_line(&self.modes.off))?;
        writeln!(f, "  default  {}", mode_line(&self.modes.default))?;
        writeln!(f, "  on       {}", mode_line(&self.modes.on))?;
        if !self.diagnostics.is_empty() {
            writeln!(f, "diagnostics")?;
            for d in &self.diagnostics {
                writeln!(f, "  {d}")?;
            }
        }
        write!(f, "inspected in {:.0} ms (headers only)", self.elapsed_ms)
    }
}
