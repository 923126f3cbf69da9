//! Bundle inspection before load: what a bundle is, what Specula can do with it, and what it
//! will cost, read from configs and tensor *headers* only (GGUF metadata and tensor directory,
//! safetensors JSON headers, `config.json`, tokenizer files). No weight byte is read.
//!
//! [`inspect`] returns a [`BundleReport`] (serializable; `specula inspect --json` prints it and
//! the server shows its capability part in `/v1/models`):
//!
//! - family, architecture, parameter count, quantization mix, context length, tokenizer and chat
//!   template;
//! - speculative capabilities: a native MTP head in the trunk or a sidecar (DeepSeek-V3 layout:
//!   trailing `model.layers.{num_hidden_layers + i}` with `enorm`, `hnorm`, `eh_proj`,
//!   `shared_head`, or GGUF `blk.N.nextn.*`; Qwen3-Next layout: `mtp.fc`,
//!   `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.norm`, `mtp.layers.N.*`), config
//!   markers (`num_nextn_predict_layers`, `mtp_num_hidden_layers`, top level or in
//!   `text_config`; GGUF `{arch}.nextn_predict_layers`) with no tensors reported as "declared but
//!   absent"; a block drafter in `drafter/` (config.json with `block_size`, `target_layer_ids`,
//!   `hidden_size`, vocab) validated against the target; a draft model (tokenizer equality from
//!   metadata, LM-head rows); a tuning file ([`crate::tuning`]);
//! - a memory estimate ([`memory::MemoryEstimate`]);
//! - a [`Tier`] and the effective drafter of `off`, `default` and `on` ([`EffectiveModes`]);
//! - [`Diagnostic`]s naming the file and the field or tensor of every problem found.
//!
//! Problems with the bundle are diagnostics, not errors: [`inspect`] fails only when the path is
//! not a bundle at all.

pub mod drafters;
pub mod gguf;
pub mod memory;
mod modes;
mod render;
mod report;
pub mod safetensors;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::GgmlDType;
use serde::Serialize;
use serde_json::Value as Json;

use crate::arch::{Architecture, AttentionKind, Kind, LayerPlan, MlpKind, Role};
use crate::model::{Family, ModelConfig};
use crate::speculative::SpecMode;
use crate::tuning::{self, BundleId, Machine, TunedDefault};

pub use drafters::{sidecar_paths, BlockDrafterReport, MtpReport, MtpStatus};
pub use memory::MemoryEstimate;
pub use report::*;

use modes::{resolve_modes, ResolveInput};

// ---------------------------------------------------------------------------------------------
// Tensors from headers.

/// One tensor as a header describes it.
#[derive(Debug, Clone)]
pub struct TensorMeta {
    pub name: String,
    /// Outermost first (`[out, in]` for a projection, in both formats).
    pub dims: Vec<usize>,
    /// `Q4_K`, `F32`, `BF16`, ...
    pub dtype: String,
    /// The ggml type (GGUF only).
    pub ggml: Option<GgmlDType>,
    /// Bytes of data.
    pub bytes: u64,
    /// The file holding it.
    pub file: String,
}

impl TensorMeta {
    pub fn elements(&self) -> u64 {
        self.dims.iter().fold(1u64, |a, &d| a.saturating_mul(d as u64))
    }
}

/// The tensors of a bundle part, first occurrence of each name.
#[derive(Debug, Clone, Default)]
pub struct Tensors {
    pub list: Vec<TensorMeta>,
    by_name: HashMap<String, usize>,
}

impl Tensors {
    /// Add a tensor; `false` (and nothing added) when the name is already present.
    pub fn push(&mut self, t: TensorMeta) -> bool {
        if self.by_name.contains_key(&t.name) {
            return false;
        }
        self.by_name.insert(t.name.clone(), self.list.len());
        self.list.push(t);
        true
    }

    pub fn get(&self, name: &str) -> Option<&TensorMeta> {
        self.by_name.get(name).map(|&i| &self.list[i])
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }
}

/// Hyper-parameters read from a config regardless of whether the family is supported (MTP and
/// drafter checks need them for any architecture).
#[derive(Debug, Clone, Default)]
pub struct RawHyper {
    pub hidden: Option<usize>,
    /// Trunk layers (for GGUF: `block_count` minus any `nextn_predict_layers`).
    pub layers: Option<usize>,
    pub vocab: Option<usize>,
}

/// A config marker declaring MTP layers.
#[derive(Debug, Clone)]
pub struct Marker {
    pub file: String,
    pub key: String,
    pub value: usize,
}

/// Where a tokenizer's data is, for comparisons.
#[derive(Debug, Clone, Default)]
enum TokSource {
    #[default]
    None,
    /// The `tokenizer.ggml.*` metadata of a GGUF file.
    Gguf(HashMap<String, Value>),
    /// A tokenizer.json, with bos/eos/add_bos from tokenizer_config.json.
    Hf {
        path: PathBuf,
        bos: Option<String>,
        eos: Option<String>,
    },
}

/// One model's files read from headers: the target, or a draft model.
#[derive(Debug, Clone)]
pub struct Part {
    pub format: BundleFormat,
    /// The path as given.
    pub path: PathBuf,
    /// The directory sibling files (drafter/, mtp/, tuning) are looked up in.
    pub root: PathBuf,
    pub name: String,
    pub arch: Option<String>,
    /// The architecture that reads it (None: not supported).
    pub architecture: Option<&'static dyn Architecture>,
    pub family: Option<Family>,
    pub config: Option<ModelConfig>,
    pub hyper: RawHyper,
    pub files: Vec<WeightFile>,
    pub tensors: Tensors,
    pub tokenizer: TokenizerInfo,
    tok: TokSource,
    pub chat_template: Option<String>,
    pub markers: Vec<Marker>,
    pub diags: Vec<Diagnostic>,
    component: Component,
}

impl Part {
    fn diag(
        &mut self,
        severity: Severity,
        file: impl Into<String>,
        subject: impl Into<String>,
        message: impl Into<String>,
    ) {
        self.diags.push(Diagnostic {
            severity,
            component: self.component,
            file: file.into(),
            subject: subject.into(),
            message: message.into(),
        });
    }

    fn has_errors(&self) -> bool {
        self.diags.iter().any(|d| d.severity == Severity::Error)
    }

