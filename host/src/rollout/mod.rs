//! Batched sampling of responses from a Qwen3 policy: the rollout phase of GRPO.
//!
//! The engine runs continuous batching over a paged KV cache, in the shape of
//! vLLM v1 and mistral.rs's `paged_attention`: [`engine`] is the loop;
//! `scheduler/` picks each step's work (the queues of `request.rs`, a
//! [`SchedulePolicy`] per file: continuous batching, static batching);
//! `kv_cache_manager.rs` owns the block budget and the cache ([`blocks`]:
//! reference-counted blocks, prefix caching; `model::paged`: the tensors);
//! `model_runner.rs` runs the model call and draws; [`stats`] records what a
//! call did. Each prompt is prefilled once, its `n` samples (a GRPO group,
//! Shao et al. 2024, "DeepSeekMath", §4.1) share the prompt's cache blocks,
//! finished rows free their blocks at once and waiting prompts take their
//! place. Tokens are drawn with temperature, top-k, top-p (nucleus, Holtzman
//! et al. 2020) and min-p sampling. Every sampled token records the log-prob
//! under the sampling distribution, the log-prob under the untempered policy
//! (pi_old, what the PPO ratio divides by) and the full-vocabulary entropy
//! (what STAPO's S2T mask thresholds). A [`RolloutBatch`] saves to and loads
//! from JSONL so a batch can be replayed offline.
//!
//! Two entry points: [`generate_tokens`] takes token ids (and checks them),
//! [`generate_text`]'s [`Generator`] takes problems (template, tokens, stop
//! ids, generation, decoded text) and is what every caller uses. Partial
//! rollouts ([`partial`]) keep unfinished responses between calls: a
//! [`PartialRollout`] holds the groups in flight, and each call
//! ([`generate_partial`], `Generator::generate_partial`) returns the groups
//! that finished whole.

pub mod batch;
pub mod blocks;
#[cfg(test)]
mod blocks_tests;
pub mod bounds;
pub mod config;
pub mod device;
pub mod engine;
#[cfg(test)]
mod engine_tests;
pub mod generate_text;
pub mod generate_tokens;
pub mod kv_cache_manager;
mod model_runner;
pub mod params;
pub mod partial;
#[cfg(test)]
mod partial_tests;
mod request;
mod row;
pub mod sampler;
mod scheduler;
pub mod stats;

pub use batch::{Finish, PromptInfo, RolloutBatch, Sample};
pub use config::{EngineConfig, KvCacheDtype};
pub use engine::GenerateOptions;
pub use generate_text::{check_vocab, Generation, Generator};
pub use generate_tokens::{bench_generate, generate, generate_partial, generate_stats, generate_with};
pub use params::SamplingParams;
pub use partial::{OnStale, PartialConfig, PartialFigures, PartialKv, PartialRollout, PartialStep};
pub use row::CarriedResponse;
pub use sampler::{row_seed, Sampler, TokenDraw};
pub use scheduler::{SchedulePolicy, PREFILL_TOKENS};
pub use stats::{EngineStats, Phases};

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
