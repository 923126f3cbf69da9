//! Tiny random models for tests of shapes and plumbing: written as real GGUF files and HF bundle
//! directories, so tests go through the same loaders as real models.

use std::collections::HashMap;
use std::path::Path;

use anyhow::Result;
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use crate::model::Family;

/// Shape of a tiny test model.
#[derive(Debug, Clone)]
pub struct TinySpec {
    pub family: Family,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub context: usize,
    /// Tensor type for the projection weights in the GGUF file.
    pub dtype: GgmlDType,
    pub seed: u64,
}

impl TinySpec {
    pub fn new(family: Family) -> Self {
        Self {
            family,
            hidden: 64,
            intermediate: 128,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            context: 256,
            dtype: GgmlDType::F32,
            seed: 1,
        }
    }

    /// A tiny model whose projections are of type `dtype`. The K-quants (Q2_K..Q6_K) pack 256
    /// weights per super-block along the input dimension, so for them every input width
    /// (hidden, intermediate, heads × head_dim) is a multiple of 256: hidden 256, intermediate
    /// 512, 4 heads of 64 (2 KV heads).
    pub fn with_dtype(family: Family, dtype: GgmlDType) -> Self {
        let base = Self {
            dtype,
            ..Self::new(family)
        };
        if dtype.block_size() < 256 {
            return base;
        }
        Self {
            hidden: 256,
            intermediate: 512,
            head_dim: 64,
            ..base
        }
    }
}

/// GPT-2's byte → printable-char table (the byte-level BPE alphabet).
pub fn bytes_to_unicode() -> Vec<char> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut table = vec!['\0'; 256];
    for (b, c) in bs.iter().zip(cs) {
        table[*b as usize] = char::from_u32(c).unwrap_or('?');
    }
    table
}

/// The tiny vocabulary: 256 byte tokens, a few merges, then `<|im_start|>` and `<|im_end|>`.
pub fn tiny_vocab() -> (Vec<String>, Vec<String>, Vec<i32>) {
    let table = bytes_to_unicode();
    let mut tokens: Vec<String> = table.iter().map(|c| c.to_string()).collect();
    let mut types = vec![1i32; 256];
    let sp = table[b' ' as usize];
    let merges: Vec<String> = vec![format!("{sp} t"), "h e".into(), format!("{sp}t h"), "i n".into()];
    tokens.extend([format!("{sp}t"), "he".into(), format!("{sp}th"), "in".into()]);
    types.extend([1, 1, 1, 1]);
    tokens.extend(["<|im_start|>".to_string(), "<|im_end|>".to_string()]);
    types.extend([3, 3]);
    (tokens, merges, types)
}

