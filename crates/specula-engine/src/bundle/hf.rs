//! Hugging Face bundle directories: `config.json`, `model.safetensors` or sharded
//! `model.safetensors.index.json`, `tokenizer.json`, `tokenizer_config.json`,
//! `chat_template.jinja`, `generation_config.json` (transformers' on-disk layout). Weights in
//! f32/f16/bf16 are read into owned memory and computed in f32.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde_json::Value as Json;

use super::{compile_template, end_of_generation_ids, LoadedBundle};
use crate::arch::{Architecture, BundleFormat, WeightSource};
use crate::model::{Embedding, Linear, ModelConfig};
use crate::tokenizer::Tokenizer;

fn read_json(path: &Path) -> Result<Json> {
    let s = super::read_text(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&s).with_context(|| format!("{}: invalid JSON", path.display()))
}

/// Read `config.json` into a [`ModelConfig`], by the architecture its `model_type` names.
/// `text_config` (multimodal wrappers) is honoured. Errors name the file and the field.
pub fn read_config(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join("config.json");
    let root = read_json(&path)?;
    let c = root.get("text_config").unwrap_or(&root);
    let (arch, mt) = arch_of(c).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    arch.config_from_hf(mt, c)
        .map_err(|e| anyhow!("{}: {e}", path.display()))
}

/// The architecture of a config's text part, by its `model_type`.
pub fn arch_of(c: &Json) -> Result<(&'static dyn Architecture, &str)> {
    let mt = c
        .get("model_type")
        .and_then(Json::as_str)
        .ok_or_else(|| anyhow!("missing field 'model_type'"))?;
    let arch = crate::arch::by_hf(mt).ok_or_else(|| {
        anyhow!(
            "model_type '{mt}' is not supported ({})",
            crate::arch::supported(BundleFormat::Hf)
        )
    })?;
    Ok((arch, mt))
}

/// The safetensors files of a bundle: the shards named by the index, or `model.safetensors`.
pub fn safetensors_files(dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let j = read_json(&index)?;
        let map = j
            .get("weight_map")
            .and_then(Json::as_object)
            .ok_or_else(|| anyhow!("{}: missing object 'weight_map'", index.display()))?;
        let mut files: Vec<String> = Vec::with_capacity(map.len());
        for (tensor, v) in map {
            let f = v
                .as_str()
                .ok_or_else(|| anyhow!("{}: weight_map.{tensor} is not a file name", index.display()))?;
            if !dir.join(f).is_file() {
                bail!(
                    "{}: weight_map names shard '{f}' (for tensor '{tensor}'), which does not exist in {}",
                    index.display(),
                    dir.display()
                );
            }
            files.push(f.to_string());
        }
        files.sort();
        files.dedup();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    bail!(
        "{}: no model.safetensors or model.safetensors.index.json",
        dir.display()
    )
}

struct Weights {
    tensors: HashMap<String, Tensor>,
    dir: String,
}

impl Weights {
    fn take(&mut self, name: &str) -> Result<Tensor> {
        let t = self
            .tensors
            .remove(name)
            .ok_or_else(|| anyhow!("{}: missing tensor '{name}'", self.dir))?;
        match t.dtype() {
            DType::F32 | DType::F16 | DType::BF16 => Ok(t.to_dtype(DType::F32)?),
            other => bail!(
                "{}: tensor '{name}' has dtype {other:?} (f32, f16 or bf16 expected)",
                self.dir
            ),
        }
    }
}

impl WeightSource for Weights {
    fn format(&self) -> BundleFormat {
        BundleFormat::Hf
    }

    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn linear(&mut self, weight: &str, bias: Option<&str>) -> Result<Linear> {
        let w = self.take(weight)?;
        let b = bias.map(|b| self.take(b)).transpose()?;
        Linear::from_dense(w, b)
    }

    fn table(&mut self, name: &str) -> Result<Embedding> {
        Ok(Embedding::Dense(self.take(name)?))
    }

    fn dense(&mut self, name: &str) -> Result<Tensor> {
        self.take(name)
    }
}

fn token_string(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_string),
        _ => None,
    }
}

