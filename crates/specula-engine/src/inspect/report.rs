//! The report [`super::inspect`] returns: what a bundle is, what Specula can do with it, what it
//! costs, and every problem found.

use super::*;

/// What to inspect besides the bundle itself.
#[derive(Debug, Clone, Default)]
pub struct InspectOptions {
    /// A draft model (GGUF file or bundle directory) configured for the target.
    pub draft_model: Option<PathBuf>,
    /// A drafter sidecar given by path: a block-drafter folder (its config.json has
    /// `block_size`), or an MTP sidecar (a folder or a `.safetensors` file with MTP tensors).
    pub drafter: Option<PathBuf>,
    /// Tokens of context for the KV-cache estimate (default: the model's context window).
    pub kv_context: Option<usize>,
}

/// How bad a diagnostic is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Loading (or using that drafter) fails.
    Error,
    /// Loads, but something is off (e.g. markers without tensors).
    Warning,
    /// Worth knowing.
    Info,
}

/// Which part of the bundle a diagnostic is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Component {
    Target,
    Mtp,
    Drafter,
    DraftModel,
    Tuning,
}

/// One problem found, naming the file and the field or tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Diagnostic {
    pub severity: Severity,
    pub component: Component,
    /// The file the problem is in (path as displayed).
    pub file: String,
    /// The field, key or tensor name (e.g. `hidden_size`, `fc.weight`); may be empty.
    pub subject: String,
    pub message: String,
}

/// `text` with every absolute path in it cut to its last component (`/home/u/.cache/specula/
/// models/x.gguf: bad magic` → `x.gguf: bad magic`): for messages that reach clients, which must
/// not learn the server's directories. A path runs from a `/` that starts a word to the next
/// whitespace, quote, comma or `: `.
pub fn redact_paths(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('/') {
        let word_start = at == 0 || rest[..at].ends_with([' ', '\'', '"', '(', '`', '=']);
        if !word_start {
            out.push_str(&rest[..=at]);
            rest = &rest[at + 1..];
            continue;
        }
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        let mut end = tail
            .find(|c: char| c.is_whitespace() || matches!(c, '\'' | '"' | ',' | ')' | '`'))
            .unwrap_or(tail.len());
        if let Some(colon) = tail[..end].find(": ") {
            end = end.min(colon);
        }
        if let Some(colon) = tail[..end].strip_suffix(':').map(str::len) {
            end = colon;
        }
        let path = &tail[..end];
        let last = path.trim_end_matches('/').rsplit('/').next().unwrap_or("");
        out.push_str(if last.is_empty() { "/" } else { last });
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

impl std::fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sev = match self.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
            Severity::Info => "info",
        };
        if self.subject.is_empty() {
            write!(f, "{sev}: {}: {}", self.file, self.message)
        } else {
            write!(f, "{sev}: {}: {}: {}", self.file, self.subject, self.message)
        }
    }
}

pub use crate::arch::BundleFormat;

/// One weight file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WeightFile {
    pub path: String,
    pub bytes: u64,
    pub tensors: usize,
}

/// Tensors of one type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct QuantGroup {
    /// `Q4_K`, `F32`, `BF16`, ...
    pub dtype: String,
    pub tensors: usize,
    pub parameters: u64,
    pub bytes: u64,
}

/// The tokenizer found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct TokenizerInfo {
    pub found: bool,
    /// `GGUF metadata (tokenizer.ggml.*)` or the tokenizer.json path.
    pub source: Option<String>,
    /// E.g. `gpt2 byte-level BPE, pre-tokenizer smollm`.
    pub kind: Option<String>,
    /// Tokens including added ones.
    pub vocab_size: Option<usize>,
    /// BPE merges.
    pub merges: Option<usize>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

/// The draft model configured for the target.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DraftModelReport {
    pub path: String,
    pub name: String,
    pub architecture: Option<String>,
    pub parameters: u64,
    pub weight_bytes: u64,
    /// E.g. `Q5_0 x133, Q8_0 x...`.
    pub quantization: String,
    /// LM-head rows.
    pub vocab_size: Option<usize>,
    /// Same tokenizer as the target (vocabulary, merges, special tokens, pre-tokenizer).
    pub tokenizer_match: bool,
    /// Loads and can draft for this target.
    pub compatible: bool,
    pub fingerprint: String,
}

/// A tuning file found for the bundle.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TuningReport {
    pub path: String,
    /// Measured on this machine, for this bundle (else `reason` says why not).
    pub applies: bool,
    pub reason: Option<String>,
    pub date: Option<String>,
    pub machine: Option<String>,
    pub commit: Option<String>,
    /// Configurations measured.
    pub configs: usize,
    /// The recorded best (`ar`, `ngram k=3`, ...).
    pub best: Option<String>,
    /// What `default` runs given the drafters configured now.
    pub choice: Option<TunedDefault>,
}