const TINY_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Deterministic random weights, N(0, scale²)-ish, named as HF names them. Shapes are HF's
/// (`[out, in]`).
fn tiny_weights(spec: &TinySpec, vocab: usize) -> Result<Vec<(String, Tensor)>> {
    let dev = Device::Cpu;
    let mut state = spec.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut rand = |shape: &[usize], scale: f32| -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 * scale
            })
            .collect();
        Ok(Tensor::from_vec(v, shape, &dev)?)
    };
    let (h, i, d) = (spec.hidden, spec.intermediate, spec.head_dim);
    let mut w = vec![("model.embed_tokens.weight".to_string(), rand(&[vocab, h], 1.0)?)];
    for l in 0..spec.layers {
        let p = format!("model.layers.{l}");
        let ones = |n: usize| Tensor::ones(n, candle_core::DType::F32, &dev);
        w.push((format!("{p}.input_layernorm.weight"), (ones(h)? + rand(&[h], 0.1)?)?));
        w.push((format!("{p}.self_attn.q_proj.weight"), rand(&[spec.heads * d, h], 0.3)?));
        w.push((
            format!("{p}.self_attn.k_proj.weight"),
            rand(&[spec.kv_heads * d, h], 0.3)?,
        ));
        w.push((
            format!("{p}.self_attn.v_proj.weight"),
            rand(&[spec.kv_heads * d, h], 0.3)?,
        ));
        w.push((format!("{p}.self_attn.o_proj.weight"), rand(&[h, spec.heads * d], 0.3)?));
        if spec.family == Family::Qwen2 {
            w.push((format!("{p}.self_attn.q_proj.bias"), rand(&[spec.heads * d], 0.1)?));
            w.push((format!("{p}.self_attn.k_proj.bias"), rand(&[spec.kv_heads * d], 0.1)?));
            w.push((format!("{p}.self_attn.v_proj.bias"), rand(&[spec.kv_heads * d], 0.1)?));
        }
        if spec.family == Family::Qwen3 {
            w.push((format!("{p}.self_attn.q_norm.weight"), (ones(d)? + rand(&[d], 0.1)?)?));
            w.push((format!("{p}.self_attn.k_norm.weight"), (ones(d)? + rand(&[d], 0.1)?)?));
        }
        w.push((
            format!("{p}.post_attention_layernorm.weight"),
            (ones(h)? + rand(&[h], 0.1)?)?,
        ));
        w.push((format!("{p}.mlp.gate_proj.weight"), rand(&[i, h], 0.3)?));
        w.push((format!("{p}.mlp.up_proj.weight"), rand(&[i, h], 0.3)?));
        w.push((format!("{p}.mlp.down_proj.weight"), rand(&[h, i], 0.3)?));
    }
    w.push((
        "model.norm.weight".to_string(),
        Tensor::ones(h, candle_core::DType::F32, &dev)?,
    ));
    w.push(("lm_head.weight".to_string(), rand(&[vocab, h], 0.5)?));
    Ok(w)
}

/// The GGUF name of an HF tensor name.
fn gguf_name(hf: &str) -> String {
    let map = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = map.iter().find(|(h, _)| *h == hf) {
        return g.to_string();
    }
    let rest = hf.trim_start_matches("model.layers.");
    let (layer, name) = rest.split_once('.').unwrap_or((rest, ""));
    let name = name
        .replace("input_layernorm", "attn_norm")
        .replace("post_attention_layernorm", "ffn_norm")
        .replace("self_attn.q_proj", "attn_q")
        .replace("self_attn.k_proj", "attn_k")
        .replace("self_attn.v_proj", "attn_v")
        .replace("self_attn.o_proj", "attn_output")
        .replace("self_attn.q_norm", "attn_q_norm")
        .replace("self_attn.k_norm", "attn_k_norm")
        .replace("mlp.gate_proj", "ffn_gate")
        .replace("mlp.up_proj", "ffn_up")
        .replace("mlp.down_proj", "ffn_down");
    format!("blk.{layer}.{name}")
}

/// Reorder the rows of a q/k projection from HF's half-split RoPE layout to the interleaved
/// layout GGUF Llama files use (llama.cpp's `convert_hf_to_gguf.py` permute).
fn permute_for_interleaved(w: &Tensor, heads: usize) -> Result<Tensor> {
    let dims = w.dims().to_vec();
    let out = dims[0];
    let d = out / heads;
    let rest: Vec<usize> = dims[1..].to_vec();
    let mut shape = vec![heads, 2, d / 2];
    shape.extend(&rest);
    let t = w.reshape(shape)?.transpose(1, 2)?.contiguous()?;
    Ok(t.reshape(dims)?)
}

/// Write a tiny random model as a GGUF file.
pub fn write_tiny_gguf(path: &Path, spec: &TinySpec) -> Result<()> {
    write_tiny_gguf_with_template(path, spec, TINY_TEMPLATE)
}

