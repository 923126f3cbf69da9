//! Drafter discovery and validation from headers: native MTP heads (in the trunk or a sidecar)
//! and block drafters (a `drafter/` folder), checked against the target's hidden size,
//! vocabulary and layer count.
//!
//! MTP layouts recognised:
//! - DeepSeek-V3 (also GLM-4.5, MiMo-style converters): trailing layers
//!   `model.layers.{num_hidden_layers + i}.` holding `enorm.weight` `[h]`, `hnorm.weight` `[h]`,
//!   `eh_proj.weight` `[h, 2h]`, `shared_head.norm.weight` `[h]`, optionally
//!   `shared_head.head.weight` `[vocab, h]` and, for a fused-feature head (EAGLE-3, Specula's
//!   `distill --target-layers`), `hidden_fc.weight` `[h, L × h]`, plus a transformer block
//!   (`self_attn.*`, `mlp.*`);
//!   in GGUF (llama.cpp), `blk.{n}.nextn.{enorm,hnorm,eh_proj,shared_head_norm,shared_head_head,
//!   embed_tokens}.weight` on the last `{arch}.nextn_predict_layers` blocks.
//! - Qwen3-Next: `mtp.fc.weight` `[h, 2h]`, `mtp.pre_fc_norm_embedding.weight` `[h]`,
//!   `mtp.pre_fc_norm_hidden.weight` `[h]`, `mtp.norm.weight` `[h]`, and blocks
//!   `mtp.layers.{i}.*`.
//!
//! Block drafter (DFlash layout, Chen, Liang, Liu 2026): `drafter/config.json` with
//! `block_size`, `target_layer_ids` (top level or in `dflash_config`), `hidden_size`, optional
//! `vocab_size`, `num_hidden_layers`, `mask_token_id`; tensors `fc.weight`
//! `[h, len(target_layer_ids) × target_h]`, `hidden_norm.weight` `[h]`, `norm.weight` `[h]`,
//! `layers.{i}.*` (optionally under `model.`); the embedding and LM head are the target's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::Value as Json;

use crate::arch::Role;

use super::{json_usize, read_json, BundleFormat, Component, Diagnostic, Part, Severity, TensorMeta, Tensors};

/// Whether the bundle has a usable MTP head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MtpStatus {
    /// No markers, no tensors.
    Absent,
    /// Tensors found and consistent with the target.
    Present,
    /// The config declares MTP layers, but the bundle has no MTP tensors (a converter dropped
    /// them): not a capability.
    DeclaredButAbsent,
    /// Tensors found, but incomplete or of the wrong shape (see diagnostics).
    Invalid,
    /// The headers looked consistent, but the server runs without the head: loading it failed,
    /// or the device does not run native drafters (set by
    /// [`super::BundleReport::not_attached`]; see diagnostics).
    NotLoaded,
}

/// What was found about a native MTP head.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MtpReport {
    pub status: MtpStatus,
    /// `deepseek-v3` or `qwen3-next`.
    pub layout: Option<String>,
    /// `trunk`, or the sidecar's path.
    pub location: Option<String>,
    /// MTP layers the config declares (`None`: no marker).
    pub declared: Option<usize>,
    /// The marker, e.g. `config.json: num_nextn_predict_layers = 1`.
    pub marker: Option<String>,
    /// MTP layers found (depth).
    pub depth: usize,
    /// Layer indices found (DeepSeek-V3: absolute; Qwen3-Next: `mtp.layers.{i}`).
    pub layer_ids: Vec<usize>,
    pub tensors: usize,
    pub parameters: u64,
}

impl MtpReport {
    /// One line for `specula inspect`.
    pub fn describe(&self) -> String {
        let marker = self.marker.as_deref().unwrap_or("no config marker");
        match self.status {
            MtpStatus::Absent => "absent".to_string(),
            MtpStatus::DeclaredButAbsent => {
                format!("declared but absent ({marker}; no MTP tensors in the bundle): not a capability")
            }
            MtpStatus::Present | MtpStatus::Invalid | MtpStatus::NotLoaded => format!(
                "{} {} layout, depth {} (layers {:?}), {} tensors, {:.1} M params, in {} [{}]",
                match self.status {
                    MtpStatus::Present => "present:",
                    MtpStatus::NotLoaded => "NOT LOADED (see diagnostics):",
                    _ => "INVALID (see diagnostics):",
                },
                self.layout.as_deref().unwrap_or("?"),
                self.depth,
                self.layer_ids,
                self.tensors,
                self.parameters as f64 / 1e6,
                self.location.as_deref().unwrap_or("?"),
                marker
            ),
        }
    }
}

