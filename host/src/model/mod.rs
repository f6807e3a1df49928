//! The Qwen3 model: configuration, differentiable forward, KV-cache decode and
//! Hugging Face checkpoints.

pub mod checkpoint;
pub mod config;
pub mod frozen;
pub mod fused;
pub mod head;
mod held;
#[cfg(test)]
mod kernels_tests;
pub mod layer;
pub mod lora;
pub mod mixed;
pub mod ops;
pub mod options;
pub mod paged;
pub mod paged_attention;
pub mod peft;
pub mod qwen3;
pub mod recompute;

pub use checkpoint::{init, load, save};
pub use config::{dtype_name, parse_device, parse_dtype, Config};
pub use head::{token_stats, TokenStats};
pub use lora::{LoraConfig, Target as LoraTarget};
pub use mixed::RolloutCopy;
pub use options::{Kernels, ModelOptions};
pub use paged::{PagedKvCache, PagedSeq};
pub use qwen3::{logprob_entropy, Grad, KvCache, Qwen3, TokenBatch, WeightSource};
pub use recompute::Recompute;