/// As [`write_tiny_gguf`], with `template` as the GGUF's `tokenizer.chat_template` (e.g. one
/// that opens `<think>` in the generation prompt).
pub fn write_tiny_gguf_with_template(path: &Path, spec: &TinySpec, template: &str) -> Result<()> {
    let (tokens, merges, types) = tiny_vocab();
    let weights = tiny_weights(spec, tokens.len())?;
    let arch = spec.family.as_str();
    let mut qtensors: Vec<(String, QTensor)> = Vec::new();
    for (name, t) in &weights {
        let t = if spec.family == Family::Llama && (name.contains("q_proj") || name.contains("k_proj")) {
            let heads = if name.contains("q_proj") {
                spec.heads
            } else {
                spec.kv_heads
            };
            permute_for_interleaved(t, heads)?
        } else {
            t.clone()
        };
        let is_matrix = t.rank() == 2;
        let dtype = if is_matrix { spec.dtype } else { GgmlDType::F32 };
        qtensors.push((gguf_name(name), QTensor::quantize(&t, dtype)?));
    }
    use gguf_file::Value as V;
    let md: Vec<(String, V)> = vec![
        ("general.architecture".into(), V::String(arch.into())),
        ("general.name".into(), V::String(format!("tiny-{arch}"))),
        (format!("{arch}.block_count"), V::U32(spec.layers as u32)),
        (format!("{arch}.context_length"), V::U32(spec.context as u32)),
        (format!("{arch}.embedding_length"), V::U32(spec.hidden as u32)),
        (format!("{arch}.feed_forward_length"), V::U32(spec.intermediate as u32)),
        (format!("{arch}.attention.head_count"), V::U32(spec.heads as u32)),
        (format!("{arch}.attention.head_count_kv"), V::U32(spec.kv_heads as u32)),
        (format!("{arch}.attention.key_length"), V::U32(spec.head_dim as u32)),
        (format!("{arch}.attention.layer_norm_rms_epsilon"), V::F32(1e-6)),
        (format!("{arch}.rope.freq_base"), V::F32(10_000.0)),
        ("tokenizer.ggml.model".into(), V::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), V::String("qwen2".into())),
        (
            "tokenizer.ggml.tokens".into(),
            V::Array(tokens.iter().map(|t| V::String(t.clone())).collect()),
        ),
        (
            "tokenizer.ggml.merges".into(),
            V::Array(merges.iter().map(|t| V::String(t.clone())).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            V::Array(types.iter().map(|&t| V::I32(t)).collect()),
        ),
        ("tokenizer.ggml.eos_token_id".into(), V::U32(tokens.len() as u32 - 1)),
        ("tokenizer.chat_template".into(), V::String(template.into())),
    ];
    let md_refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = qtensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path)?;
    gguf_file::write(&mut f, &md_refs, &t_refs)?;
    Ok(())
}

/// Write the same tiny random model as a Hugging Face bundle directory (f32 safetensors,
/// tokenizer.json built from the same vocabulary, ChatML template).
pub fn write_tiny_hf(dir: &Path, spec: &TinySpec) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let (tokens, merges, types) = tiny_vocab();
    let weights = tiny_weights(spec, tokens.len())?;
    let map: HashMap<String, Tensor> = weights.into_iter().collect();
    candle_core::safetensors::save(&map, dir.join("model.safetensors"))?;
    let model_type = spec.family.as_str();
    let config = serde_json::json!({
        "model_type": model_type,
        "vocab_size": tokens.len(),
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": spec.context,
        "tie_word_embeddings": false,
        "torch_dtype": "float32",
    });
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config)?)?;
    let mut md = HashMap::new();
    use gguf_file::Value as V;
    md.insert("tokenizer.ggml.model".to_string(), V::String("gpt2".into()));
    md.insert("tokenizer.ggml.pre".to_string(), V::String("qwen2".into()));
    md.insert(
        "tokenizer.ggml.tokens".to_string(),
        V::Array(tokens.iter().map(|t| V::String(t.clone())).collect()),
    );
    md.insert(
        "tokenizer.ggml.merges".to_string(),
        V::Array(merges.iter().map(|t| V::String(t.clone())).collect()),
    );
    md.insert(
        "tokenizer.ggml.token_type".to_string(),
        V::Array(types.iter().map(|&t| V::I32(t)).collect()),
    );
    let tok = crate::tokenizer::Tokenizer::from_gguf(&md)?;
    tok.inner()
        .save(dir.join("tokenizer.json"), false)
        .map_err(|e| anyhow::anyhow!("saving tokenizer.json: {e}"))?;
    let tok_cfg = serde_json::json!({
        "eos_token": "<|im_end|>",
        "add_bos_token": false,
        "chat_template": TINY_TEMPLATE,
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tok_cfg)?,
    )?;
    Ok(())
}