/// What was found about a block drafter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BlockDrafterReport {
    /// The drafter folder.
    pub path: String,
    /// Config and tensors consistent with the target (else see diagnostics).
    pub valid: bool,
    pub block_size: Option<usize>,
    /// Target layers whose hidden states feed the drafter, shallow to deep.
    pub target_layer_ids: Vec<usize>,
    pub hidden_size: Option<usize>,
    pub vocab_size: Option<usize>,
    /// Drafter layers (`num_hidden_layers`, else counted from tensors).
    pub layers: Option<usize>,
    pub mask_token_id: Option<usize>,
    pub tensors: usize,
    pub parameters: u64,
}

impl BlockDrafterReport {
    pub fn describe(&self) -> String {
        format!(
            "{} {}: block_size {}, target layers {:?}, hidden {}, {} layer(s), {} tensors, {:.1} M params",
            if self.valid {
                "present:"
            } else {
                "INVALID (see diagnostics):"
            },
            self.path,
            self.block_size.map(|b| b.to_string()).unwrap_or_else(|| "?".into()),
            self.target_layer_ids,
            self.hidden_size.map(|b| b.to_string()).unwrap_or_else(|| "?".into()),
            self.layers.map(|b| b.to_string()).unwrap_or_else(|| "?".into()),
            self.tensors,
            self.parameters as f64 / 1e6
        )
    }
}

pub(super) fn push(diags: &mut Vec<Diagnostic>, c: Component, sev: Severity, file: &str, subject: &str, msg: String) {
    diags.push(Diagnostic {
        severity: sev,
        component: c,
        file: file.to_string(),
        subject: subject.to_string(),
        message: msg,
    });
}

/// MTP tensors found in one tensor set.
struct Found<'a> {
    layout: &'static str,
    /// Layer id → (tensor, name relative to the layer prefix).
    layers: BTreeMap<usize, Vec<(&'a TensorMeta, String)>>,
    /// Qwen3-Next tensors outside `mtp.layers` (name relative to `mtp.`).
    head: Vec<(&'a TensorMeta, String)>,
}

impl Found<'_> {
    fn tensors(&self) -> impl Iterator<Item = &TensorMeta> {
        self.layers
            .values()
            .flatten()
            .map(|(t, _)| *t)
            .chain(self.head.iter().map(|(t, _)| *t))
    }
}

/// `prefix.{N}.rest` → (N, rest).
fn split_layer<'a>(name: &'a str, prefix: &str) -> Option<(usize, &'a str)> {
    let rest = name.strip_prefix(prefix)?;
    let (n, rest) = rest.split_once('.')?;
    Some((n.parse().ok()?, rest))
}

fn detect(tensors: &Tensors) -> Option<Found<'_>> {
    // DeepSeek-V3 layout (HF and GGUF names).
    let mut ds_ids = std::collections::BTreeSet::new();
    for t in &tensors.list {
        if let Some((l, rest)) = BundleFormat::Hf.split_layer(&t.name) {
            if ["enorm.", "hnorm.", "eh_proj.", "shared_head."]
                .iter()
                .any(|p| rest.starts_with(p))
            {
                ds_ids.insert((BundleFormat::Hf, l));
            }
        }
        if let Some((l, rest)) = BundleFormat::Gguf.split_layer(&t.name) {
            if rest.starts_with("nextn.") {
                ds_ids.insert((BundleFormat::Gguf, l));
            }
        }
    }
    if !ds_ids.is_empty() {
        let mut layers: BTreeMap<usize, Vec<(&TensorMeta, String)>> = BTreeMap::new();
        for t in &tensors.list {
            for &(format, l) in &ds_ids {
                if let Some((tl, rest)) = format.split_layer(&t.name) {
                    if tl == l {
                        layers.entry(l).or_default().push((t, rest.to_string()));
                    }
                }
            }
        }
        return Some(Found {
            layout: "deepseek-v3",
            layers,
            head: Vec::new(),
        });
    }
    // Qwen3-Next layout.
    let mut layers: BTreeMap<usize, Vec<(&TensorMeta, String)>> = BTreeMap::new();
    let mut head = Vec::new();
    for t in &tensors.list {
        let Some(rest) = t
            .name
            .strip_prefix("mtp.")
            .or_else(|| t.name.strip_prefix("model.mtp."))
        else {
            continue;
        };
        match split_layer(rest, "layers.") {
            Some((l, r)) => layers.entry(l).or_default().push((t, r.to_string())),
            None => head.push((t, rest.to_string())),
        }
    }
    if layers.is_empty() && head.is_empty() {
        return None;
    }
    Some(Found {
        layout: "qwen3-next",
        layers,
        head,
    })
}

