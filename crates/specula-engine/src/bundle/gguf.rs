//! GGUF loading (format: ggml's `docs/gguf.md`): metadata, tokenizer, chat template and
//! tensors, read into owned memory (no memory map: mapped weights evicted under memory pressure
//! made llama.cpp 10–40× slower at random on our machines). Quantized tensors stay quantized.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::{gguf_file, QTensor};
use candle_core::{Device, Tensor};

use super::{compile_template, end_of_generation_ids, LoadedBundle};
use crate::arch::{Architecture, BundleFormat, WeightSource};
use crate::model::{Embedding, Linear, ModelConfig};
use crate::tokenizer::Tokenizer;

/// GGUF metadata and tensor directory, read from the file header only.
pub struct GgufHeader {
    pub content: gguf_file::Content,
}

impl GgufHeader {
    /// Read the header (metadata and tensor infos, no tensor data) with the bounds-checked
    /// reader of [`crate::inspect::gguf`], and refuse a tensor directory that cannot load
    /// (duplicate names, unknown types, data past the end of the file). Errors name the file and
    /// the key or tensor.
    pub fn read(path: &Path) -> Result<Self> {
        let scan = crate::inspect::gguf::scan(path)?;
        if let Some(p) = crate::inspect::gguf::validate(&scan).into_iter().find(|p| p.fatal) {
            bail!("{}: tensor '{}' {}", path.display(), p.tensor, p.message);
        }
        Ok(Self {
            content: scan.into_content(),
        })
    }

    pub fn metadata(&self) -> &HashMap<String, gguf_file::Value> {
        &self.content.metadata
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.metadata()
            .get(key)
            .and_then(|v| v.to_string().ok())
            .map(|s| s.as_str())
    }

    /// An unsigned integer metadata value (any integer width).
    pub fn get_usize(&self, key: &str) -> Option<usize> {
        crate::inspect::gguf::meta_usize(self.metadata(), key)
    }

    /// The architecture (`general.architecture`).
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
            .ok_or_else(|| anyhow!("missing metadata key 'general.architecture'"))
    }

    /// The architecture that reads this file (by `general.architecture`).
    pub fn arch(&self) -> Result<&'static dyn Architecture> {
        let arch = self.architecture()?;
        crate::arch::by_gguf(arch).ok_or_else(|| {
            anyhow!(
                "general.architecture = '{arch}' is not supported ({})",
                crate::arch::supported(BundleFormat::Gguf)
            )
        })
    }

    /// Model hyper-parameters from `{arch}.*` keys, read by the file's architecture.
    pub fn config(&self) -> Result<ModelConfig> {
        let a = self.arch()?;
        let infos = &self.content.tensor_infos;
        let arch = self.architecture()?;
        let c = a.config_from_gguf(arch, self.metadata(), &|n: &str| {
            infos.get(n).map(|i| i.shape.dims().to_vec())
        })?;
        crate::arch::check_layer_count(a, &c, BundleFormat::Gguf, &|n| infos.contains_key(n))
            .map_err(|e| anyhow!("metadata '{arch}.block_count': {e}"))?;
        Ok(c)
    }
}

/// Reads tensors of one GGUF file.
struct TensorReader<'a> {
    header: &'a GgufHeader,
    file: BufReader<File>,
    path: &'a Path,
    device: Device,
}

impl WeightSource for TensorReader<'_> {
    fn format(&self) -> BundleFormat {
        BundleFormat::Gguf
    }

    fn has(&self, name: &str) -> bool {
        self.header.content.tensor_infos.contains_key(name)
    }

    fn linear(&mut self, weight: &str, bias: Option<&str>) -> Result<Linear> {
        let w = self.q(weight)?;
        let b = bias.map(|b| self.dense(b)).transpose()?;
        Linear::from_qtensor(w, b)
    }

    fn table(&mut self, name: &str) -> Result<Embedding> {
        Ok(Embedding::Quantized(self.q(name)?))
    }

    fn dense(&mut self, name: &str) -> Result<Tensor> {
        Ok(self.q(name)?.dequantize(&self.device)?)
    }

    /// Each expert's blocks as stored (a quantized stacked tensor stays quantized).
    fn experts(&mut self, name: &str, count: usize) -> Result<Vec<Linear>> {
        let t = self.q(name)?;
        let dims = t.shape().dims().to_vec();
        if dims.len() != 3 || dims[0] != count {
            bail!(
                "{}: tensor '{name}' has shape {dims:?}, expected [{count}, out, in]",
                self.path.display()
            );
        }
        let data = t.data()?;
        let per = data.len() / count;
        (0..count)
            .map(|e| {
                let q = candle_core::quantized::ggml_file::qtensor_from_ggml(
                    t.dtype(),
                    &data[e * per..(e + 1) * per],
                    vec![dims[1], dims[2]],
                    &self.device,
                )
                .map_err(|err| anyhow!("{}: tensor '{name}' expert {e}: {err}", self.path.display()))?;
                Linear::from_qtensor(Arc::new(q), None)
            })
            .collect()
    }
}