    /// The LM-head rows (vocabulary of the model), from the config or the embedding.
    pub fn vocab(&self) -> Option<usize> {
        self.config.as_ref().map(|c| c.vocab_size).or(self.hyper.vocab)
    }
}

/// Classify a path: (format, root dir, the GGUF file if any).
fn classify(path: &Path) -> anyhow::Result<(BundleFormat, PathBuf, Option<PathBuf>)> {
    if !path.exists() {
        anyhow::bail!("{}: no such file or directory", path.display());
    }
    if path.is_dir() {
        if path.join("config.json").exists() {
            return Ok((BundleFormat::Hf, path.to_path_buf(), None));
        }
        let entries: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .collect();
        let ggufs: Vec<&PathBuf> = entries
            .iter()
            .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
            .collect();
        if ggufs.len() == 1 {
            return Ok((BundleFormat::Gguf, path.to_path_buf(), Some(ggufs[0].clone())));
        }
        if ggufs.len() > 1 {
            anyhow::bail!(
                "{}: {} .gguf files; name the one to inspect",
                path.display(),
                ggufs.len()
            );
        }
        let has_st = entries.iter().any(|p| {
            p.extension().is_some_and(|x| x == "safetensors")
                || p.file_name().is_some_and(|n| n == "model.safetensors.index.json")
        });
        if has_st {
            // An HF bundle missing its config: reported as a diagnostic.
            return Ok((BundleFormat::Hf, path.to_path_buf(), None));
        }
        anyhow::bail!(
            "{}: not a bundle (no config.json, no safetensors, and not exactly one .gguf file)",
            path.display()
        );
    }
    let mut magic = [0u8; 4];
    let ok = match crate::bundle::open_file(path) {
        Ok(mut f) => std::io::Read::read_exact(&mut f, &mut magic).is_ok(),
        Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => anyhow::bail!("{}: {e}", path.display()),
        Err(_) => false,
    };
    if ok && &magic == b"GGUF" {
        let root = path
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        return Ok((BundleFormat::Gguf, root, Some(path.to_path_buf())));
    }
    if path.extension().is_some_and(|x| x == "safetensors") {
        anyhow::bail!(
            "{}: a lone safetensors file is not a bundle; give its directory (config.json, tokenizer.json)",
            path.display()
        );
    }
    anyhow::bail!(
        "{}: not a GGUF file (bad magic) and not a bundle directory",
        path.display()
    )
}

fn read_json(path: &Path) -> Result<Json, String> {
    let s = crate::bundle::read_text(path).map_err(|e| e.to_string())?;
    serde_json::from_str(&s).map_err(|e| format!("invalid JSON: {e}"))
}

/// The family a supported architecture gives a bundle named `name` (a member of the dense
/// Llama family, or the architecture itself).
fn family_of(arch: Option<&'static dyn Architecture>, name: &str) -> Option<Family> {
    arch.map(|a| Family::parse(name).unwrap_or(Family::Other(a.name())))
}

fn json_usize(c: &Json, key: &str) -> Option<usize> {
    c.get(key).and_then(Json::as_u64).and_then(|x| usize::try_from(x).ok())
}

/// Read one model's headers (target or draft model) into a [`Part`]. Errors only when `path` is
/// not a bundle at all; every other problem is a diagnostic.
pub fn read_part(path: &Path, component: Component) -> anyhow::Result<Part> {
    let (format, root, gguf_file) = classify(path)?;
    let mut part = Part {
        format,
        path: path.to_path_buf(),
        root,
        name: String::new(),
        arch: None,
        architecture: None,
        family: None,
        config: None,
        hyper: RawHyper::default(),
        files: Vec::new(),
        tensors: Tensors::default(),
        tokenizer: TokenizerInfo::default(),
        tok: TokSource::None,
        chat_template: None,
        markers: Vec::new(),
        diags: Vec::new(),
        component,
    };
    match gguf_file {
        Some(f) => read_gguf_part(&mut part, &f),
        None => read_hf_part(&mut part),
    }
    check_trunk_tensors(&mut part);
    Ok(part)
}