/// Kernel prediction: will greedy speculation be exact (and therefore used)?
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KernelReport {
    /// Every projection runs on a batch-invariant kernel (same rule as
    /// `Model::batch_invariant` after load).
    pub batch_invariant: bool,
    pub reason: String,
}

/// Speculative capabilities.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Capabilities {
    pub mtp: MtpReport,
    pub block_drafter: Option<BlockDrafterReport>,
    pub draft_model: Option<DraftModelReport>,
    /// n-gram prompt lookup needs no weights: available on every bundle.
    pub ngram: bool,
}

/// How much the bundle's speculation is known to help on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Tier {
    /// A tuning file measured on this machine for this bundle decides `default`.
    Verified,
    /// Exact speculation is possible, but nobody measured whether it pays here.
    CompatibleUnmeasured,
    /// Plain decoding only (kernels not batch-invariant, so speculation cannot be exact).
    ArOnly,
    /// The bundle (or its configured draft model) does not load.
    Incompatible,
}

impl Tier {
    pub fn describe(&self) -> &'static str {
        match self {
            Tier::Verified => "verified by a tuning file on this machine",
            Tier::CompatibleUnmeasured => "compatible but unmeasured",
            Tier::ArOnly => "AR only",
            Tier::Incompatible => "incompatible",
        }
    }
}

/// What one speculative mode runs on this bundle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModeResolution {
    /// `ar`, `ngram`, `draft-model`, `mtp` or `block`; the best model drafter of `default` /
    /// `on` (adaptive k) runs n-gram lookup beside it and ends in `+ngram`, as the requests'
    /// `spec_stats.decode_path` and `/v1/models`' `effective_spec` name it (a tuned choice
    /// runs its drafter alone).
    pub drafter: String,
    /// Draft length (cap when adaptive); `None` for AR.
    pub k: Option<usize>,
    pub adaptive: bool,
    /// Why this drafter.
    pub reason: String,
}

/// The effective drafter of each server-level mode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EffectiveModes {
    pub off: ModeResolution,
    pub default: ModeResolution,
    pub on: ModeResolution,
}

/// Everything [`inspect`] found.
#[derive(Debug, Clone, Serialize)]
pub struct BundleReport {
    pub path: String,
    pub format: BundleFormat,
    pub name: String,
    /// `general.architecture` (GGUF) or `model_type` (config.json), as written.
    pub architecture: Option<String>,
    /// The supported family it maps to (`None`: not supported).
    pub family: Option<Family>,
    /// The hyper-parameters the loader will use (when the family is supported and the config is
    /// complete).
    pub config: Option<ModelConfig>,
    /// Per layer, what the forward runs (from the architecture; empty without a config).
    pub layer_plan: Vec<LayerPlan>,
    pub context_length: Option<usize>,
    pub files: Vec<WeightFile>,
    /// Elements of every tensor in the weight files (MTP tensors included).
    pub parameters: u64,
    /// Bytes of tensor data on disk.
    pub weight_bytes: u64,
    /// Tensor types by parameter count, largest first.
    pub quantization: Vec<QuantGroup>,
    pub tokenizer: TokenizerInfo,
    /// Where the chat template was found (`None`: no template; ChatML is used).
    pub chat_template: Option<String>,
    pub kernels: Option<KernelReport>,
    pub capabilities: Capabilities,
    pub tuning: Option<TuningReport>,
    pub memory: Option<MemoryEstimate>,
    pub tier: Tier,
    pub modes: EffectiveModes,
    pub diagnostics: Vec<Diagnostic>,
    /// `fnv1a64:` hash of the tensor directory (names, types, shapes) and file sizes.
    pub fingerprint: String,
    /// Wall time of the inspection, milliseconds.
    pub elapsed_ms: f64,
}

impl BundleReport {
    /// Diagnostics of severity error.
    pub fn errors(&self) -> impl Iterator<Item = &Diagnostic> {
        self.diagnostics.iter().filter(|d| d.severity == Severity::Error)
    }

    /// The bundle's identity for tuning files.
    pub fn bundle_id(&self) -> BundleId {
        BundleId {
            path: self.path.clone(),
            bytes: self.files.iter().map(|f| f.bytes).sum(),
            fingerprint: self.fingerprint.clone(),
        }
    }

    pub(super) fn has_error(diags: &[Diagnostic], c: Component) -> bool {
        diags.iter().any(|d| d.severity == Severity::Error && d.component == c)
    }