/// A shape problem of a transformer-block tensor named `rest` (HF or GGUF naming of the dense
/// block, [`crate::arch::llama`]) against the hidden size `h`: norms `[h]`, input projections
/// `[*, h]`, output projections `[h, *]`.
fn block_shape_problem(rest: &str, dims: &[usize], h: usize) -> Option<String> {
    let role = dense_block_role(rest)?;
    let want = match role {
        Role::AttnNorm | Role::FfnNorm => {
            return (dims != [h]).then(|| format!("has shape {dims:?}, expected [{h}] (a norm over the hidden size)"));
        }
        Role::AttnQ | Role::AttnK | Role::AttnV | Role::FfnGate | Role::FfnUp => (1, "input"),
        Role::AttnOutput | Role::FfnDown => (0, "output"),
        _ => return None,
    };
    if dims.len() != 2 {
        return None;
    }
    (dims[want.0] != h).then(|| {
        format!(
            "has shape {dims:?}: its {} dimension should be the hidden size {h}",
            want.1
        )
    })
}

/// The role of a dense-block tensor named `rest` within its layer (either format), if it is one.
fn dense_block_role(rest: &str) -> Option<Role> {
    crate::arch::llama::TENSORS
        .iter()
        .filter(|s| s.per_layer)
        .find(|s| {
            [BundleFormat::Gguf, BundleFormat::Hf]
                .iter()
                .any(|&f| s.base(f) == rest)
        })
        .map(|s| s.role)
}

fn check_shape(diags: &mut Vec<Diagnostic>, c: Component, t: &TensorMeta, want: &[usize], what: &str) {
    if t.dims != want {
        push(
            diags,
            c,
            Severity::Error,
            &t.file,
            &t.name,
            format!("has shape {:?}, expected {want:?} ({what})", t.dims),
        );
    }
}

