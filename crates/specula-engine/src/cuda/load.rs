//! Weights for the CUDA path: synthetic ones of a named architecture's shape, generated on the
//! device (vLLM's `--load-format dummy`), or a bundle's tensors converted to bf16 at load.

use super::{DevBuf, Gpu, GpuModel, Layer, LayerMlp, Mat, MoeLayer, Weights};
use crate::arch::{BundleFormat, Role, TensorSpec};
use crate::model::{ModelConfig, RopeStyle};
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::Path;

/// The hyper-parameters the CUDA forward needs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GpuConfig {
    pub name: String,
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f32,
    pub rope_theta: f64,
    /// Per-head RMSNorm of q and k (Qwen3).
    pub qk_norm: bool,
    /// Biases on q, k, v (Qwen2).
    pub qkv_bias: bool,
    /// LM head tied to the embedding.
    pub tied: bool,
    /// llama.cpp's adjacent-pair RoPE (GGUF Llama files); otherwise rotate-half.
    pub interleaved_rope: bool,
    /// RoPE inverse frequencies, `head_dim / 2` values.
    #[serde(skip)]
    pub inv_freq: Vec<f32>,
    /// The routed experts of an MoE model; None: dense.
    pub moe: Option<GpuMoe>,
}

/// The experts of an MoE model on the device ([`crate::arch::MoeConfig`]).
#[derive(Debug, Clone, serde::Serialize)]
pub struct GpuMoe {
    pub experts: usize,
    pub top_k: usize,
    pub expert_inter: usize,
    /// The shared expert's width (Qwen2-MoE); None: none.
    pub shared_inter: Option<usize>,
    pub norm_topk: bool,
    /// Per layer, whether its MLP is the MoE.
    pub layers: Vec<bool>,
}

/// Llama 3.1's RoPE frequency scaling (`rope_type: llama3`): factor, low and high frequency
/// factors, original context.
#[derive(Debug, Clone, Copy)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_context: f64,
}

/// `theta^(-2i/d)` for i < d/2, with Llama 3.1's scaling when given (transformers
/// `_compute_llama3_parameters`).
pub fn rope_inv_freq(head_dim: usize, theta: f64, scaling: Option<Llama3Scaling>) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| {
            let f = 1.0 / theta.powf(2.0 * i as f64 / head_dim as f64);
            let Some(s) = scaling else { return f as f32 };
            let wavelen = 2.0 * std::f64::consts::PI / f;
            let low_wavelen = s.original_context / s.low_freq_factor;
            let high_wavelen = s.original_context / s.high_freq_factor;
            let v = if wavelen > low_wavelen {
                f / s.factor
            } else if wavelen < high_wavelen {
                f
            } else {
                let smooth =
                    (s.original_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * f / s.factor + smooth * f
            };
            v as f32
        })
        .collect()
}

/// A named architecture shape for synthetic weights.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub name: &'static str,
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    pub qk_norm: bool,
    pub tied: bool,
    pub llama3_scaling: Option<Llama3Scaling>,
    /// Routed experts: (experts, per token, expert width); every layer MoE.
    pub moe: Option<(usize, usize, usize)>,
}

const LLAMA31: Llama3Scaling = Llama3Scaling {
    factor: 8.0,
    low_freq_factor: 1.0,
    high_freq_factor: 4.0,
    original_context: 8192.0,
};