fn read_gguf_part(part: &mut Part, file: &Path) {
    let fname = file.display().to_string();
    part.name = file
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let scan = match gguf::scan(file) {
        Ok(s) => s,
        Err(e) => {
            let msg = format!("{e:#}");
            let msg = msg.strip_prefix(&format!("{fname}: ")).unwrap_or(&msg).to_string();
            part.diag(Severity::Error, &fname, "header", msg);
            return;
        }
    };
    for p in gguf::validate(&scan) {
        let sev = if p.fatal { Severity::Error } else { Severity::Warning };
        part.diag(sev, &fname, &p.tensor, p.message);
    }
    part.files.push(WeightFile {
        path: fname.clone(),
        bytes: scan.file_len,
        tensors: scan.tensors.len(),
    });
    for t in &scan.tensors {
        part.tensors.push(TensorMeta {
            name: t.name.clone(),
            dims: t.dims.clone(),
            dtype: gguf::type_name(t.type_id),
            ggml: t.dtype,
            bytes: t.data_bytes().unwrap_or(0),
            file: fname.clone(),
        });
    }
    let md = &scan.metadata;
    if let Some(n) = gguf::meta_str(md, "general.name") {
        part.name = n.to_string();
    }
    let Some(arch) = gguf::meta_str(md, "general.architecture").map(str::to_string) else {
        part.diag(
            Severity::Error,
            &fname,
            "general.architecture",
            "missing metadata key (the architecture)",
        );
        return;
    };
    part.arch = Some(arch.clone());
    part.architecture = crate::arch::by_gguf(&arch);
    part.family = family_of(part.architecture, &arch);
    let nextn = gguf::meta_usize(md, &format!("{arch}.nextn_predict_layers"));
    if let Some(n) = nextn {
        part.markers.push(Marker {
            file: fname.clone(),
            key: format!("{arch}.nextn_predict_layers"),
            value: n,
        });
    }
    let schema = part.architecture.unwrap_or(&crate::arch::llama::Llama).tensors();
    let embd = crate::arch::spec(schema, Role::TokenEmbedding).name(BundleFormat::Gguf, 0);
    part.hyper = RawHyper {
        hidden: gguf::meta_usize(md, &format!("{arch}.embedding_length")),
        layers: gguf::meta_usize(md, &format!("{arch}.block_count")).map(|b| b.saturating_sub(nextn.unwrap_or(0))),
        vocab: part.tensors.get(&embd).and_then(|t| t.dims.first().copied()),
    };
    let mut missing = false;
    match part.architecture {
        None => part.diag(
            Severity::Error,
            &fname,
            "general.architecture",
            format!(
                "'{arch}' is not supported ({})",
                crate::arch::supported(BundleFormat::Gguf)
            ),
        ),
        Some(a) => {
            for k in a.gguf_required_keys() {
                let key = format!("{arch}.{k}");
                if gguf::meta_usize(md, &key).is_none() {
                    part.diag(
                        Severity::Error,
                        &fname,
                        &key,
                        "missing (or not an integer) metadata key",
                    );
                    missing = true;
                }
            }
        }
    }
    if part.tensors.get(&embd).is_none() {
        part.diag(Severity::Error, &fname, &embd, "missing tensor (the token embedding)");
        missing = true;
    }
    // Tokenizer.
    let model = gguf::meta_str(md, "tokenizer.ggml.model");
    let pre = gguf::meta_str(md, "tokenizer.ggml.pre").unwrap_or("default");
    let n_tokens = gguf::meta_array_len(md, "tokenizer.ggml.tokens");
    let n_merges = gguf::meta_array_len(md, "tokenizer.ggml.merges");
    let token_str = |key: &str| -> Option<String> {
        let id = gguf::meta_usize(md, key)?;
        match md.get("tokenizer.ggml.tokens")? {
            Value::Array(a) => match a.get(id)? {
                Value::String(s) => Some(s.clone()),
                _ => None,
            },
            _ => None,
        }
    };
    part.tokenizer = TokenizerInfo {
        found: n_tokens.is_some(),
        source: n_tokens.map(|_| "GGUF metadata (tokenizer.ggml.*)".to_string()),
        kind: model.map(|m| {
            if m == "gpt2" {
                format!("gpt2 byte-level BPE, pre-tokenizer {pre}")
            } else if m == "llama" {
                "llama SentencePiece BPE (scores, byte fallback)".to_string()
            } else {
                m.to_string()
            }
        }),
        vocab_size: n_tokens,
        merges: n_merges,
        bos_token: token_str("tokenizer.ggml.bos_token_id"),
        eos_token: token_str("tokenizer.ggml.eos_token_id"),
    };
    match model {
        None => part.diag(
            Severity::Error,
            &fname,
            "tokenizer.ggml.model",
            "missing metadata key: the file has no tokenizer",
        ),
        Some(m) if crate::tokenizer::GGUF_MODELS.contains(&m) => {}
        Some(m) => part.diag(
            Severity::Error,
            &fname,
            "tokenizer.ggml.model",
            format!(
                "'{m}' is not supported (supported: {})",
                crate::tokenizer::GGUF_MODELS.join(", ")
            ),
        ),
    }
    if model.is_some() {
        if n_tokens.is_none() {
            part.diag(
                Severity::Error,
                &fname,
                "tokenizer.ggml.tokens",
                "missing (or not an array)",
            );
        }
        if model == Some("gpt2") && n_merges.is_none() {
            part.diag(
                Severity::Error,
                &fname,
                "tokenizer.ggml.merges",
                "missing (or not an array)",
            );
        }
        if model == Some("llama") && gguf::meta_array_len(md, "tokenizer.ggml.scores").is_none() {
            part.diag(
                Severity::Error,
                &fname,
                "tokenizer.ggml.scores",
                "missing (or not an array)",
            );
        }
        if model == Some("gpt2") {
            if let Err(e) = crate::tokenizer::pre_tokenizer_regexes(pre) {
                part.diag(Severity::Error, &fname, "tokenizer.ggml.pre", format!("{e}"));
            }
        }
    }
    if let Some(src) = gguf::meta_str(md, "tokenizer.chat_template") {
        let bos = part.tokenizer.bos_token.clone().unwrap_or_default();
        let eos = part.tokenizer.eos_token.clone().unwrap_or_default();
        match crate::chat::ChatTemplate::new(src, &bos, &eos) {
            Ok(_) => part.chat_template = Some("tokenizer.chat_template (GGUF metadata)".to_string()),
            Err(e) => part.diag(
                Severity::Error,
                &fname,
                "tokenizer.chat_template",
                format!("does not compile: {e}"),
            ),
        }
    }
    // The loader's config, read by the same code.
    if let (Some(a), false) = (part.architecture, missing) {
        let tensors = &part.tensors;
        let config = a
            .config_from_gguf(&arch, md, &|n: &str| tensors.get(n).map(|t| t.dims.clone()))
            .map_err(|e| ("metadata".to_string(), e))
            .and_then(|c| {
                crate::arch::check_layer_count(a, &c, BundleFormat::Gguf, &|n| tensors.get(n).is_some())
                    .map(|()| c)
                    .map_err(|e| (format!("{arch}.block_count"), e))
            });
        match config {
            Ok(c) => part.config = Some(c),
            Err((subject, e)) => part.diag(Severity::Error, &fname, subject, format!("{e:#}")),
        }
    }
    let tok_md: HashMap<String, Value> = scan
        .metadata
        .into_iter()
        .filter(|(k, _)| k.starts_with("tokenizer.ggml."))
        .collect();
    part.tok = TokSource::Gguf(tok_md);
}