/// Validate found MTP tensors against the target; returns whether anything was wrong.
fn validate_mtp(
    found: &Found,
    target: &Part,
    declared: Option<usize>,
    diags: &mut Vec<Diagnostic>,
    file: &str,
) -> bool {
    let c = Component::Mtp;
    let before = diags.len();
    let h = target.hyper.hidden;
    let v = target.vocab();
    let trunk_layers = target.hyper.layers;
    match found.layout {
        "deepseek-v3" => {
            for (&l, ts) in &found.layers {
                let get = |n: &str| ts.iter().find(|(_, r)| r == n).map(|(t, _)| *t);
                let gguf = ts.iter().any(|(_, r)| r.starts_with("nextn."));
                let format = if gguf { BundleFormat::Gguf } else { BundleFormat::Hf };
                let layer_name = format.layer_prefix(l).trim_end_matches('.').to_string();
                if let Some(n) = trunk_layers {
                    if l < n {
                        push(
                            diags,
                            c,
                            Severity::Error,
                            file,
                            &layer_name,
                            format!(
                            "MTP tensors inside trunk layer {l} (the trunk has layers 0..{n}; MTP layers follow them)"
                        ),
                        );
                    }
                }
                let names: &[(&str, bool)] = if gguf {
                    &[
                        ("nextn.enorm.weight", true),
                        ("nextn.hnorm.weight", true),
                        ("nextn.eh_proj.weight", true),
                        ("nextn.shared_head_norm.weight", false),
                        ("nextn.shared_head_head.weight", false),
                        ("nextn.embed_tokens.weight", false),
                    ]
                } else {
                    &[
                        ("enorm.weight", true),
                        ("hnorm.weight", true),
                        ("eh_proj.weight", true),
                        ("shared_head.norm.weight", true),
                        ("shared_head.head.weight", false),
                    ]
                };
                for &(n, required) in names {
                    match get(n) {
                        None if required => push(
                            diags,
                            c,
                            Severity::Error,
                            file,
                            &format!("{layer_name}.{n}"),
                            "missing MTP tensor".into(),
                        ),
                        None => {}
                        Some(t) => {
                            let Some(h) = h else { continue };
                            if n.ends_with("eh_proj.weight") {
                                check_shape(diags, c, t, &[h, 2 * h], "hidden × [embedding ; hidden state]");
                            } else if n.ends_with("head.weight")
                                || n.ends_with("shared_head_head.weight")
                                || n.ends_with("embed_tokens.weight")
                            {
                                if let Some(v) = v {
                                    check_shape(diags, c, t, &[v, h], "vocabulary × hidden, as the target's LM head");
                                }
                            } else {
                                check_shape(diags, c, t, &[h], "a norm over the hidden size");
                            }
                        }
                    }
                }
                // Fused features (EAGLE-3): `[h, L × h]` for L tapped target layers.
                if let (Some(t), Some(h)) = (get("hidden_fc.weight"), h) {
                    let fits = t.dims.len() == 2 && t.dims[0] == h && t.dims[1] >= h && t.dims[1] % h == 0;
                    if !fits {
                        push(
                            diags,
                            c,
                            Severity::Error,
                            file,
                            &t.name,
                            format!(
                                "has shape {:?}, expected [{h}, L × {h}] (hidden × tapped target layers × hidden, the fused features)",
                                t.dims
                            ),
                        );
                    }
                }
                let has_block = ts.iter().any(|(_, r)| dense_block_role(r).is_some());
                if !has_block {
                    push(
                        diags,
                        c,
                        Severity::Error,
                        file,
                        &layer_name,
                        "MTP layer without a transformer block (no self_attn / mlp tensors)".into(),
                    );
                }
            }
            if let (Some(d), Some(n)) = (declared, trunk_layers) {
                let gguf = found.layers.values().flatten().any(|(_, r)| r.starts_with("nextn."));
                for i in 0..d {
                    if !found.layers.contains_key(&(n + i)) {
                        let format = if gguf { BundleFormat::Gguf } else { BundleFormat::Hf };
                        let name = format.layer_prefix(n + i).trim_end_matches('.').to_string();
                        push(
                            diags,
                            c,
                            Severity::Error,
                            file,
                            &name,
                            format!(
                                "the config declares {d} MTP layer(s), but layer {} has no MTP tensors",
                                n + i
                            ),
                        );
                    }
                }
            }
        }
        _ => {
            let get = |n: &str| found.head.iter().find(|(_, r)| r == n).map(|(t, _)| *t);
            for n in [
                "fc.weight",
                "pre_fc_norm_embedding.weight",
                "pre_fc_norm_hidden.weight",
                "norm.weight",
            ] {
                match get(n) {
                    None => push(
                        diags,
                        c,
                        Severity::Error,
                        file,
                        &format!("mtp.{n}"),
                        "missing MTP tensor".into(),
                    ),
                    Some(t) => {
                        if let Some(h) = h {
                            if n == "fc.weight" {
                                check_shape(diags, c, t, &[h, 2 * h], "hidden × [embedding ; hidden state]");
                            } else {
                                check_shape(diags, c, t, &[h], "a norm over the hidden size");
                            }
                        }
                    }
                }
            }
            if found.layers.is_empty() {
                push(
                    diags,
                    c,
                    Severity::Error,
                    file,
                    "mtp.layers",
                    "no MTP transformer layer (mtp.layers.0.*)".into(),
                );
            }
            if let Some(d) = declared {
                for i in 0..d {
                    if !found.layers.contains_key(&i) {
                        push(
                            diags,
                            c,
                            Severity::Error,
                            file,
                            &format!("mtp.layers.{i}"),
                            format!("the config declares {d} MTP layer(s), but layer {i} has no tensors"),
                        );
                    }
                }
            }
        }
    }
    if let Some(h) = h {
        for (t, rest) in found.layers.values().flatten() {
            if let Some(p) = block_shape_problem(rest, &t.dims, h) {
                push(diags, c, Severity::Error, &t.file, &t.name, p);
            }
        }
    }
    diags[before..].iter().any(|d| d.severity == Severity::Error)
}

