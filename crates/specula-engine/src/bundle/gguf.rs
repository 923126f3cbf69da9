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
use crate::model::{Block, Embedding, Family, Linear, Model, ModelConfig, RopeStyle};
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
        let v = self.metadata().get(key)?;
        v.to_u64()
            .ok()
            .or_else(|| v.to_u32().ok().map(u64::from))
            .or_else(|| v.to_i32().ok().and_then(|x| u64::try_from(x).ok()))
            .or_else(|| v.to_i64().ok().and_then(|x| u64::try_from(x).ok()))
            .map(|x| x as usize)
    }

    pub fn get_f64(&self, key: &str) -> Option<f64> {
        let v = self.metadata().get(key)?;
        v.to_f32().ok().map(f64::from).or_else(|| v.to_f64().ok())
    }

    /// The architecture (`general.architecture`).
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
            .ok_or_else(|| anyhow!("missing metadata key 'general.architecture'"))
    }

    /// Model hyper-parameters from `{arch}.*` keys.
    pub fn config(&self) -> Result<ModelConfig> {
        let arch = self.architecture()?;
        let family = Family::parse(arch)
            .ok_or_else(|| anyhow!("general.architecture = '{arch}' is not supported (llama, qwen2, qwen3)"))?;
        let req = |k: &str| -> Result<usize> {
            let key = format!("{arch}.{k}");
            self.get_usize(&key)
                .ok_or_else(|| anyhow!("missing metadata key '{key}'"))
        };
        let hidden = req("embedding_length")?;
        let heads = req("attention.head_count")?;
        let kv_heads = self
            .get_usize(&format!("{arch}.attention.head_count_kv"))
            .unwrap_or(heads);
        let head_dim = self
            .get_usize(&format!("{arch}.attention.key_length"))
            .unwrap_or(hidden / heads.max(1));
        let vocab = match self.content.tensor_infos.get("token_embd.weight") {
            Some(info) => info.shape.dims()[0],
            None => bail!("missing tensor 'token_embd.weight'"),
        };
        Ok(ModelConfig {
            family,
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: req("feed_forward_length")?,
            num_layers: req("block_count")?,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            rms_norm_eps: self
                .get_f64(&format!("{arch}.attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-6),
            rope_theta: self.get_f64(&format!("{arch}.rope.freq_base")).unwrap_or(10_000.0),
            context_length: req("context_length")?,
            rope_style: match family {
                Family::Llama => RopeStyle::Interleaved,
                Family::Qwen2 | Family::Qwen3 => RopeStyle::Neox,
            },
        })
    }
}

/// Reads tensors of one GGUF file.
struct TensorReader<'a> {
    header: &'a GgufHeader,
    file: BufReader<File>,
    path: &'a Path,
    device: Device,
}

impl TensorReader<'_> {
    fn has(&self, name: &str) -> bool {
        self.header.content.tensor_infos.contains_key(name)
    }

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

    fn dense(&mut self, name: &str) -> Result<Tensor> {
        Ok(self.q(name)?.dequantize(&self.device)?)
    }

    fn opt_dense(&mut self, name: &str) -> Result<Option<Tensor>> {
        if self.has(name) {
            Ok(Some(self.dense(name)?))
        } else {
            Ok(None)
        }
    }

    fn linear(&mut self, prefix: &str) -> Result<Linear> {
        let w = self.q(&format!("{prefix}.weight"))?;
        let b = self.opt_dense(&format!("{prefix}.bias"))?;
        Linear::from_qtensor(w, b)
    }
}

/// Load a GGUF model file.
pub fn load(path: &Path, device: &Device) -> Result<LoadedBundle> {
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

    let file = BufReader::with_capacity(
        1 << 20,
        File::open(path).with_context(|| format!("opening {}", path.display()))?,
    );
    let mut r = TensorReader {
        header: &header,
        file,
        path,
        device: device.clone(),
    };
    let embd = r.q("token_embd.weight")?;
    let mut blocks = Vec::with_capacity(config.num_layers);
    for i in 0..config.num_layers {
        let p = format!("blk.{i}");
        blocks.push(Block {
            attn_norm: r.dense(&format!("{p}.attn_norm.weight"))?,
            q: r.linear(&format!("{p}.attn_q"))?,
            k: r.linear(&format!("{p}.attn_k"))?,
            v: r.linear(&format!("{p}.attn_v"))?,
            o: r.linear(&format!("{p}.attn_output"))?,
            q_norm: r.opt_dense(&format!("{p}.attn_q_norm.weight"))?,
            k_norm: r.opt_dense(&format!("{p}.attn_k_norm.weight"))?,
            ffn_norm: r.dense(&format!("{p}.ffn_norm.weight"))?,
            gate: r.linear(&format!("{p}.ffn_gate"))?,
            up: r.linear(&format!("{p}.ffn_up"))?,
            down: r.linear(&format!("{p}.ffn_down"))?,
        });
    }
    let output_norm = r.dense("output_norm.weight")?;
    let lm_table = if r.has("output.weight") {
        r.q("output.weight")?
    } else {
        embd.clone()
    };
    let lm_head = Linear::from_qtensor(lm_table.clone(), None)?;
    let rope_factors = match r.opt_dense("rope_freqs.weight")? {
        Some(t) => Some(t.flatten_all()?.to_vec1::<f32>()?),
        None => None,
    };
    let embedding = Embedding::Quantized(embd);
    let mut model = Model::new(
        config,
        embedding,
        blocks,
        output_norm,
        lm_head,
        rope_factors,
        device.clone(),
    )?;
    model.set_lm_head_table(Embedding::Quantized(lm_table));
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
/// layer): what `specula distill` initialises a draft head's block from. Errors: the file does
/// not read, or the layer is missing.
pub fn dense_block(path: &Path, layer: usize) -> Result<Vec<(String, Tensor)>> {
    let mut file = BufReader::new(File::open(path).with_context(|| format!("opening {}", path.display()))?);
    let content = gguf_file::Content::read(&mut file).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (g, hf) in BLOCK_TENSOR_NAMES {
        let name = format!("blk.{layer}.{g}");
        if !content.tensor_infos.contains_key(&name) {
            continue;
        }
        let t = content
            .tensor(&mut file, &name, &Device::Cpu)
            .map_err(|e| anyhow!("{}: reading tensor '{name}': {e}", path.display()))?;
        out.push((hf.to_string(), t.dequantize(&Device::Cpu)?));
    }
    if out.is_empty() {
        bail!("{}: no tensors for block {layer}", path.display());
    }
    Ok(out)
}

/// A block's GGUF tensor names (after `blk.N.`) and their HF names (after
/// `model.layers.N.`), for the dense Llama / Qwen2 / Qwen3 layout.
pub const BLOCK_TENSOR_NAMES: [(&str, &str); 14] = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_q.bias", "self_attn.q_proj.bias"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_k.bias", "self_attn.k_proj.bias"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_v.bias", "self_attn.v_proj.bias"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
];