fn read_hf_part(part: &mut Part) {
    let dir = part.root.clone();
    part.name = dir
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let cfg_path = dir.join("config.json");
    let cfg_file = cfg_path.display().to_string();
    let root = if !cfg_path.exists() {
        part.diag(
            Severity::Error,
            &cfg_file,
            "",
            "missing config.json (the model's hyper-parameters)",
        );
        None
    } else {
        match read_json(&cfg_path) {
            Ok(j) if j.is_object() => Some(j),
            Ok(_) => {
                part.diag(Severity::Error, &cfg_file, "", "is not a JSON object");
                None
            }
            Err(e) => {
                part.diag(Severity::Error, &cfg_file, "", e);
                None
            }
        }
    };
    if let Some(root) = &root {
        let c = root.get("text_config").unwrap_or(root);
        for (scope, obj) in [("", root), ("text_config.", c)] {
            if scope == "text_config." && std::ptr::eq(obj, root) {
                continue;
            }
            for key in ["num_nextn_predict_layers", "mtp_num_hidden_layers"] {
                if let Some(v) = json_usize(obj, key) {
                    part.markers.push(Marker {
                        file: cfg_file.clone(),
                        key: format!("{scope}{key}"),
                        value: v,
                    });
                }
            }
        }
        part.hyper = RawHyper {
            hidden: json_usize(c, "hidden_size"),
            layers: json_usize(c, "num_hidden_layers"),
            vocab: json_usize(c, "vocab_size"),
        };
        match c.get("model_type").and_then(Json::as_str) {
            None => part.diag(
                Severity::Error,
                &cfg_file,
                "model_type",
                "missing field (the architecture)",
            ),
            Some(mt) => {
                part.arch = Some(mt.to_string());
                part.architecture = crate::arch::by_hf(mt);
                part.family = family_of(part.architecture, mt);
                if part.architecture.is_none() {
                    part.diag(
                        Severity::Error,
                        &cfg_file,
                        "model_type",
                        format!("'{mt}' is not supported ({})", crate::arch::supported(BundleFormat::Hf)),
                    );
                }
            }
        }
        let mut complete = true;
        for k in part.architecture.map_or(&[][..], |a| a.hf_required_fields()) {
            if json_usize(c, k).is_none() {
                part.diag(Severity::Error, &cfg_file, *k, "missing or non-integer field");
                complete = false;
            }
        }
        if part.architecture.is_some() && complete {
            match crate::bundle::hf::read_config(&dir) {
                Ok(c) => part.config = Some(c),
                Err(e) => part.diag(Severity::Error, &cfg_file, "", format!("{e:#}")),
            }
        }
    }
    read_hf_weights(part, &dir);
    if let (Some(a), Some(c)) = (part.architecture, &part.config) {
        let tensors = &part.tensors;
        if let Err(e) = crate::arch::check_layer_count(a, c, BundleFormat::Hf, &|n| tensors.get(n).is_some()) {
            part.diag(Severity::Error, &cfg_file, "num_hidden_layers", format!("{e:#}"));
            part.config = None;
        }
    }
    read_hf_tokenizer(part, &dir);
}

/// The safetensors files of an HF directory, with index checks; adds their tensors.
fn read_hf_weights(part: &mut Part, dir: &Path) {
    let index = dir.join("model.safetensors.index.json");
    let index_file = index.display().to_string();
    let mut files: Vec<PathBuf> = Vec::new();
    let mut index_map: Vec<(String, String)> = Vec::new();
    if index.exists() {
        match read_json(&index) {
            Err(e) => part.diag(Severity::Error, &index_file, "", e),
            Ok(j) => match j.get("weight_map").and_then(Json::as_object) {
                None => part.diag(Severity::Error, &index_file, "weight_map", "missing object"),
                Some(m) => {
                    for (tensor, shard) in m {
                        match shard.as_str() {
                            Some(s) => index_map.push((tensor.clone(), s.to_string())),
                            None => part.diag(
                                Severity::Error,
                                &index_file,
                                format!("weight_map.{tensor}"),
                                "is not a file name",
                            ),
                        }
                    }
                    let mut shards: Vec<&String> = index_map.iter().map(|(_, s)| s).collect();
                    shards.sort();
                    shards.dedup();
                    for s in shards {
                        let p = dir.join(s);
                        if p.is_file() {
                            files.push(p);
                        } else {
                            let example = index_map
                                .iter()
                                .find(|(_, x)| x == s)
                                .map(|(t, _)| t.clone())
                                .unwrap_or_default();
                            part.diag(
                                Severity::Error,
                                &index_file,
                                format!("weight_map.{example}"),
                                format!("names shard '{s}', which does not exist in {}", dir.display()),
                            );
                        }
                    }
                }
            },
        }
    } else if dir.join("model.safetensors").is_file() {
        files.push(dir.join("model.safetensors"));
    } else {
        part.diag(
            Severity::Error,
            dir.display().to_string(),
            "",
            "no model.safetensors or model.safetensors.index.json",
        );
    }
    add_safetensors(part, &files);
    // Every tensor the index names must be in the shard it names.
    for (tensor, shard) in &index_map {
        let shard_path = dir.join(shard).display().to_string();
        match part.tensors.get(tensor) {
            Some(t) if t.file == shard_path => {}
            Some(t) => {
                let msg = format!("the index puts it in '{shard}', but it is in {}", t.file);
                part.diag(Severity::Warning, &index_file, tensor, msg);
            }
            None if files.iter().any(|f| f.display().to_string() == shard_path) => {
                part.diag(
                    Severity::Error,
                    &index_file,
                    tensor,
                    format!("named by the index, but missing from {shard_path}"),
                );
            }
            None => {}
        }
    }
}

/// Scan safetensors files into a part's tensors (duplicates across files are errors).
fn add_safetensors(part: &mut Part, files: &[PathBuf]) {
    for f in files {
        let fname = f.display().to_string();
        let scan = match safetensors::scan(f) {
            Ok(s) => s,
            Err(e) => {
                let msg = format!("{e:#}");
                let msg = msg.strip_prefix(&format!("{fname}: ")).unwrap_or(&msg).to_string();
                part.diag(Severity::Error, &fname, "header", msg);
                continue;
            }
        };
        for p in safetensors::validate(&scan) {
            part.diag(Severity::Error, &fname, &p.tensor, p.message);
        }
        part.files.push(WeightFile {
            path: fname.clone(),
            bytes: scan.file_len,
            tensors: scan.tensors.len(),
        });
        // transformers 5's fused experts stand for the per-expert tensors the loader reads.
        let mut fused_errors = Vec::new();
        let tensors: Vec<_> = scan
            .tensors
            .into_iter()
            .flat_map(|t| {
                let bytes = t.data_offsets.1.saturating_sub(t.data_offsets.0);
                match safetensors::split_fused_experts(&t.name, &t.dims) {
                    Err(e) => {
                        fused_errors.push((t.name.clone(), e));
                        vec![(t.name, t.dims, t.dtype, bytes)]
                    }
                    Ok(Some(slices)) => {
                        let per = bytes / t.elements().max(1);
                        slices
                            .into_iter()
                            .map(|s| {
                                let b = per * s.dims.iter().product::<usize>() as u64;
                                (s.name, s.dims, t.dtype.clone(), b)
                            })
                            .collect::<Vec<_>>()
                    }
                    Ok(None) => vec![(t.name, t.dims, t.dtype, bytes)],
                }
            })
            .collect();
        for (name, e) in fused_errors {
            part.diag(Severity::Error, &fname, &name, e);
        }
        for (tname, dims, dtype, bytes) in tensors {
            let name = tname.clone();
            let meta = TensorMeta {
                name: tname,
                dims,
                dtype,
                ggml: None,
                bytes,
                file: fname.clone(),
            };
            if let Some(prev) = part.tensors.get(&name) {
                if prev.file != fname {
                    let msg = format!("also in {}: duplicate tensor across weight files", prev.file);
                    part.diag(Severity::Error, &fname, &name, msg);
                }
            } else {
                part.tensors.push(meta);
            }
        }
    }
}