/// Uniform values in `[-scale, scale]` from a xorshift stream (reproducible test weights).
struct Uniform(u64);

impl Uniform {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn tensor(&mut self, shape: &[usize], scale: f32) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                ((self.0 >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 * scale
            })
            .collect();
        Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
    }

    /// `1 + U(-scale, scale)` (a norm weight).
    fn norm(&mut self, n: usize, scale: f32) -> Result<Tensor> {
        Ok((self.tensor(&[n], scale)? + 1.0)?)
    }
}

/// Random weights of a head block of the target's shape under `prefix` (HF names).
fn random_block(u: &mut Uniform, target: &crate::model::Model, prefix: &str) -> Result<Vec<(String, Tensor)>> {
    let c = target.config();
    let (h, f) = (c.hidden_size, c.intermediate_size);
    let (qd, kd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    let mut w = vec![
        (format!("{prefix}input_layernorm.weight"), u.norm(h, 0.1)?),
        (format!("{prefix}post_attention_layernorm.weight"), u.norm(h, 0.1)?),
        (format!("{prefix}self_attn.q_proj.weight"), u.tensor(&[qd, h], 0.3)?),
        (format!("{prefix}self_attn.k_proj.weight"), u.tensor(&[kd, h], 0.3)?),
        (format!("{prefix}self_attn.v_proj.weight"), u.tensor(&[kd, h], 0.3)?),
        (format!("{prefix}self_attn.o_proj.weight"), u.tensor(&[h, qd], 0.3)?),
        (format!("{prefix}mlp.gate_proj.weight"), u.tensor(&[f, h], 0.3)?),
        (format!("{prefix}mlp.up_proj.weight"), u.tensor(&[f, h], 0.3)?),
        (format!("{prefix}mlp.down_proj.weight"), u.tensor(&[h, f], 0.3)?),
    ];
    if c.family == Family::Qwen2 {
        for (n, d) in [("q", qd), ("k", kd), ("v", kd)] {
            w.push((format!("{prefix}self_attn.{n}_proj.bias"), u.tensor(&[d], 0.1)?));
        }
    }
    if c.family == Family::Qwen3 {
        w.push((format!("{prefix}self_attn.q_norm.weight"), u.norm(c.head_dim, 0.1)?));
        w.push((format!("{prefix}self_attn.k_norm.weight"), u.norm(c.head_dim, 0.1)?));
    }
    Ok(w)
}

/// Write a random-weight MTP head for `target` into the directory `dir` (config.json +
/// model.safetensors) in `layout`'s tensor names, optionally with a reduced draft vocabulary.
pub fn write_random_mtp_head(
    dir: &Path,
    target: &crate::model::Model,
    layout: crate::spec::mtp::MtpLayout,
    draft_vocab: Option<&[u32]>,
    seed: u64,
) -> Result<()> {
    write_random_fused_mtp_head(dir, target, layout, draft_vocab, None, seed)
}

/// [`write_random_mtp_head`], reading fused features (EAGLE-3) of the target layers `fused`
/// when given: a random `hidden_fc.weight` `[h, len × h]` and `target_layer_ids` in the config.
pub fn write_random_fused_mtp_head(
    dir: &Path,
    target: &crate::model::Model,
    layout: crate::spec::mtp::MtpLayout,
    draft_vocab: Option<&[u32]>,
    fused: Option<&[usize]>,
    seed: u64,
) -> Result<()> {
    use crate::spec::mtp::MtpLayout;
    std::fs::create_dir_all(dir)?;
    let mut u = Uniform::new(seed);
    let c = target.config();
    let h = c.hidden_size;
    let (p, names) = match layout {
        MtpLayout::DeepseekV3 => (
            format!("model.layers.{}.", c.num_layers),
            [
                "enorm.weight",
                "hnorm.weight",
                "eh_proj.weight",
                "shared_head.norm.weight",
            ],
        ),
        MtpLayout::Qwen3Next => (
            "mtp.".to_string(),
            [
                "pre_fc_norm_embedding.weight",
                "pre_fc_norm_hidden.weight",
                "fc.weight",
                "norm.weight",
            ],
        ),
    };
    let block_prefix = match layout {
        MtpLayout::DeepseekV3 => p.clone(),
        MtpLayout::Qwen3Next => "mtp.layers.0.".to_string(),
    };
    let mut map: HashMap<String, Tensor> = random_block(&mut u, target, &block_prefix)?.into_iter().collect();
    map.insert(format!("{p}{}", names[0]), u.norm(h, 0.1)?);
    map.insert(format!("{p}{}", names[1]), u.norm(h, 0.1)?);
    map.insert(format!("{p}{}", names[2]), u.tensor(&[h, 2 * h], 0.3)?);
    map.insert(format!("{p}{}", names[3]), u.norm(h, 0.1)?);
    if let Some(layers) = fused {
        map.insert(format!("{p}hidden_fc.weight"), u.tensor(&[h, layers.len() * h], 0.3)?);
    }
    if let Some(ids) = draft_vocab {
        let ids: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
        let n = ids.len();
        map.insert("draft_vocab".into(), Tensor::from_vec(ids, n, &Device::Cpu)?);
    }
    candle_core::safetensors::save(&map, dir.join("model.safetensors"))?;
    let mut config = serde_json::json!({
        "model_type": "specula_mtp",
        "num_nextn_predict_layers": 1,
        "num_hidden_layers": c.num_layers,
        "vocab_size": c.vocab_size,
        "hidden_source": "pre_norm",
    });
    if let Some(layers) = fused {
        config["target_layer_ids"] = serde_json::json!(layers);
    }
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config)?)?;
    Ok(())
}

