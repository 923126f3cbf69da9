//! Specula's inference core: model bundles, dense transformer forward passes with KV rollback and
//! hidden-state taps, sampling, the per-token emit step and generation.
//!
//! See `DESIGN.md` at the repository root for the pipeline and the exactness promise.

pub mod arch;
pub mod bundle;
pub mod cache;
pub mod catalog;
pub mod chat;
pub mod constraint;
#[cfg(feature = "cuda-backend")]
pub mod cuda;
pub mod device;
pub mod emit;
pub mod engine;
pub mod inspect;
pub mod kernels;
pub mod kv_cache;
pub mod model;
pub mod prefix_cache;
pub mod sampling;
pub mod sequence;
pub mod speculative;
pub mod target;
/// Tiny random bundles for tests (the `testing` feature; the CUDA bench uses it for its
/// exactness checks).
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod tokenizer;
pub mod tuning;
pub mod types;

pub use chat::ChatMessage;
pub use engine::{Engine, LoadOptions};
pub use sampling::SamplingParams;
pub use types::*;