fn token_string(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_string),
        _ => None,
    }
}

fn read_hf_tokenizer(part: &mut Part, dir: &Path) {
    let tok_cfg_path = dir.join("tokenizer_config.json");
    let tok_cfg = if tok_cfg_path.exists() {
        match read_json(&tok_cfg_path) {
            Ok(j) => j,
            Err(e) => {
                part.diag(Severity::Error, tok_cfg_path.display().to_string(), "", e);
                Json::Null
            }
        }
    } else {
        Json::Null
    };
    let gen_cfg = dir.join("generation_config.json");
    if gen_cfg.exists() {
        if let Err(e) = read_json(&gen_cfg) {
            part.diag(Severity::Error, gen_cfg.display().to_string(), "", e);
        }
    }
    let bos = token_string(tok_cfg.get("bos_token"));
    let eos = token_string(tok_cfg.get("eos_token"));
    let tj = dir.join("tokenizer.json");
    let tj_file = tj.display().to_string();
    if !tj.exists() {
        part.diag(
            Severity::Error,
            &tj_file,
            "",
            "missing tokenizer.json (the loader needs it; GGUF bundles carry theirs in metadata)",
        );
    } else {
        match read_json(&tj) {
            Err(e) => part.diag(Severity::Error, &tj_file, "", e),
            Ok(j) => {
                let vocab = j.pointer("/model/vocab").and_then(Json::as_object);
                let max_added = j
                    .get("added_tokens")
                    .and_then(Json::as_array)
                    .map(|a| {
                        a.iter()
                            .filter_map(|t| json_usize(t, "id"))
                            .map(|i| i + 1)
                            .max()
                            .unwrap_or(0)
                    })
                    .unwrap_or(0);
                let max_vocab = vocab
                    .map(|v| {
                        v.values()
                            .filter_map(Json::as_u64)
                            .map(|i| i as usize + 1)
                            .max()
                            .unwrap_or(0)
                    })
                    .unwrap_or(0);
                let kind = j.pointer("/model/type").and_then(Json::as_str).map(str::to_string);
                if vocab.is_none() {
                    part.diag(Severity::Error, &tj_file, "model.vocab", "missing vocabulary object");
                }
                part.tokenizer = TokenizerInfo {
                    found: vocab.is_some(),
                    source: Some(tj_file.clone()),
                    kind,
                    vocab_size: Some(max_vocab.max(max_added)),
                    merges: j.pointer("/model/merges").and_then(Json::as_array).map(Vec::len),
                    bos_token: bos.clone(),
                    eos_token: eos.clone(),
                };
                part.tok = TokSource::Hf {
                    path: tj.clone(),
                    bos: bos.clone(),
                    eos: eos.clone(),
                };
            }
        }
    }
    let jinja = dir.join("chat_template.jinja");
    let (src, origin) = if jinja.exists() {
        match crate::bundle::read_text(&jinja) {
            Ok(s) => (Some(s), jinja.display().to_string()),
            Err(e) => {
                part.diag(Severity::Error, jinja.display().to_string(), "", e.to_string());
                (None, String::new())
            }
        }
    } else {
        let s = match tok_cfg.get("chat_template") {
            Some(Json::String(s)) => Some(s.clone()),
            Some(Json::Array(items)) => items
                .iter()
                .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                .or_else(|| items.first())
                .and_then(|t| t.get("template").and_then(Json::as_str))
                .map(str::to_string),
            _ => None,
        };
        (s, format!("{}: chat_template", tok_cfg_path.display()))
    };
    if let Some(src) = src {
        match crate::chat::ChatTemplate::new(&src, bos.as_deref().unwrap_or(""), eos.as_deref().unwrap_or("")) {
            Ok(_) => part.chat_template = Some(origin),
            Err(e) => part.diag(
                Severity::Error,
                origin,
                "chat_template",
                format!("does not compile: {e}"),
            ),
        }
    }
}

/// The tensors the loader takes, with their expected shapes: (name, shape, required), from
/// the architecture's schema.
fn expected_trunk(part: &Part, c: &ModelConfig) -> Vec<(String, Vec<usize>, bool)> {
    let Some(a) = part.architecture else { return Vec::new() };
    crate::arch::expected_tensors(a, c, part.format)
        .into_iter()
        .map(|e| (e.name, (e.spec.shape)(c), e.required))
        .collect()
}