/// Load a Hugging Face bundle directory.
pub fn load(dir: &Path, device: &Device, before_weights: super::BeforeWeights) -> Result<LoadedBundle> {
    let config = read_config(dir)?;
    let tok_cfg_path = dir.join("tokenizer_config.json");
    let tok_cfg = if tok_cfg_path.exists() {
        read_json(&tok_cfg_path)?
    } else {
        Json::Null
    };
    let tokenizer_path = dir.join("tokenizer.json");
    if !tokenizer_path.exists() {
        bail!("{}: missing tokenizer.json", dir.display());
    }
    let tokenizer = Tokenizer::from_hf_file(
        &tokenizer_path,
        token_string(tok_cfg.get("bos_token")),
        token_string(tok_cfg.get("eos_token")),
        tok_cfg.get("add_bos_token").and_then(Json::as_bool).unwrap_or(false),
    )?;
    let template_src = if dir.join("chat_template.jinja").exists() {
        Some(
            super::read_text(&dir.join("chat_template.jinja"))
                .with_context(|| format!("reading {}/chat_template.jinja", dir.display()))?,
        )
    } else {
        match tok_cfg.get("chat_template") {
            Some(Json::String(s)) => Some(s.clone()),
            Some(Json::Array(items)) => items
                .iter()
                .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                .or_else(|| items.first())
                .and_then(|t| t.get("template").and_then(Json::as_str))
                .map(str::to_string),
            _ => None,
        }
    };
    let template = template_src
        .map(|src| compile_template(&src, &tokenizer, &format!("{}: chat template", dir.display())))
        .transpose()?;
    let mut eos: Vec<u32> = tokenizer.eos_token.iter().map(|t| t.0).collect();
    let gen_cfg = dir.join("generation_config.json");
    if gen_cfg.exists() {
        match read_json(&gen_cfg)?.get("eos_token_id") {
            Some(Json::Number(n)) => eos.extend(n.as_u64().map(|x| x as u32)),
            Some(Json::Array(a)) => eos.extend(a.iter().filter_map(Json::as_u64).map(|x| x as u32)),
            _ => {}
        }
    }
    eos.extend(end_of_generation_ids(&tokenizer));
    eos.sort_unstable();
    eos.dedup();
    before_weights(&tokenizer, &config)?;

    let mut tensors = HashMap::new();
    let mut origin: HashMap<String, std::path::PathBuf> = HashMap::new();
    for f in safetensors_files(dir)? {
        // Check the header first (bounds-checked, names the tensor) so a malformed file fails
        // with a clear message rather than inside the safetensors crate.
        let scan = crate::inspect::safetensors::scan(&f)?;
        if let Some(p) = crate::inspect::safetensors::validate(&scan).first() {
            bail!("{}: tensor '{}' {}", f.display(), p.tensor, p.message);
        }
        for t in &scan.tensors {
            if let Some(prev) = origin.insert(t.name.clone(), f.clone()) {
                bail!(
                    "{}: tensor '{}' is also in {} (duplicate tensor across weight files)",
                    f.display(),
                    t.name,
                    prev.display()
                );
            }
        }
        let part = candle_core::safetensors::load(&f, device).map_err(|e| anyhow!("{}: {e}", f.display()))?;
        for (name, t) in part {
            // transformers 5's fused experts, read as the per-expert tensors they stand for.
            let fused = crate::inspect::safetensors::split_fused_experts(&name, t.dims())
                .map_err(|e| anyhow!("{}: tensor '{name}' {e}", f.display()))?;
            match fused {
                Some(slices) => {
                    for s in slices {
                        let x = t.get(s.expert)?.narrow(0, s.rows.start, s.rows.len())?.contiguous()?;
                        origin.insert(s.name.clone(), f.clone());
                        tensors.insert(s.name, x);
                    }
                }
                None => {
                    tensors.insert(name, t);
                }
            }
        }
    }
    let arch = crate::arch::of(&config);
    crate::arch::check_layer_count(arch, &config, BundleFormat::Hf, &|n| origin.contains_key(n))
        .map_err(|e| anyhow!("{}: num_hidden_layers: {e}", dir.join("config.json").display()))?;
    let mut w = Weights {
        tensors,
        dir: dir.display().to_string(),
    };
    let model = arch.build(config, &mut w, device)?;
    let name = dir
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    Ok(LoadedBundle {
        model,
        tokenizer,
        template,
        eos_ids: eos,
        name,
        quantization: "f32 (from safetensors)".into(),
    })
}
