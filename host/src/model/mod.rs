//! The Qwen3 model: configuration, differentiable forward, KV-cache decode and
//! Hugging Face checkpoints.

pub mod checkpoint;
pub mod config;
pub mod fused;
pub mod ops;
pub mod qwen3;

pub use checkpoint::{init, load, save};
pub use config::{dtype_name, parse_device, parse_dtype, Config};
pub use qwen3::{logprob_entropy, Grad, KvCache, Qwen3, TokenBatch, WeightSource};