/// Check the tensors the loader will take: present, right shape, a loadable dtype; and the
/// tokenizer against the embedding.
fn check_trunk_tensors(part: &mut Part) {
    let Some(c) = part.config.clone() else { return };
    let mut problems = Vec::new();
    for (name, shape, required) in expected_trunk(part, &c) {
        match part.tensors.get(&name) {
            None if required => problems.push((
                part.files.first().map(|f| f.path.clone()).unwrap_or_default(),
                name,
                "missing tensor".to_string(),
            )),
            None => {}
            Some(t) => {
                if t.dims != shape {
                    problems.push((
                        t.file.clone(),
                        name.clone(),
                        format!("has shape {:?}, expected {:?} (from the config)", t.dims, shape),
                    ));
                }
                if part.format == BundleFormat::Hf && !matches!(t.dtype.as_str(), "F32" | "F16" | "BF16") {
                    problems.push((
                        t.file.clone(),
                        name.clone(),
                        format!("has dtype {} (f32, f16 or bf16 expected)", t.dtype),
                    ));
                }
            }
        }
    }
    // The first problems one by one; a config that expects thousands of absent tensors (a wrong
    // expert count) gets one line for the rest.
    const LISTED: usize = 50;
    let more = problems.len().saturating_sub(LISTED);
    let first_file = problems.first().map(|p| p.0.clone());
    for (file, name, msg) in problems.into_iter().take(LISTED) {
        part.diag(Severity::Error, file, name, msg);
    }
    if let (true, Some(file)) = (more > 0, first_file) {
        part.diag(
            Severity::Error,
            file,
            "tensors",
            format!("and {more} more tensors missing or malformed (not listed)"),
        );
    }
    if let Some(tv) = part.tokenizer.vocab_size {
        if tv > c.vocab_size {
            let file = part.tokenizer.source.clone().unwrap_or_default();
            part.diag(
                Severity::Error,
                file,
                "vocab",
                format!(
                    "the tokenizer has {tv} tokens, but the model's embedding has only {} rows (vocab mismatch)",
                    c.vocab_size
                ),
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Comparisons, kernels, fingerprint.

/// Equality of two GGUF metadata values (scalars, strings, arrays).
fn value_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::String(x), Value::String(y)) => x == y,
        (Value::Array(x), Value::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(p, q)| value_eq(p, q)),
        (Value::F32(x), Value::F32(y)) => x.to_bits() == y.to_bits(),
        (Value::F64(x), Value::F64(y)) => x.to_bits() == y.to_bits(),
        (Value::Bool(x), Value::Bool(y)) => x == y,
        (Value::U8(x), Value::U8(y)) => x == y,
        (Value::I8(x), Value::I8(y)) => x == y,
        (Value::U16(x), Value::U16(y)) => x == y,
        (Value::I16(x), Value::I16(y)) => x == y,
        (Value::U32(x), Value::U32(y)) => x == y,
        (Value::I32(x), Value::I32(y)) => x == y,
        (Value::U64(x), Value::U64(y)) => x == y,
        (Value::I64(x), Value::I64(y)) => x == y,
        _ => false,
    }
}

/// Compare two tokenizers from their metadata; `Err` names the first difference.
fn compare_tokenizers(target: &Part, draft: &Part) -> Result<(), String> {
    match (&target.tok, &draft.tok) {
        (TokSource::None, _) | (_, TokSource::None) => Err("a tokenizer is missing".into()),
        (TokSource::Gguf(a), TokSource::Gguf(b)) => {
            for key in ["tokenizer.ggml.model", "tokenizer.ggml.pre"] {
                if gguf::meta_str(a, key) != gguf::meta_str(b, key) {
                    return Err(format!(
                        "{key} differs: target '{}', draft '{}'",
                        gguf::meta_str(a, key).unwrap_or("(none)"),
                        gguf::meta_str(b, key).unwrap_or("(none)")
                    ));
                }
            }
            for key in [
                "tokenizer.ggml.tokens",
                "tokenizer.ggml.merges",
                "tokenizer.ggml.token_type",
            ] {
                let (x, y) = match (a.get(key), b.get(key)) {
                    (Some(Value::Array(x)), Some(Value::Array(y))) => (x, y),
                    (None, None) => continue,
                    _ => return Err(format!("{key} is present in only one of them")),
                };
                if x.len() != y.len() {
                    return Err(format!(
                        "{key} has {} entries in the target, {} in the draft",
                        x.len(),
                        y.len()
                    ));
                }
                if let Some(i) = (0..x.len()).find(|&i| !value_eq(&x[i], &y[i])) {
                    return Err(format!("{key}[{i}] differs: target {:?}, draft {:?}", x[i], y[i]));
                }
            }
            for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id"] {
                if gguf::meta_usize(a, key) != gguf::meta_usize(b, key) {
                    return Err(format!("{key} differs"));
                }
            }
            Ok(())
        }
        _ => {
            let build = |p: &Part| -> Result<crate::tokenizer::Tokenizer, String> {
                match &p.tok {
                    TokSource::Gguf(md) => crate::tokenizer::Tokenizer::from_gguf(md).map_err(|e| e.to_string()),
                    TokSource::Hf { path, bos, eos } => {
                        crate::tokenizer::Tokenizer::from_hf_file(path, bos.clone(), eos.clone(), false)
                            .map_err(|e| e.to_string())
                    }
                    TokSource::None => Err("no tokenizer".into()),
                }
            };
            let (a, b) = (build(target)?, build(draft)?);
            crate::tokenizer::check_same_tokenizer(&a, &b).map_err(|e| e.to_string())
        }
    }
}

/// The projection tensors of a trunk (the matrices the loader turns into `Linear`s): the
/// schema's matrices present in the bundle, and the LM head (the embedding table when tied).
fn projection_names(part: &Part, c: &ModelConfig) -> Vec<String> {
    let Some(a) = part.architecture else { return Vec::new() };
    let schema = a.tensors();
    let mut v: Vec<String> = crate::arch::expected_tensors(a, c, part.format)
        .into_iter()
        .filter(|e| e.spec.kind == Kind::Matrix && (e.required || part.tensors.get(&e.name).is_some()))
        .map(|e| e.name)
        .collect();
    if !v
        .iter()
        .any(|n| *n == crate::arch::spec(schema, Role::Output).name(part.format, 0))
    {
        v.push(crate::arch::spec(schema, Role::TokenEmbedding).name(part.format, 0));
    }
    v
}

/// Whether the LM head is tied to the embedding (the bundle has no separate one).
fn tied_head(part: &Part) -> bool {
    let Some(a) = part.architecture else { return false };
    let out = crate::arch::spec(a.tensors(), Role::Output).name(part.format, 0);
    part.tensors.get(&out).is_none()
}

/// Does a projection of this type and input width run on our batch-invariant kernels? Mirrors
/// `Linear::from_qtensor`.
fn own_kernel(dt: GgmlDType, cols: usize) -> bool {
    if crate::kernels::qmatmul::QKind::from_ggml(dt).is_some() && cols.is_multiple_of(crate::kernels::qmatmul::QK) {
        return true;
    }
    let kquants_on_candle = std::env::var("SPECULA_KQUANTS").is_ok_and(|v| v == "candle");
    !kquants_on_candle
        && crate::kernels::kquants::KKind::from_ggml(dt).is_some()
        && cols.is_multiple_of(crate::kernels::kquants::QK_K)
}