/// The shapes `specula bench --shape` knows (from each model's config.json).
pub const SHAPES: &[Shape] = &[
    Shape {
        name: "qwen3-0.6b",
        vocab: 151936,
        hidden: 1024,
        intermediate: 3072,
        layers: 28,
        heads: 16,
        kv_heads: 8,
        head_dim: 128,
        rope_theta: 1_000_000.0,
        qk_norm: true,
        tied: true,
        llama3_scaling: None,
        moe: None,
    },
    Shape {
        name: "qwen3-1.7b",
        vocab: 151936,
        hidden: 2048,
        intermediate: 6144,
        layers: 28,
        heads: 16,
        kv_heads: 8,
        head_dim: 128,
        rope_theta: 1_000_000.0,
        qk_norm: true,
        tied: true,
        llama3_scaling: None,
        moe: None,
    },
    Shape {
        name: "qwen3-8b",
        vocab: 151936,
        hidden: 4096,
        intermediate: 12288,
        layers: 36,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        rope_theta: 1_000_000.0,
        qk_norm: true,
        tied: false,
        llama3_scaling: None,
        moe: None,
    },
    Shape {
        name: "llama-3.1-8b",
        vocab: 128256,
        hidden: 4096,
        intermediate: 14336,
        layers: 32,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        rope_theta: 500_000.0,
        qk_norm: false,
        tied: false,
        llama3_scaling: Some(LLAMA31),
        moe: None,
    },
    Shape {
        name: "qwen3-30b-a3b",
        vocab: 151936,
        hidden: 2048,
        intermediate: 6144,
        layers: 48,
        heads: 32,
        kv_heads: 4,
        head_dim: 128,
        rope_theta: 1_000_000.0,
        qk_norm: true,
        tied: false,
        llama3_scaling: None,
        moe: Some((128, 8, 768)),
    },
];

/// Look a shape up by name. Errors: an unknown name (the message lists the known ones).
pub fn shape(name: &str) -> Result<Shape> {
    SHAPES.iter().copied().find(|s| s.name == name).ok_or_else(|| {
        anyhow!(
            "unknown shape '{name}'; known: {}",
            SHAPES.iter().map(|s| s.name).collect::<Vec<_>>().join(", ")
        )
    })
}

impl Shape {
    pub fn config(&self) -> GpuConfig {
        GpuConfig {
            name: self.name.to_string(),
            vocab: self.vocab,
            hidden: self.hidden,
            intermediate: self.intermediate,
            layers: self.layers,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            rms_eps: 1e-6,
            rope_theta: self.rope_theta,
            qk_norm: self.qk_norm,
            qkv_bias: false,
            tied: self.tied,
            interleaved_rope: false,
            inv_freq: rope_inv_freq(self.head_dim, self.rope_theta, self.llama3_scaling),
            moe: self.moe.map(|(experts, top_k, expert_inter)| GpuMoe {
                experts,
                top_k,
                expert_inter,
                shared_inter: None,
                norm_topk: true,
                layers: vec![true; self.layers],
            }),
        }
    }
}

/// A bf16 tensor of `n` values filled on the device with `offset + scale·U(-1, 1)`.
fn synth(gpu: &Gpu, n: usize, seed: &mut u64, scale: f32, offset: f32) -> Result<DevBuf> {
    let b = DevBuf::new(n * 2)?;
    *seed = seed.wrapping_add(0x1234_5678_9ABC_DEF1);
    gpu.fill_uniform_bf16(b.at(0), n, *seed, scale, offset)?;
    Ok(b)
}

/// The storage of synthetic projection weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum WeightDtype {
    #[serde(rename = "bf16")]
    Bf16,
    /// llama.cpp's Q8_0: int8 values, one scale per 32.
    #[serde(rename = "q8_0")]
    Q8_0,
}

impl std::str::FromStr for WeightDtype {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" => Ok(Self::Bf16),
            "q8_0" | "q8" => Ok(Self::Q8_0),
            _ => bail!("unknown weight dtype '{s}': use bf16 or q8_0"),
        }
    }
}