impl TensorReader<'_> {
    fn q(&mut self, name: &str) -> Result<Arc<QTensor>> {
        if !self.has(name) {
            bail!("{}: missing tensor '{name}'", self.path.display());
        }
        let t = self
            .header
            .content
            .tensor(&mut self.file, name, &self.device)
            .map_err(|e| anyhow!("{}: reading tensor '{name}': {e}", self.path.display()))?;
        Ok(Arc::new(t))
    }
}

/// Load a GGUF model file.
pub fn load(path: &Path, device: &Device, before_weights: super::BeforeWeights) -> Result<LoadedBundle> {
    let header = GgufHeader::read(path)?;
    let config = header.config().with_context(|| format!("{}", path.display()))?;
    let tokenizer =
        Tokenizer::from_gguf(header.metadata()).with_context(|| format!("{}: tokenizer", path.display()))?;
    let template = header
        .get_str("tokenizer.chat_template")
        .map(|src| compile_template(src, &tokenizer, &format!("{}: tokenizer.chat_template", path.display())))
        .transpose()?;
    let mut eos: Vec<u32> = [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ]
    .iter()
    .filter_map(|k| header.get_usize(k).map(|x| x as u32))
    .collect();
    eos.extend(end_of_generation_ids(&tokenizer));
    eos.sort_unstable();
    eos.dedup();
    before_weights(&tokenizer, &config)?;

    let file = BufReader::with_capacity(
        1 << 20,
        super::open_file(path).with_context(|| format!("opening {}", path.display()))?,
    );
    let mut r = TensorReader {
        header: &header,
        file,
        path,
        device: device.clone(),
    };
    let arch = header.arch()?;
    let model = arch.build(config, &mut r, device)?;
    let name = header.get_str("general.name").map(str::to_string).unwrap_or_else(|| {
        path.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default()
    });
    Ok(LoadedBundle {
        model,
        tokenizer,
        template,
        eos_ids: eos,
        name,
        quantization: quantization_summary(&header),
    })
}

/// The tensor types of a file and how many tensors use each, e.g. "Q4_1 ×211, F32 ×61".
fn quantization_summary(header: &GgufHeader) -> String {
    let mut counts: HashMap<String, usize> = HashMap::new();
    for info in header.content.tensor_infos.values() {
        *counts.entry(format!("{:?}", info.ggml_dtype)).or_default() += 1;
    }
    let mut v: Vec<_> = counts.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    v.iter()
        .map(|(k, n)| format!("{k} x{n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The weights of block `layer` of a GGUF model, dequantized to f32 and named as in HF
/// checkpoints (`input_layernorm.weight`, `self_attn.q_proj.weight`, ..., relative to the
/// layer): what `specula distill` initialises a draft head's block from. The dense block's
/// tensors only: an MoE layer gives its attention and norms, no MLP. Errors: the file does not
/// read, its architecture is not supported, or the layer is missing.
pub fn dense_block(path: &Path, layer: usize) -> Result<Vec<(String, Tensor)>> {
    let header = GgufHeader::read(path)?;
    let schema = header.arch().with_context(|| format!("{}", path.display()))?.tensors();
    let mut file = BufReader::new(super::open_file(path).with_context(|| format!("opening {}", path.display()))?);
    let mut out = Vec::new();
    // The dense block's rows only (an MoE layer's router and experts are not a head's).
    for s in schema
        .iter()
        .filter(|s| s.per_layer && crate::arch::llama::is_dense_block_tensor(s.hf))
    {
        let name = s.name(BundleFormat::Gguf, layer);
        if !header.content.tensor_infos.contains_key(&name) {
            continue;
        }
        let t = header
            .content
            .tensor(&mut file, &name, &Device::Cpu)
            .map_err(|e| anyhow!("{}: reading tensor '{name}': {e}", path.display()))?;
        out.push((s.hf.to_string(), t.dequantize(&Device::Cpu)?));
    }
    if out.is_empty() {
        bail!("{}: no tensors for block {layer}", path.display());
    }
    Ok(out)
}