/// Read a sidecar (a folder of safetensors with an optional config.json, or one safetensors
/// file) into tensors; its config markers are returned too.
fn read_sidecar(path: &Path, diags: &mut Vec<Diagnostic>, c: Component) -> (Tensors, Vec<super::Marker>, Vec<PathBuf>) {
    let mut files = Vec::new();
    let mut markers = Vec::new();
    if path.is_dir() {
        if let Ok(rd) = std::fs::read_dir(path) {
            files = rd
                .filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            files.sort();
        }
        let cfg = path.join("config.json");
        if cfg.exists() {
            match read_json(&cfg) {
                Ok(j) => {
                    let tc = j.get("text_config").unwrap_or(&j);
                    for key in ["num_nextn_predict_layers", "mtp_num_hidden_layers"] {
                        if let Some(v) = json_usize(tc, key).or_else(|| json_usize(&j, key)) {
                            markers.push(super::Marker {
                                file: cfg.display().to_string(),
                                key: key.to_string(),
                                value: v,
                            });
                        }
                    }
                }
                Err(e) => push(diags, c, Severity::Error, &cfg.display().to_string(), "", e),
            }
        }
    } else {
        files.push(path.to_path_buf());
    }
    let mut part = Part {
        format: BundleFormat::Hf,
        path: path.to_path_buf(),
        root: path.to_path_buf(),
        name: String::new(),
        arch: None,
        architecture: None,
        family: None,
        config: None,
        hyper: super::RawHyper::default(),
        files: Vec::new(),
        tensors: Tensors::default(),
        tokenizer: Default::default(),
        tok: Default::default(),
        chat_template: None,
        markers: Vec::new(),
        diags: Vec::new(),
        component: c,
    };
    super::add_safetensors(&mut part, &files);
    diags.append(&mut part.diags);
    (part.tensors, markers, files)
}

/// Where native drafters beside a model are looked for: the MTP head's places in order
/// (`<stem>.mtp/`, then `<stem>.mtp.safetensors` next to a GGUF file; `mtp/`, then
/// `mtp.safetensors` in a bundle directory) and the block drafter's folder (`<stem>.drafter/`,
/// or `drafter/` in a bundle directory). `None` for a path without a parent or file name. The
/// one naming used by inspection, `serve`'s attach and `pull`'s bundled-head install.
pub fn sidecar_paths(model: &Path) -> Option<([PathBuf; 2], PathBuf)> {
    if model.is_dir() {
        return Some((
            [model.join("mtp"), model.join("mtp.safetensors")],
            model.join("drafter"),
        ));
    }
    let (stem, dir) = (model.file_stem()?.to_string_lossy(), model.parent()?);
    Some((
        [
            dir.join(format!("{stem}.mtp")),
            dir.join(format!("{stem}.mtp.safetensors")),
        ],
        dir.join(format!("{stem}.drafter")),
    ))
}

fn is_block_drafter_dir(p: &Path) -> bool {
    p.is_dir()
        && read_json(&p.join("config.json")).is_ok_and(|j| crate::speculative::block::is_block_drafter_config(&j))
}