/// A projection `[n, k]` with values `U(-1, 1)/sqrt(k)` (bf16), or int8 values with per-chunk
/// scales of the same range (Q8_0).
fn synth_mat(gpu: &Gpu, n: usize, k: usize, seed: &mut u64, dtype: WeightDtype) -> Result<Mat> {
    let scale = 1.0 / (k as f32).sqrt();
    match dtype {
        WeightDtype::Bf16 => Ok(Mat::bf16(synth(gpu, n * k, seed, scale, 0.0)?)),
        WeightDtype::Q8_0 => {
            let q = DevBuf::new(n * k)?;
            let d = DevBuf::new(n * k.div_ceil(32) * 4)?;
            *seed = seed.wrapping_add(0x1234_5678_9ABC_DEF1);
            gpu.fill_q8(q.at(0), d.at(0), n * k, k, *seed, scale / 127.0)?;
            Ok(Mat {
                data: q,
                scales: Some(d),
            })
        }
    }
}

/// A model of `config`'s shape with random weights generated on the device from `seed`:
/// projections `U(-1, 1)/sqrt(fan_in)` stored as `dtype` (the LM head too when it is not tied),
/// norms `1 + U(-0.1, 0.1)`, embedding `U(-1, 1)` (bf16).
pub fn synthetic(
    gpu: Gpu,
    config: GpuConfig,
    seed: u64,
    slots: usize,
    max_ctx: usize,
    dtype: WeightDtype,
) -> Result<GpuModel> {
    let c = &config;
    let mut sd = seed;
    let (h, hd) = (c.hidden, c.head_dim);
    let qkv_w = (c.heads + 2 * c.kv_heads) * hd;
    let mut layers = Vec::with_capacity(c.layers);
    for _ in 0..c.layers {
        layers.push(Layer {
            attn_norm: synth(&gpu, h, &mut sd, 0.1, 1.0)?,
            qkv: synth_mat(&gpu, qkv_w, h, &mut sd, dtype)?,
            qkv_bias: None,
            q_norm: if c.qk_norm {
                Some(synth(&gpu, hd, &mut sd, 0.1, 1.0)?)
            } else {
                None
            },
            k_norm: if c.qk_norm {
                Some(synth(&gpu, hd, &mut sd, 0.1, 1.0)?)
            } else {
                None
            },
            o: synth_mat(&gpu, h, c.heads * hd, &mut sd, dtype)?,
            mlp_norm: synth(&gpu, h, &mut sd, 0.1, 1.0)?,
            mlp: match &c.moe {
                None => LayerMlp::Dense {
                    gate_up: synth_mat(&gpu, 2 * c.intermediate, h, &mut sd, dtype)?,
                    down: synth_mat(&gpu, h, c.intermediate, &mut sd, dtype)?,
                },
                Some(m) => {
                    let (e, i) = (m.experts, m.expert_inter);
                    // The router's rows scaled so the softmax spreads (U(-1, 1)·4/sqrt(h)), in
                    // bf16; the experts in `dtype`.
                    LayerMlp::Moe(MoeLayer {
                        experts: e,
                        router: Mat::bf16(synth(&gpu, e * h, &mut sd, 4.0 / (h as f32).sqrt(), 0.0)?),
                        gate_up: synth_mat(&gpu, e * 2 * i, h, &mut sd, dtype)?,
                        down: synth_mat(&gpu, e * h, i, &mut sd, dtype)?,
                        shared: None,
                    })
                }
            },
        });
    }
    let w = Weights {
        embed: synth(&gpu, c.vocab * h, &mut sd, 1.0, 0.0)?,
        lm_head: if c.tied {
            None
        } else {
            Some(synth_mat(&gpu, c.vocab, h, &mut sd, dtype)?)
        },
        final_norm: synth(&gpu, h, &mut sd, 0.1, 1.0)?,
        layers,
    };
    gpu.synchronize()?;
    GpuModel::new(gpu, config, w, slots, max_ctx)
}

fn to_bf16_bits(t: &Tensor) -> Result<Vec<u16>> {
    let v: Vec<half::bf16> = t.to_dtype(DType::BF16)?.flatten_all()?.to_vec1()?;
    Ok(v.into_iter().map(|x| x.to_bits()).collect())
}