/// Write a random-weight block drafter (DFlash layout) for `target` into `dir`: `layers`
/// drafter layers of the target's block shape, reading the target's `target_layer_ids`.
pub fn write_random_block_drafter(
    dir: &Path,
    target: &crate::model::Model,
    block_size: usize,
    target_layer_ids: &[usize],
    layers: usize,
    seed: u64,
) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut u = Uniform::new(seed);
    let c = target.config();
    let h = c.hidden_size;
    let mut map: HashMap<String, Tensor> = HashMap::new();
    for i in 0..layers {
        map.extend(random_block(&mut u, target, &format!("layers.{i}."))?);
    }
    map.insert("fc.weight".into(), u.tensor(&[h, target_layer_ids.len() * h], 0.3)?);
    map.insert("hidden_norm.weight".into(), u.norm(h, 0.1)?);
    map.insert("norm.weight".into(), u.norm(h, 0.1)?);
    candle_core::safetensors::save(&map, dir.join("model.safetensors"))?;
    let config = serde_json::json!({
        "model_type": "specula_block_drafter",
        "block_size": block_size,
        "target_layer_ids": target_layer_ids,
        "mask_token_id": 0,
        "num_hidden_layers": layers,
        "vocab_size": c.vocab_size,
    });
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config)?)?;
    Ok(())
}