/// The MTP report: trunk first, then sidecars (`mtp/` or `mtp.safetensors` in a bundle
/// directory, `<stem>.mtp/` or `<stem>.mtp.safetensors` beside a GGUF file, or `drafter` when it
/// is not a block drafter).
pub(super) fn mtp_report(target: &Part, drafter: Option<&Path>, diags: &mut Vec<Diagnostic>) -> MtpReport {
    let mut markers = target.markers.clone();
    let mut location = None;
    let mut found_in: Option<(Tensors, String)> = None;
    if detect(&target.tensors).is_some() {
        location = Some("trunk".to_string());
    } else {
        let mut candidates: Vec<PathBuf> = Vec::new();
        if let Some(d) = drafter {
            if !is_block_drafter_dir(d) {
                candidates.push(d.to_path_buf());
            }
        }
        if let Some((places, _)) = sidecar_paths(&target.path) {
            candidates.extend(places);
        }
        for cand in candidates {
            if !cand.exists() {
                continue;
            }
            let (tensors, m, _) = read_sidecar(&cand, diags, Component::Mtp);
            markers.extend(m);
            if detect(&tensors).is_some() {
                location = Some(cand.display().to_string());
                found_in = Some((tensors, cand.display().to_string()));
                break;
            }
            push(
                diags,
                Component::Mtp,
                Severity::Warning,
                &cand.display().to_string(),
                "",
                "a sidecar without MTP tensors (neither layout found)".into(),
            );
        }
    }
    let declared_marker = markers.iter().find(|m| m.value > 0).or(markers.first());
    let declared = declared_marker.map(|m| m.value);
    let marker = declared_marker.map(|m| format!("{}: {} = {}", m.file, m.key, m.value));
    let (tensors_ref, file) = match &found_in {
        Some((t, f)) => (t, f.clone()),
        None => (
            &target.tensors,
            target.files.first().map(|f| f.path.clone()).unwrap_or_default(),
        ),
    };
    let Some(found) = location.as_ref().and_then(|_| detect(tensors_ref)) else {
        let status = if declared.is_some_and(|d| d > 0) {
            if let Some(m) = declared_marker {
                push(diags, Component::Mtp, Severity::Warning, &m.file, &m.key, format!(
                    "declares {} MTP layer(s), but the bundle has no MTP tensors (trunk or sidecar): declared but absent, not a capability",
                    m.value
                ));
            }
            MtpStatus::DeclaredButAbsent
        } else {
            MtpStatus::Absent
        };
        return MtpReport {
            status,
            layout: None,
            location: None,
            declared,
            marker,
            depth: 0,
            layer_ids: Vec::new(),
            tensors: 0,
            parameters: 0,
        };
    };
    let bad = validate_mtp(&found, target, declared.filter(|&d| d > 0), diags, &file);
    let n_tensors = found.tensors().count();
    let params = found.tensors().map(TensorMeta::elements).fold(0, u64::saturating_add);
    if declared.is_none() {
        push(
            diags,
            Component::Mtp,
            Severity::Info,
            &file,
            "",
            format!(
                "MTP tensors ({} layout) without a config marker (num_nextn_predict_layers / mtp_num_hidden_layers)",
                found.layout
            ),
        );
    }
    MtpReport {
        status: if bad { MtpStatus::Invalid } else { MtpStatus::Present },
        layout: Some(found.layout.to_string()),
        location,
        declared,
        marker,
        depth: found.layers.len(),
        layer_ids: found.layers.keys().copied().collect(),
        tensors: n_tensors,
        parameters: params,
    }
}