fn upload_bf16(gpu: &Gpu, parts: &[&Tensor]) -> Result<DevBuf> {
    let mut bits = Vec::new();
    for p in parts {
        bits.extend(to_bf16_bits(p)?);
    }
    let b = DevBuf::new(bits.len() * 2)?;
    gpu.upload(b.at(0), &bits)?;
    Ok(b)
}

fn upload_mat(gpu: &Gpu, parts: &[&Tensor]) -> Result<Mat> {
    Ok(Mat::bf16(upload_bf16(gpu, parts)?))
}

/// The `[gate; up]` matrix in the row order the GEMM's SiLU epilogue and `silu_mul` read:
/// groups of 8 gate rows, each followed by the 8 up rows of the same features, `[2 I, H]` bf16
/// (`interleave_gate_up`). Errors: gate and up of different shapes, or I not a multiple of 8.
fn upload_gate_up(gpu: &Gpu, gate: &Tensor, up: &Tensor) -> Result<Mat> {
    if gate.dims() != up.dims() || gate.dims().len() != 2 || !gate.dims()[0].is_multiple_of(8) {
        bail!(
            "gate_proj {:?} and up_proj {:?}: the CUDA path needs two [I, H] matrices with I a multiple of 8",
            gate.dims(),
            up.dims()
        );
    }
    let h = gate.dims()[1];
    let bits = interleave_gate_up(&to_bf16_bits(gate)?, &to_bf16_bits(up)?, h);
    let b = DevBuf::new(bits.len() * 2)?;
    gpu.upload(b.at(0), &bits)?;
    Ok(Mat::bf16(b))
}

/// Rows of `gate` and `up` (both `[I, h]`, I a multiple of 8) as 8 gate rows, the 8 up rows of
/// the same features, the next 8 gate rows, ...: `[2 I, h]`.
pub(crate) fn interleave_gate_up<T: Copy>(gate: &[T], up: &[T], h: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(gate.len() + up.len());
    for (g, u) in gate.chunks(8 * h).zip(up.chunks(8 * h)) {
        out.extend_from_slice(g);
        out.extend_from_slice(u);
    }
    out
}