fn kernel_report(part: &Part) -> Option<KernelReport> {
    let c = part.config.as_ref()?;
    if part.format == BundleFormat::Hf {
        return Some(KernelReport {
            batch_invariant: false,
            reason: "f32 weights run on candle's dense matmul, which is not batch-invariant".into(),
        });
    }
    let mut off: Vec<String> = Vec::new();
    let names = projection_names(part, c);
    for n in &names {
        if let Some(t) = part.tensors.get(n) {
            let ok = t
                .ggml
                .is_some_and(|dt| own_kernel(dt, t.dims.get(1).copied().unwrap_or(0)));
            if !ok {
                off.push(format!("{} ({})", t.name, t.dtype));
            }
        }
    }
    Some(if off.is_empty() {
        KernelReport {
            batch_invariant: true,
            reason: format!(
                "all {} projections run on Specula's batch-invariant kernels",
                names.len()
            ),
        }
    } else {
        KernelReport {
            batch_invariant: false,
            reason: format!(
                "{} of {} projections run on candle's kernels (not batch-invariant), e.g. {}",
                off.len(),
                names.len(),
                off.iter().take(3).cloned().collect::<Vec<_>>().join(", ")
            ),
        }
    })
}

/// The sum of sizes read from headers, saturating (an absurd header gives a huge sum, never an
/// overflow).
fn sat_sum(it: impl Iterator<Item = u64>) -> u64 {
    it.fold(0, u64::saturating_add)
}

/// Bytes the loader holds for a part's weights (see [`MemoryEstimate::weights_bytes`]).
fn weights_in_memory(part: &Part) -> u64 {
    let Some(c) = part.config.as_ref() else {
        return sat_sum(part.tensors.list.iter().map(|t| t.bytes));
    };
    let expected = expected_trunk(part, c);
    let projections: std::collections::HashSet<String> = projection_names(part, c).into_iter().collect();
    let embd = part
        .architecture
        .map(|a| crate::arch::spec(a.tensors(), Role::TokenEmbedding).name(part.format, 0))
        .unwrap_or_default();
    let mut total = 0u64;
    for (name, _, _) in &expected {
        let Some(t) = part.tensors.get(name) else { continue };
        // Saturating: the sizes come from a file's header (an absurd one gives a huge total).
        total = total.saturating_add(match part.format {
            BundleFormat::Hf => t.elements().saturating_mul(4),
            BundleFormat::Gguf => {
                let dense = matches!(t.ggml, Some(GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) | None);
                if projections.contains(name) || *name == embd {
                    if dense {
                        t.elements().saturating_mul(4)
                    } else {
                        t.bytes
                    }
                } else {
                    // Norms, biases, rope factors: dequantized to f32.
                    t.elements().saturating_mul(4)
                }
            }
        });
    }
    // A tied LM head: the embedding's tensor made into a Linear as well.
    let tied = part.format == BundleFormat::Gguf && tied_head(part);
    if tied {
        if let Some(t) = part.tensors.get(&embd) {
            total = total.saturating_add(match t.ggml {
                Some(dt) if own_kernel(dt, t.dims.get(1).copied().unwrap_or(0)) => t.bytes,
                Some(GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) | None => t.elements().saturating_mul(4),
                Some(_) => 0,
            });
        }
    }
    total
}

