//! Bounds checked at the entry of generation, before anything is allocated: the response
//! length and every prompt against the model's `max_position_embeddings` (vLLM refuses a
//! request whose prompt plus `max_tokens` exceeds `max_model_len` the same way), and the
//! KV cache of one sequence against the machine's memory (the engine's paged pool
//! budgets the batch: `rollout.engine.kv_cache_gb`). The bytes per position are
//! `model::PagedKvCache::bytes_per_token`'s, the machine's memory `host_memory`'s: the
//! formula and the memory probe the engine's budget uses.
//!
//! Without them `max_tokens: 10^9` (a CLI flag or a sampling hook's return) aborted the
//! process on a 768 GB allocation, and a prompt past the position table trained silently.

use candle_core::DType;

use super::kv_cache_manager::host_memory;
use super::SamplingParams;
use crate::model::{Config, PagedKvCache};
use crate::{Error, Result};

/// Checks `params.max_new_tokens` and `prompts` (token ids) against `cfg`'s
/// `max_position_embeddings`, and the KV cache of `rows` rows (prompt + response positions,
/// in `dtype`) against the machine's memory (on the CPU; a GPU's pool is its own budget).
pub fn check_generation(
    cfg: &Config,
    dtype: DType,
    on_cpu: bool,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
    rows: usize,
) -> Result<()> {
    let limit = cfg.max_position_embeddings;
    let max_new = params.max_new_tokens;
    if max_new >= limit {
        return Err(Error::invalid(format!(
            "sampling params: `max_tokens` (max_new_tokens) is {max_new}, but the model's \
             max_position_embeddings is {limit}: a response must fit with its prompt in {limit} positions"
        )));
    }
    for (i, p) in prompts.iter().enumerate() {
        if p.len() + max_new > limit {
            let what = if p.len() >= limit {
                format!(
                    "prompt {i} has {} tokens, more than the model's max_position_embeddings ({limit})",
                    p.len()
                )
            } else {
                format!(
                    "prompt {i} ({} tokens) plus max_tokens ({max_new}) is {} positions, more than the model's \
                     max_position_embeddings ({limit}); lower max_tokens to at most {}",
                    p.len(),
                    p.len() + max_new,
                    limit - p.len()
                )
            };
            return Err(Error::invalid(format!("generate: {what}")));
        }
    }
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let bytes = kv_cache_bytes(cfg, dtype, rows, longest + max_new);
    if let (true, Some(total)) = (on_cpu, host_memory().map(|m| m.total as u128)) {
        if bytes > total {
            return Err(Error::invalid(format!(
                "generate: the KV cache of {rows} rows x {} positions would take {:.1} GB, more than this \
                 machine's {:.1} GB of memory; lower max_tokens ({max_new}), n or the number of prompts per batch",
                longest + max_new,
                bytes as f64 / 1e9,
                total as f64 / 1e9
            )));
        }
    }
    Ok(())
}

/// Bytes of keys and values for `rows` sequences of `positions` positions.
pub fn kv_cache_bytes(cfg: &Config, dtype: DType, rows: usize, positions: usize) -> u128 {
    PagedKvCache::bytes_per_token(cfg, dtype) as u128 * rows as u128 * positions as u128
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(max_pos: usize) -> Config {
        let text = format!(
            r#"{{"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "max_position_embeddings": {max_pos}, "torch_dtype": "float32"}}"#
        );
        Config::from_json_str(&text, "tiny").unwrap()
    }

    #[test]
    fn kv_bytes_by_hand() {
        // 2 (k, v) x 2 layers x 2 kv heads x 16 dims x 4 bytes = 512 bytes per position.
        assert_eq!(kv_cache_bytes(&cfg(128), DType::F32, 3, 10), 512 * 30);
    }
}
