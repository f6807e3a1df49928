//! The Qwen3 model: configuration, differentiable forward, KV-cache decode and
//! Hugging Face checkpoints.

pub mod budget;
pub mod checkpoint;
pub mod config;
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod cuda_ops;
pub mod decode;
pub mod frozen;
pub mod fused;
pub mod head;
#[cfg(test)]
mod kernels_tests;
pub mod layer;
mod layer_grad;
pub mod lora;
pub mod ops;
pub mod options;
pub mod paged;
pub mod paged_attention;
#[cfg(feature = "cuda")]
pub mod paged_cuda;
pub mod peft;
mod precomputed;
pub mod qwen3;
pub mod recompute;
pub mod rollout_copy;

pub use checkpoint::{init, save};
pub use config::{dtype_name, parse_device, parse_dtype, Config};
pub use decode::DecodeWeights;
pub use fused::Kernels;
pub use head::{token_stats, TokenStats};
pub use lora::{LoraConfig, Target as LoraTarget};
pub use options::ModelOptions;
pub use paged::{decode_paged, PagedKvCache, PagedSeq};
pub use qwen3::{logprob_entropy, Grad, KvCache, Qwen3, TokenBatch, WeightSource};
pub use recompute::Recompute;
pub use rollout_copy::RolloutCopy;

/// Loads the model in `dir` with weights converted to `dtype` on `device`: a
/// Hugging Face folder ([`checkpoint::load`]), or a peft adapter folder
/// (`adapter_config.json`, no `config.json`), whose base model loads with the
/// adapters on ([`peft::load_with_adapter`]).
pub fn load(
    dir: &std::path::Path,
    dtype: candle_core::DType,
    device: &candle_core::Device,
) -> crate::Result<Qwen3> {
    if peft::is_adapter_dir(dir) && !dir.join("config.json").is_file() {
        return Ok(peft::load_with_adapter(dir, None, dtype, device)?.0);
    }
    checkpoint::load(dir, dtype, device)
}