/// The block-drafter report: `drafter` when it is a block-drafter folder, else `drafter/` in a
/// bundle directory (`<stem>.drafter/` beside a GGUF file). `None` when there is none.
pub(super) fn block_drafter_report(
    target: &Part,
    drafter: Option<&Path>,
    diags: &mut Vec<Diagnostic>,
) -> Option<BlockDrafterReport> {
    let dir = match drafter {
        Some(d) if is_block_drafter_dir(d) => d.to_path_buf(),
        Some(d) if d.is_dir() && !d.join("config.json").exists() && d.file_name().is_some_and(|n| n == "drafter") => {
            d.to_path_buf()
        }
        _ => {
            let d = sidecar_paths(&target.path)?.1;
            if !d.is_dir() {
                return None;
            }
            d
        }
    };
    let c = Component::Drafter;
    let before = diags.len();
    let cfg_path = dir.join("config.json");
    let cfg_file = cfg_path.display().to_string();
    let cfg = if !cfg_path.exists() {
        push(
            diags,
            c,
            Severity::Error,
            &cfg_file,
            "",
            "missing: a block drafter needs config.json (block_size, target_layer_ids, hidden_size)".into(),
        );
        None
    } else {
        match read_json(&cfg_path) {
            Ok(j) => Some(j),
            Err(e) => {
                push(diags, c, Severity::Error, &cfg_file, "", e);
                None
            }
        }
    };
    let nested = |j: &Json, k: &str| -> Option<Json> {
        j.get(k)
            .or_else(|| j.get("dflash_config").and_then(|d| d.get(k)))
            .cloned()
    };
    let mut report = BlockDrafterReport {
        path: dir.display().to_string(),
        valid: false,
        block_size: None,
        target_layer_ids: Vec::new(),
        hidden_size: None,
        vocab_size: None,
        layers: None,
        mask_token_id: None,
        tensors: 0,
        parameters: 0,
    };
    let (th, tv, tl) = (target.hyper.hidden, target.vocab(), target.hyper.layers);
    if let Some(j) = &cfg {
        match nested(j, "block_size").map(|v| v.as_u64()) {
            None => push(
                diags,
                c,
                Severity::Error,
                &cfg_file,
                "block_size",
                "missing field (tokens drafted per block)".into(),
            ),
            Some(None) => push(
                diags,
                c,
                Severity::Error,
                &cfg_file,
                "block_size",
                "is not a non-negative integer".into(),
            ),
            Some(Some(b)) if b < 2 => push(
                diags,
                c,
                Severity::Error,
                &cfg_file,
                "block_size",
                format!("= {b}; a block needs the anchor and at least one drafted token (>= 2)"),
            ),
            Some(Some(b)) => report.block_size = usize::try_from(b).ok(),
        }
        match nested(j, "target_layer_ids") {
            None => push(
                diags,
                c,
                Severity::Error,
                &cfg_file,
                "target_layer_ids",
                "missing field (the target layers whose hidden states feed the drafter)".into(),
            ),
            Some(Json::Array(a)) => {
                let ids: Option<Vec<usize>> = a
                    .iter()
                    .map(|v| v.as_u64().and_then(|x| usize::try_from(x).ok()))
                    .collect();
                match ids {
                    None => push(
                        diags,
                        c,
                        Severity::Error,
                        &cfg_file,
                        "target_layer_ids",
                        "holds a non-integer".into(),
                    ),
                    Some(ids) if ids.is_empty() => push(
                        diags,
                        c,
                        Severity::Error,
                        &cfg_file,
                        "target_layer_ids",
                        "is empty".into(),
                    ),
                    Some(ids) => {
                        if let Some(n) = tl {
                            for (i, &id) in ids.iter().enumerate() {
                                if id >= n {
                                    push(
                                        diags,
                                        c,
                                        Severity::Error,
                                        &cfg_file,
                                        &format!("target_layer_ids[{i}]"),
                                        format!("= {id}, but the target has {n} layers (0..{})", n.saturating_sub(1)),
                                    );
                                }
                            }
                        }
                        if ids.windows(2).any(|w| w[0] >= w[1]) {
                            push(
                                diags,
                                c,
                                Severity::Warning,
                                &cfg_file,
                                "target_layer_ids",
                                format!("{ids:?} is not strictly increasing (shallow to deep)"),
                            );
                        }
                        report.target_layer_ids = ids;
                    }
                }
            }
            Some(_) => push(
                diags,
                c,
                Severity::Error,
                &cfg_file,
                "target_layer_ids",
                "is not an array".into(),
            ),
        }
        match json_usize(j, "hidden_size") {
            None => push(
                diags,
                c,
                Severity::Error,
                &cfg_file,
                "hidden_size",
                "missing or non-integer field".into(),
            ),
            Some(h) => {
                report.hidden_size = Some(h);
                if let Some(th) = th {
                    if h != th {
                        push(diags, c, Severity::Error, &cfg_file, "hidden_size", format!(
                            "= {h}, but the target's hidden size is {th} (the drafter uses the target's embedding and LM head)"
                        ));
                    }
                }
            }
        }
        if let Some(v) = j.get("vocab_size") {
            match v.as_u64().and_then(|x| usize::try_from(x).ok()) {
                None => push(
                    diags,
                    c,
                    Severity::Error,
                    &cfg_file,
                    "vocab_size",
                    "is not an integer".into(),
                ),
                Some(v) => {
                    report.vocab_size = Some(v);
                    if let Some(tv) = tv {
                        if v != tv {
                            push(
                                diags,
                                c,
                                Severity::Error,
                                &cfg_file,
                                "vocab_size",
                                format!("= {v}, but the target's vocabulary has {tv} tokens (vocab mismatch)"),
                            );
                        }
                    }
                }
            }
        }
        if let Some(m) = nested(j, "mask_token_id")
            .and_then(|v| v.as_u64())
            .and_then(|x| usize::try_from(x).ok())
        {
            report.mask_token_id = Some(m);
            if tv.is_some_and(|tv| m >= tv) {
                push(
                    diags,
                    c,
                    Severity::Error,
                    &cfg_file,
                    "mask_token_id",
                    format!("= {m}, outside the target's vocabulary ({} tokens)", tv.unwrap_or(0)),
                );
            }
        }
        report.layers = json_usize(j, "num_hidden_layers");
    }
    let (tensors, _, files) = read_sidecar(&dir, diags, c);
    if files.is_empty() {
        push(
            diags,
            c,
            Severity::Error,
            &dir.display().to_string(),
            "",
            "no .safetensors weights in the drafter folder".into(),
        );
    }
    report.tensors = tensors.len();
    report.parameters = tensors
        .list
        .iter()
        .map(TensorMeta::elements)
        .fold(0, u64::saturating_add);
    let strip = |n: &str| n.strip_prefix("model.").unwrap_or(n).to_string();
    let h = report.hidden_size.or(th);
    let mut layer_ids = std::collections::BTreeSet::new();
    let mut has_fc = false;
    for t in &tensors.list {
        let n = strip(&t.name);
        if let Some((l, rest)) = split_layer(&n, "layers.") {
            layer_ids.insert(l);
            if let Some(h) = h {
                if let Some(p) = block_shape_problem(rest, &t.dims, h) {
                    push(diags, c, Severity::Error, &t.file, &t.name, p);
                }
            }
            continue;
        }
        match n.as_str() {
            "fc.weight" => {
                has_fc = true;
                if let (Some(h), Some(th)) = (h, th) {
                    let n_ids = report.target_layer_ids.len();
                    if n_ids > 0 {
                        check_shape(
                            diags,
                            c,
                            t,
                            &[h, n_ids * th],
                            &format!("hidden × ({n_ids} target layers × target hidden {th})"),
                        );
                    } else if t.dims.len() != 2 || t.dims[0] != h || !t.dims[1].is_multiple_of(th) {
                        push(
                            diags,
                            c,
                            Severity::Error,
                            &t.file,
                            &t.name,
                            format!("has shape {:?}, expected [{h}, k × {th}]", t.dims),
                        );
                    }
                }
            }
            "hidden_norm.weight" | "norm.weight" => {
                if let Some(h) = h {
                    check_shape(diags, c, t, &[h], "a norm over the hidden size");
                }
            }
            "embed_tokens.weight" | "lm_head.weight" => {
                if let (Some(h), Some(tv)) = (h, tv) {
                    check_shape(diags, c, t, &[tv, h], "target vocabulary × hidden");
                }
            }
            _ => {}
        }
    }
    if !files.is_empty() && !has_fc {
        push(
            diags,
            c,
            Severity::Error,
            &files[0].display().to_string(),
            "fc.weight",
            "missing tensor (the projection of the concatenated target hidden states)".into(),
        );
    }
    if !files.is_empty() && layer_ids.is_empty() {
        push(
            diags,
            c,
            Severity::Error,
            &files[0].display().to_string(),
            "layers.0",
            "no drafter layers (layers.N.*)".into(),
        );
    }
    match report.layers {
        Some(n) if !files.is_empty() && n != layer_ids.len() => push(
            diags,
            c,
            Severity::Error,
            &cfg_file,
            "num_hidden_layers",
            format!("= {n}, but the weights hold {} layer(s)", layer_ids.len()),
        ),
        None => report.layers = Some(layer_ids.len()),
        _ => {}
    }
    report.valid = !diags[before..].iter().any(|d| d.severity == Severity::Error);
    Some(report)
}
