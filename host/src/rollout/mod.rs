//! Batched sampling of responses from a Qwen3 policy: the rollout phase of GRPO.
//!
//! [`engine`] runs continuous batching over a paged KV cache ([`blocks`],
//! `model::paged`): each prompt is prefilled once, its `n` samples (a GRPO
//! group, Shao et al. 2024, "DeepSeekMath", §4.1) share the prompt's cache
//! blocks, finished rows free their blocks at once and waiting prompts take
//! their place. Tokens are drawn with temperature, top-k and top-p (nucleus,
//! Holtzman et al. 2020) sampling. Every sampled token records the log-prob
//! under the sampling distribution, the log-prob under the untempered policy
//! (pi_old, what the PPO ratio divides by) and the full-vocabulary entropy
//! (what STAPO's S2T mask thresholds). A [`RolloutBatch`] saves to and loads
//! from JSONL so a batch can be replayed offline.
//!
//! [`Generator`] is the one entry point from problems to samples (template,
//! tokens, stop ids, generation, decoded text) used by every caller.

pub mod batch;
pub mod blocks;
pub mod bounds;
pub mod device;
pub mod engine;
pub mod generate;
pub mod generator;
pub mod params;
mod row;
pub mod sampler;

pub use batch::{Finish, PromptInfo, RolloutBatch, Sample};
pub use engine::{EngineConfig, EngineStats, GenerateHooks, KvCacheDtype, Policy, RolloutFigures};
pub use generate::{bench_generate, generate, generate_stats, generate_with};
pub use generator::{check_vocab, Generation, Generator};
pub use params::SamplingParams;
pub use sampler::{row_seed, Sampler, TokenDraw};

/// Fixtures for the unit tests of this module: tiny random models.
#[cfg(test)]
pub(crate) mod test_support {
    use candle_core::{DType, Device};

    use crate::model::{self, Config, Qwen3};

    /// A 2-layer, 64-wide Qwen3 configuration with the given EOS id.
    pub fn tiny_config(eos: Option<u32>) -> Config {
        let eos = eos.map_or("null".to_string(), |e| e.to_string());
        let text = format!(
            r#"{{"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0,
                "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "tie_word_embeddings": true,
                "eos_token_id": {eos}, "torch_dtype": "float32"}}"#
        );
        Config::from_json_str(&text, "tiny").expect("tiny config")
    }

    /// A random tiny model; `std` large enough that logits are far from uniform.
    pub fn tiny_model(eos: Option<u32>, seed: u64) -> Qwen3 {
        model::init(&tiny_config(eos), seed, 0.2, DType::F32, &Device::Cpu).expect("init")
    }

    /// Decodes token `t` as `<t>`, so stop strings can span token boundaries.
    pub fn angle_decode(ids: &[u32]) -> String {
        ids.iter().map(|t| format!("<{t}>")).collect()
    }
}