    /// After serve attached its drafters: a native drafter this report found usable (MTP head
    /// [`MtpStatus::Present`] in a sidecar, block drafter `valid`) that the engine does not have
    /// (`mtp` / `block`: `Some(why)`, e.g. its load failed or the device leaves native drafters
    /// out) becomes [`MtpStatus::NotLoaded`] / `valid: false`, with a warning diagnostic carrying
    /// `why`, and the effective modes are resolved again without it (a tuning choice of that
    /// drafter no longer applies, as in the engine), so `/v1/models` says what runs. Returns
    /// whether anything changed.
    pub fn not_attached(&mut self, mtp: Option<&str>, block: Option<&str>) -> bool {
        let mut changed = false;
        let m = &mut self.capabilities.mtp;
        if let Some(why) = mtp.filter(|_| m.status == MtpStatus::Present && m.location.as_deref() != Some("trunk")) {
            m.status = MtpStatus::NotLoaded;
            drafters::push(
                &mut self.diagnostics,
                Component::Mtp,
                Severity::Warning,
                m.location.as_deref().unwrap_or_default(),
                "",
                format!("the MTP head was found but is not attached: {why}"),
            );
            changed = true;
        }
        if let (Some(b), Some(why)) = (self.capabilities.block_drafter.as_mut().filter(|b| b.valid), block) {
            b.valid = false;
            drafters::push(
                &mut self.diagnostics,
                Component::Drafter,
                Severity::Warning,
                &b.path,
                "",
                format!("the block drafter was found but is not attached: {why}"),
            );
            changed = true;
        }
        if changed {
            let d = &self.diagnostics;
            let draft_ok = self.capabilities.draft_model.as_ref().is_none_or(|m| m.compatible)
                && !Self::has_error(d, Component::DraftModel);
            let caps = &self.capabilities;
            let tuned = self
                .tuning
                .as_ref()
                .filter(|t| t.applies)
                .and_then(|t| t.choice.clone())
                .filter(|t| match t.mode {
                    SpecMode::Mtp => caps.mtp.status == MtpStatus::Present,
                    SpecMode::Block => caps.block_drafter.as_ref().is_some_and(|b| b.valid),
                    _ => true,
                });
            self.modes = resolve_modes(ResolveInput {
                target_ok: !Self::has_error(d, Component::Target),
                draft_ok,
                kernels: self.kernels.as_ref(),
                mtp: &self.capabilities.mtp,
                block: self.capabilities.block_drafter.as_ref(),
                draft_model: self.capabilities.draft_model.as_ref(),
                tuned: tuned.as_ref(),
            });
            self.diagnostics.sort_by_key(|d| d.severity);
        }
        changed
    }

    /// The `specula` capability summary shown in `/v1/models`.
    /// Served to clients (`/v1/models`), so files are named by their file names only: no
    /// server path reaches a response (the operator's logs and `specula inspect` keep them).
    pub fn capabilities_json(&self) -> Json {
        let mtp = &self.capabilities.mtp;
        let name = |p: &str| {
            std::path::Path::new(p)
                .file_name()
                .map_or_else(|| p.to_string(), |n| n.to_string_lossy().into_owned())
        };
        let named = |p: &Option<String>| p.as_deref().map(name);
        serde_json::json!({
            "format": self.format,
            "architecture": self.architecture,
            "parameters": self.parameters,
            "quantization": self.quantization.iter().map(|q| format!("{} x{}", q.dtype, q.tensors)).collect::<Vec<_>>(),
            "batch_invariant": self.kernels.as_ref().map(|k| k.batch_invariant),
            "mtp": {"status": mtp.status, "layout": mtp.layout, "location": named(&mtp.location), "depth": mtp.depth},
            "block_drafter": self.capabilities.block_drafter.as_ref().map(|b| serde_json::json!({
                "file": name(&b.path), "valid": b.valid, "block_size": b.block_size, "target_layer_ids": b.target_layer_ids})),
            "draft_model": self.capabilities.draft_model.as_ref().map(|d| serde_json::json!({
                "file": name(&d.path), "compatible": d.compatible, "tokenizer_match": d.tokenizer_match})),
            "ngram": self.capabilities.ngram,
            "tuning": self.tuning.as_ref().map(|t| serde_json::json!({
                "file": name(&t.path), "applies": t.applies, "reason": t.reason, "best": t.best, "date": t.date})),
            "tier": self.tier,
            "effective_modes": self.modes,
            "memory_estimate_bytes": self.memory.as_ref().map(|m| m.total_bytes),
            "diagnostics": self.diagnostics.iter().filter(|d| d.severity != Severity::Info).map(|d| redact_paths(&d.to_string())).collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod redact_tests {
    use super::redact_paths;

    #[test]
    fn absolute_paths_become_file_names() {
        for (text, want) in [
            ("/root/.cache/specula/models/x.gguf: bad magic", "x.gguf: bad magic"),
            (
                "warning: a.mtp: it does not load: /tmp/.tmpX/a.mtp/model.safetensors: layer 99",
                "warning: a.mtp: it does not load: model.safetensors: layer 99",
            ),
            ("reading '/etc/shadow' failed", "reading 'shadow' failed"),
            ("dir /srv/models/ is empty", "dir models is empty"),
            ("ratio 3/4 and a/b stay", "ratio 3/4 and a/b stay"),
            ("no paths here", "no paths here"),
            ("/", "/"),
        ] {
            assert_eq!(redact_paths(text), want, "{text}");
        }
    }
}