fn upload_f32(gpu: &Gpu, parts: &[&Tensor]) -> Result<DevBuf> {
    let mut v = Vec::new();
    for p in parts {
        v.extend(p.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
    }
    let b = DevBuf::new(v.len() * 4)?;
    gpu.upload(b.at(0), &v)?;
    Ok(b)
}

/// Every tensor of a bundle, dequantized to f32 and named as in HF checkpoints (GGUF names
/// translated by the architecture's tensor schema, `schema`).
fn read_tensors(path: &Path, schema: &[TensorSpec]) -> Result<HashMap<String, Tensor>> {
    if path.is_dir() {
        return Ok(crate::speculative::head::NamedTensors::read(path)?.map);
    }
    let mut file =
        std::io::BufReader::new(std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?);
    let content =
        candle_core::quantized::gguf_file::Content::read(&mut file).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let mut out = HashMap::new();
    let names: Vec<String> = content.tensor_infos.keys().cloned().collect();
    for name in names {
        let t = content
            .tensor(&mut file, &name, &Device::Cpu)
            .map_err(|e| anyhow!("{}: reading tensor '{name}': {e}", path.display()))?;
        let hf = crate::arch::rename(schema, &name, BundleFormat::Gguf, BundleFormat::Hf).unwrap_or(name);
        out.insert(hf, t.dequantize(&Device::Cpu)?);
    }
    Ok(out)
}

/// The MoE MLP of layer `l` from a bundle's tensors `t` (HF names where the schema has one,
/// GGUF names for the stacked experts): the router (and the shared expert's gate row) as one
/// matrix, each expert's gate rows then up rows, the downs, the shared expert as a dense MLP.
fn upload_moe(
    gpu: &Gpu,
    t: &HashMap<String, Tensor>,
    schema: &[TensorSpec],
    l: usize,
    m: &GpuMoe,
    path: &Path,
) -> Result<MoeLayer> {
    let get = |n: &str| -> Result<&Tensor> {
        t.get(n)
            .ok_or_else(|| anyhow!("{}: tensor '{n}' is missing", path.display()))
    };
    let named = |r: Role, f: BundleFormat| {
        schema
            .iter()
            .find(|s| s.role == r && !s.base(f).is_empty() && !s.per_expert)
            .map(|s| s.name(f, l))
    };
    let hf = |r: Role| named(r, BundleFormat::Hf).ok_or_else(|| anyhow!("the tensor schema has no {r:?}"));
    // Per expert, the [out, in] matrix of `role`: one tensor each (HF) or the stacked GGUF one.
    let experts = |r: Role| -> Result<Vec<Tensor>> {
        if let Some(s) = schema.iter().find(|s| s.role == r && s.per_expert) {
            let first = s.expert_name(BundleFormat::Hf, l, 0);
            if t.contains_key(&first) {
                return (0..m.experts)
                    .map(|e| Ok(get(&s.expert_name(BundleFormat::Hf, l, e))?.clone()))
                    .collect();
            }
        }
        let stacked = named(r, BundleFormat::Gguf).ok_or_else(|| anyhow!("the tensor schema has no stacked {r:?}"))?;
        let x = get(&stacked)?;
        (0..m.experts).map(|e| Ok(x.get(e)?)).collect()
    };
    let gates = experts(Role::FfnGateExps)?;
    let ups = experts(Role::FfnUpExps)?;
    let downs = experts(Role::FfnDownExps)?;
    let mut gu: Vec<&Tensor> = Vec::with_capacity(2 * m.experts);
    for (g, u) in gates.iter().zip(&ups) {
        gu.push(g);
        gu.push(u);
    }
    let mut router = vec![get(&hf(Role::FfnRouter)?)?.clone()];
    let shared = match m.shared_inter {
        None => None,
        Some(_) => {
            router.push(get(&hf(Role::FfnRouterShexp)?)?.reshape((1, ()))?);
            Some((
                upload_gate_up(gpu, get(&hf(Role::FfnGateShexp)?)?, get(&hf(Role::FfnUpShexp)?)?)?,
                upload_mat(gpu, &[get(&hf(Role::FfnDownShexp)?)?])?,
            ))
        }
    };
    let router_refs: Vec<&Tensor> = router.iter().collect();
    Ok(MoeLayer {
        experts: m.experts,
        router: upload_mat(gpu, &router_refs)?,
        gate_up: upload_mat(gpu, &gu)?,
        down: upload_mat(gpu, &downs.iter().collect::<Vec<_>>())?,
        shared,
    })
}

/// The [`GpuConfig`] of a bundle's [`ModelConfig`].
pub fn config_of(c: &ModelConfig, name: &str, tied: bool) -> GpuConfig {
    // The CUDA forward runs the dense block with one plan for every layer.
    let plan = crate::arch::of(c)
        .layer_plan(c)
        .first()
        .copied()
        .unwrap_or(crate::arch::LayerPlan {
            attention: crate::arch::AttentionKind::Full,
            mlp: crate::arch::MlpKind::DenseSwiGlu,
            qkv_bias: false,
            qk_norm: false,
            parallel: false,
            post_norms: false,
        });
    GpuConfig {
        name: name.to_string(),
        vocab: c.vocab_size,
        hidden: c.hidden_size,
        intermediate: c.intermediate_size,
        layers: c.num_layers,
        heads: c.num_heads,
        kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        rms_eps: c.rms_norm_eps as f32,
        rope_theta: c.rope_theta,
        qk_norm: plan.qk_norm,
        qkv_bias: plan.qkv_bias,
        tied,
        interleaved_rope: c.rope_style == RopeStyle::Interleaved,
        inv_freq: rope_inv_freq(c.head_dim, c.rope_theta, None),
        moe: c.moe.as_ref().map(|m| GpuMoe {
            experts: m.experts,
            top_k: m.experts_per_token,
            expert_inter: m.expert_intermediate_size,
            shared_inter: m.shared_intermediate_size,
            norm_topk: m.norm_topk_prob,
            layers: m.layers.clone(),
        }),
    }
}

/// Load a bundle (GGUF file or HF directory) onto the GPU as bf16, with `config` its parsed
/// [`ModelConfig`] (the CPU loader's). Errors name the bundle and the missing tensor.
///
/// The layers must be of the kinds the CUDA forward has kernels for (full attention, pre-norm,
/// SwiGLU or MoE MLPs): the engine's target ([`engine_target`]) also needs the architecture to
/// be validated on a GPU ([`crate::arch::Architecture::runs_on_cuda`]); `bench` checks the
/// others against the CPU.
pub fn from_bundle(gpu: Gpu, path: &Path, config: &ModelConfig, slots: usize, max_ctx: usize) -> Result<GpuModel> {
    let arch = crate::arch::of(config);
    let kernels_exist = arch.layer_plan(config).iter().all(|p| {
        p.attention == crate::arch::AttentionKind::Full
            && !p.post_norms
            && !p.parallel
            && matches!(
                p.mlp,
                crate::arch::MlpKind::DenseSwiGlu | crate::arch::MlpKind::Moe | crate::arch::MlpKind::MoeShared
            )
    }) && arch.embedding_scale(config).is_none();
    if !kernels_exist {
        bail!(
            "{}: the {} architecture does not run on the CUDA backend yet (run it on the CPU)",
            path.display(),
            arch.name()
        );
    }
    let t = read_tensors(path, arch.tensors())?;
    let hf = |r: Role, l: usize| crate::arch::spec(arch.tensors(), r).name(BundleFormat::Hf, l);
    let get = |n: &str| -> Result<&Tensor> {
        t.get(n)
            .ok_or_else(|| anyhow!("{}: tensor '{n}' is missing", path.display()))
    };
    let tied = !t.contains_key(&hf(Role::Output, 0));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let mut gc = config_of(config, &name, tied);
    // Llama 3.1's frequency factors; architectures without the tensor have no entry for it.
    let rope_freqs = arch
        .tensors()
        .iter()
        .find(|s| s.role == Role::RopeFreqs)
        .map(|s| s.name(BundleFormat::Gguf, 0))
        .unwrap_or_default();
    if let Some(f) = t.get(&rope_freqs) {
        // llama.cpp's Llama 3.1 scaling: each frequency divided by its factor (as the CPU
        // model does).
        let f: Vec<f32> = f.flatten_all()?.to_vec1()?;
        if f.len() != gc.inv_freq.len() {
            bail!(
                "{}: {rope_freqs} has {} values, the model needs head_dim / 2 = {}",
                path.display(),
                f.len(),
                gc.inv_freq.len()
            );
        }
        for (x, d) in gc.inv_freq.iter_mut().zip(f) {
            *x /= d;
        }
    }
    let mut layers = Vec::with_capacity(gc.layers);
    for l in 0..gc.layers {
        let p = |r: Role| hf(r, l);
        let bias = if gc.qkv_bias {
            Some(upload_f32(
                &gpu,
                &[
                    get(&p(Role::AttnQBias))?,
                    get(&p(Role::AttnKBias))?,
                    get(&p(Role::AttnVBias))?,
                ],
            )?)
        } else {
            None
        };
        let norm = |r: Role| -> Result<Option<DevBuf>> {
            if gc.qk_norm {
                Ok(Some(upload_bf16(&gpu, &[get(&p(r))?])?))
            } else {
                Ok(None)
            }
        };
        layers.push(Layer {
            attn_norm: upload_bf16(&gpu, &[get(&p(Role::AttnNorm))?])?,
            qkv: upload_mat(
                &gpu,
                &[get(&p(Role::AttnQ))?, get(&p(Role::AttnK))?, get(&p(Role::AttnV))?],
            )?,
            qkv_bias: bias,
            q_norm: norm(Role::AttnQNorm)?,
            k_norm: norm(Role::AttnKNorm)?,
            o: upload_mat(&gpu, &[get(&p(Role::AttnOutput))?])?,
            mlp_norm: upload_bf16(&gpu, &[get(&p(Role::FfnNorm))?])?,
            mlp: match &gc.moe {
                Some(m) if m.layers.get(l).copied().unwrap_or(false) => {
                    LayerMlp::Moe(upload_moe(&gpu, &t, arch.tensors(), l, m, path)?)
                }
                _ => LayerMlp::Dense {
                    gate_up: upload_gate_up(&gpu, get(&p(Role::FfnGate))?, get(&p(Role::FfnUp))?)?,
                    down: upload_mat(&gpu, &[get(&p(Role::FfnDown))?])?,
                },
            },
        });
    }
    let embed = get(&hf(Role::TokenEmbedding, 0))?;
    if embed.dims() != [gc.vocab, gc.hidden] {
        bail!(
            "{}: the embedding is {:?}, the config says [{}, {}]",
            path.display(),
            embed.dims(),
            gc.vocab,
            gc.hidden
        );
    }
    let w = Weights {
        embed: upload_bf16(&gpu, &[embed])?,
        lm_head: if tied {
            None
        } else {
            Some(upload_mat(&gpu, &[get(&hf(Role::Output, 0))?])?)
        },
        final_norm: upload_bf16(&gpu, &[get(&hf(Role::OutputNorm, 0))?])?,
        layers,
    };
    gpu.synchronize()?;
    GpuModel::new(gpu, gc, w, slots, max_ctx)
}

/// The target of an [`crate::Engine`] on GPU `ordinal`: the bundle at `path` (its parsed
/// `config`) in bf16, with KV slots for up to `want_slots` sequences of `context` positions
/// (at most the model's) in at most 90% of the memory left after the weights (fewer slots, or
/// a shorter context, when they do not fit: [`GpuModel::fit_kv`]). Errors: no usable GPU, a
/// bundle the CUDA path cannot run, not enough memory for one slot.
pub fn engine_target(
    ordinal: usize,
    path: &Path,
    config: &ModelConfig,
    want_slots: usize,
    context: usize,
) -> Result<GpuModel> {
    let arch = crate::arch::of(config);
    if !arch.runs_on_cuda() {
        bail!(
            "{}: the {} architecture does not run on the CUDA backend yet (run it on the CPU)",
            path.display(),
            arch.name()
        );
    }
    let gpu = Gpu::open(ordinal)?;
    let mut m = from_bundle(gpu, path, config, 1, 16)?;
    m.fit_kv(want_slots, context.clamp(1, config.context_length), 0.9)?;
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::interleave_gate_up;

    /// Row r of the interleaved matrix is gate row 8 (r / 16) + r % 16 for r % 16 < 8, else the
    /// up row of the same feature: what `silu_mul` and the GEMM's SiLU epilogue read.
    #[test]
    fn gate_up_rows_interleave_in_groups_of_8() {
        let (i, h) = (24, 3);
        let gate: Vec<u32> = (0..i * h).map(|v| v as u32).collect();
        let up: Vec<u32> = (0..i * h).map(|v| 1000 + v as u32).collect();
        let out = interleave_gate_up(&gate, &up, h);
        assert_eq!(out.len(), 2 * i * h);
        for r in 0..2 * i {
            let f = 8 * (r / 16) + r % 8;
            let src = if r % 16 < 8 { &gate } else { &up };
            assert_eq!(&out[r * h..(r + 1) * h], &src[f * h..(f + 1) * h], "row {r}");
        }
    }
}
