//! The CUDA backend (feature `cuda`): a dense Llama / Qwen2 / Qwen3 forward on one NVIDIA GPU,
//! built for decode and verify, and batch-invariant like the CPU kernels.
//!
//! * Projection weights are bf16 or Q8_0 in device memory (synthetic ones generated on the
//!   device, `--dtype q8_0` for Q8_0), or a bundle's tensors converted to bf16 at load (GGUF
//!   quantized types are dequantized: keeping Q8_0 tensors quantized is not built yet). Norms and
//!   the embedding are bf16.
//! * The projections run on tensor cores (`mma.sync`) for any row count, with a fold order that
//!   depends only on K, so decode, verify and batched rows get the same bits.
//! * The KV cache is preallocated, `[layers][slots][max_ctx][kv_heads][head_dim]` bf16, and
//!   written in place; a row names its slot and position, so one forward serves a verify block of
//!   one sequence, decode rows of many sequences, or a mix (continuous batching). Rolling back a
//!   rejected draft is free: the next forward overwrites those positions.
//! * Token, position and slot of each row live in device memory, so one captured CUDA graph per
//!   row count (up to [`GRAPH_MAX_ROWS`]) replays every decode / verify step of that width.
//! * Batch invariance: every kernel computes a row with the same instructions in the same order
//!   whatever the other rows are (`kernels.cu` says how), so the logits of row i of a k+1-row
//!   verify are bitwise those of a one-row decode at that position. [`bench`] checks this on the
//!   device, and checks greedy n-gram speculation against AR.
//!
//! Source: the model math is HF transformers' `modeling_llama` / `modeling_qwen2` /
//! `modeling_qwen3` (RMSNorm, rotate-half RoPE, GQA attention, SwiGLU).

pub mod bench;
mod forward;
mod gemm;
pub mod load;
mod runtime;

use crate::device::{RowNeed, RowOut};
use anyhow::{bail, Result};
use cudarc::driver::{sys, CudaContext};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::Arc;

pub use load::{GpuConfig, SHAPES};

pub use forward::*;
pub use gemm::*;
pub use runtime::*;