/// FNV-1a 64 over the tensor directory (names, dtypes, shapes) and the file sizes.
fn fingerprint(part: &Part) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: &[u8]| {
        for &x in b {
            h ^= u64::from(x);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    let mut names: Vec<&TensorMeta> = part.tensors.list.iter().collect();
    names.sort_by(|a, b| a.name.cmp(&b.name));
    for t in names {
        eat(t.name.as_bytes());
        eat(t.dtype.as_bytes());
        for d in &t.dims {
            eat(&(*d as u64).to_le_bytes());
        }
    }
    for f in &part.files {
        eat(&f.bytes.to_le_bytes());
    }
    format!("fnv1a64:{h:016x}")
}

fn quant_groups(part: &Part) -> Vec<QuantGroup> {
    let mut m: HashMap<String, QuantGroup> = HashMap::new();
    for t in &part.tensors.list {
        let g = m.entry(t.dtype.clone()).or_insert_with(|| QuantGroup {
            dtype: t.dtype.clone(),
            tensors: 0,
            parameters: 0,
            bytes: 0,
        });
        g.tensors += 1;
        g.parameters = g.parameters.saturating_add(t.elements());
        g.bytes = g.bytes.saturating_add(t.bytes);
    }
    let mut v: Vec<QuantGroup> = m.into_values().collect();
    v.sort_by(|a, b| b.parameters.cmp(&a.parameters).then(a.dtype.cmp(&b.dtype)));
    v
}

// ---------------------------------------------------------------------------------------------
// The report.

/// Inspect a bundle (GGUF file, directory holding one GGUF file, or Hugging Face directory) from
/// its headers. Fails only when `path` is not a bundle (missing, or neither GGUF nor a
/// directory with config.json / safetensors / one .gguf); every problem inside the bundle is a
/// [`Diagnostic`] in the report.
pub fn inspect(path: &Path, opts: &InspectOptions) -> anyhow::Result<BundleReport> {
    let t0 = Instant::now();
    let mut target = read_part(path, Component::Target)?;
    let mut diags = std::mem::take(&mut target.diags);

    // MTP (trunk, then sidecars) and block drafter.
    let mtp = drafters::mtp_report(&target, opts.drafter.as_deref(), &mut diags);
    let block = drafters::block_drafter_report(&target, opts.drafter.as_deref(), &mut diags);

    // Draft model.
    let mut draft_part = None;
    let draft_model = match &opts.draft_model {
        None => None,
        Some(p) => match read_part(p, Component::DraftModel) {
            Err(e) => {
                diags.push(Diagnostic {
                    severity: Severity::Error,
                    component: Component::DraftModel,
                    file: p.display().to_string(),
                    subject: String::new(),
                    message: format!("{e:#}"),
                });
                None
            }
            Ok(mut d) => {
                let own_errors = d.has_errors();
                diags.append(&mut d.diags);
                let file = d
                    .files
                    .first()
                    .map(|f| f.path.clone())
                    .unwrap_or_else(|| p.display().to_string());
                let tok = compare_tokenizers(&target, &d);
                if let Err(e) = &tok {
                    diags.push(Diagnostic {
                        severity: Severity::Error,
                        component: Component::DraftModel,
                        file: file.clone(),
                        subject: "tokenizer".into(),
                        message: format!("cannot draft for the target: tokenizers differ: {e}"),
                    });
                }
                let vocab_ok = match (target.vocab(), d.vocab()) {
                    (Some(tv), Some(dv)) if tv != dv => {
                        diags.push(Diagnostic {
                            severity: Severity::Error,
                            component: Component::DraftModel,
                            file: file.clone(),
                            subject: "vocab_size".into(),
                            message: format!(
                                "cannot draft for the target: its LM head has {dv} rows, the target's has {tv} (vocab mismatch)"
                            ),
                        });
                        false
                    }
                    _ => true,
                };
                let report = DraftModelReport {
                    path: p.display().to_string(),
                    name: d.name.clone(),
                    architecture: d.arch.clone(),
                    parameters: sat_sum(d.tensors.list.iter().map(TensorMeta::elements)),
                    weight_bytes: sat_sum(d.tensors.list.iter().map(|t| t.bytes)),
                    quantization: quant_groups(&d)
                        .iter()
                        .map(|q| format!("{} x{}", q.dtype, q.tensors))
                        .collect::<Vec<_>>()
                        .join(", "),
                    vocab_size: d.vocab(),
                    tokenizer_match: tok.is_ok(),
                    compatible: !own_errors && tok.is_ok() && vocab_ok,
                    fingerprint: fingerprint(&d),
                };
                draft_part = Some(d);
                Some(report)
            }
        },
    };

    let kernels = kernel_report(&target);
    let fp = fingerprint(&target);
    let bundle_id = BundleId {
        path: path.display().to_string(),
        bytes: sat_sum(target.files.iter().map(|f| f.bytes)),
        fingerprint: fp.clone(),
    };

    // Tuning file.
    let draft_id = draft_model.as_ref().filter(|d| d.compatible).map(|d| BundleId {
        path: d.path.clone(),
        bytes: draft_part
            .as_ref()
            .map(|p| sat_sum(p.files.iter().map(|f| f.bytes)))
            .unwrap_or(0),
        fingerprint: d.fingerprint.clone(),
    });
    let tuning = tuning::find(&target.path).map(|(p, r)| match r {
        Err(e) => {
            diags.push(Diagnostic {
                severity: Severity::Warning,
                component: Component::Tuning,
                file: p.display().to_string(),
                subject: String::new(),
                message: format!("{e:#}"),
            });
            TuningReport {
                path: p.display().to_string(),
                applies: false,
                reason: Some("unreadable".into()),
                date: None,
                machine: None,
                commit: None,
                configs: 0,
                best: None,
                choice: None,
            }
        }
        Ok(t) => {
            let check = t.check(&bundle_id, &Machine::current());
            TuningReport {
                path: p.display().to_string(),
                applies: check.is_ok(),
                reason: check.err(),
                date: Some(t.date.clone()),
                machine: Some(format!("{}, {} threads", t.machine.cpu, t.machine.threads)),
                commit: Some(t.build.commit.clone()),
                configs: t.configs.len(),
                best: Some(t.best.label()),
                choice: Some(t.choice(draft_id.as_ref(), &p)),
            }
        }
    });

    // Memory.
    let estimate_part = |p: &Part| -> Option<MemoryEstimate> {
        let c = p.config.as_ref()?;
        Some(memory::estimate(
            c,
            weights_in_memory(p),
            p.tokenizer.vocab_size.unwrap_or(0),
            p.tokenizer.merges.unwrap_or(0),
            opts.kv_context,
        ))
    };
    let memory = estimate_part(&target).map(|mut m| {
        if let Some(d) = draft_part.as_ref().and_then(estimate_part) {
            m.draft_model_bytes = d.total_bytes;
            m.total_bytes = m.total_bytes.saturating_add(d.total_bytes);
        }
        m
    });

    // Tier and modes.
    let target_ok = !BundleReport::has_error(&diags, Component::Target);
    let draft_ok =
        draft_model.as_ref().is_none_or(|d| d.compatible) && !BundleReport::has_error(&diags, Component::DraftModel);
    let invariant = kernels.as_ref().is_some_and(|k| k.batch_invariant);
    let tuned = tuning.as_ref().filter(|t| t.applies).and_then(|t| t.choice.clone());
    let tier = if !target_ok || !draft_ok {
        Tier::Incompatible
    } else if !invariant {
        Tier::ArOnly
    } else if tuned.is_some() {
        Tier::Verified
    } else {
        Tier::CompatibleUnmeasured
    };
    let modes = resolve_modes(ResolveInput {
        target_ok,
        draft_ok,
        kernels: kernels.as_ref(),
        mtp: &mtp,
        block: block.as_ref(),
        draft_model: draft_model.as_ref(),
        tuned: tuned.as_ref(),
    });

    diags.sort_by_key(|d| d.severity);
    let parameters = sat_sum(target.tensors.list.iter().map(TensorMeta::elements));
    let weight_bytes = sat_sum(target.tensors.list.iter().map(|t| t.bytes));
    Ok(BundleReport {
        path: path.display().to_string(),
        format: target.format,
        name: target.name.clone(),
        architecture: target.arch.clone(),
        family: target.family,
        layer_plan: match (target.architecture, &target.config) {
            (Some(a), Some(c)) => a.layer_plan(c),
            _ => Vec::new(),
        },
        context_length: target.config.as_ref().map(|c| c.context_length),
        config: target.config.clone(),
        files: target.files.clone(),
        parameters,
        weight_bytes,
        quantization: quant_groups(&target),
        tokenizer: target.tokenizer.clone(),
        chat_template: target.chat_template.clone(),
        kernels,
        capabilities: Capabilities {
            mtp,
            block_drafter: block,
            draft_model,
            ngram: true,
        },
        tuning,
        memory,
        tier,
        modes,
        diagnostics: diags,
        fingerprint: fp,
        elapsed_ms: t0.elapsed().as_secs_f64() * 1e3,
    })
}
