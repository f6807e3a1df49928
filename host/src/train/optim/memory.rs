//! What one rank of a full fine-tune holds, by shard mode: the accounting of
//! ZeRO's paper (Rajbhandari et al., SC 2020, section 3: `2Ψ` bf16 weights, `2Ψ`
//! gradients, `KΨ` optimizer state with `K = 12` for f32 master weights and
//! AdamW's two moments), applied to what stapo holds, and the activations of one
//! update with layer recompute (docs/performance.md).
//!
//! Where stapo differs from DeepSpeed's ZeRO-2: candle's backward produces every
//! gradient at once, so the full bf16 gradients (`2Ψ`) exist at the end of the
//! backward in every mode; ZeRO-2 frees them round by round as it reduce-scatters,
//! before the step allocates its f32 gradient shard (`4Ψ/N`), whereas ZeRO-1 holds
//! both at the step. The optimizer bytes are those [`Optimizer::state_bytes`]
//! reports (`12Ψ/N` with master weights; padding to equal blocks aside).
//!
//! [`Optimizer::state_bytes`]: super::Optimizer::state_bytes

use super::config::ShardMode;
use crate::model::Config;

/// Bytes one rank holds at its peak, by kind.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PerRank {
    /// The full weights, bf16.
    pub weights: f64,
    /// Gradients at the peak: the full bf16 gradients, plus (ZeRO-1) the f32 shard.
    pub gradients: f64,
    /// f32 master weights and AdamW moments (whole, or this rank's range).
    pub optimizer: f64,
    /// Activations of one update over `tokens` tokens with layer recompute.
    pub activations: f64,
}

impl PerRank {
    /// The sum.
    pub fn total(&self) -> f64 {
        self.weights + self.gradients + self.optimizer + self.activations
    }
}

/// Activation bytes of one update over `tokens` tokens of `cfg` in bf16 with every
/// layer recomputed: each layer's stored input, the recomputed layer's q, k, v,
/// attention output, MLP gate/up/activation and norms with their gradients, and two
/// 64 MB tiles of the chunked vocabulary head.
pub fn activation_bytes(cfg: &Config, tokens: usize) -> f64 {
    let (h, i, d) = (cfg.hidden_size as f64, cfg.intermediate_size as f64, cfg.head_dim as f64);
    let (nq, nkv) = (cfg.num_attention_heads as f64, cfg.num_key_value_heads as f64);
    let t = tokens as f64;
    let stored = cfg.num_hidden_layers as f64 * t * h * 2.0;
    let per_token = 2.0 * nq * d + 2.0 * nkv * d + 3.0 * i + 4.0 * h;
    let recomputed = 2.0 * t * per_token * 2.0;
    stored + recomputed + 2.0 * 64e6
}

/// What one of `ranks` ranks holds in a full fine-tune of `cfg` (bf16 weights, f32
/// master weights and moments) over `tokens` tokens per update, in `mode`.
pub fn per_rank(cfg: &Config, ranks: usize, mode: ShardMode, tokens: usize) -> PerRank {
    let p = cfg.num_params() as f64;
    let n = ranks.max(1) as f64;
    let (gradients, optimizer) = match mode {
        ShardMode::None => (2.0 * p, 12.0 * p),
        ShardMode::Optimizer => (2.0 * p + 4.0 * p / n, 12.0 * p / n),
        ShardMode::Gradients => ((2.0 * p).max(4.0 * p / n), 12.0 * p / n),
    };
    PerRank { weights: 2.0 * p, gradients, optimizer, activations: activation_bytes(cfg, tokens) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen3(hidden: usize, layers: usize, intermediate: usize, heads: usize) -> Config {
        let v = serde_json::json!({
            "vocab_size": 151936, "hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 8,
            "head_dim": 128, "tie_word_embeddings": false, "max_position_embeddings": 40960,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        });
        Config::from_json_str(&v.to_string(), "qwen3").unwrap()
    }

    /// The table of docs/distributed.md, row by row from [`per_rank`]: Qwen3-8B and
    /// -14B (their config.json shapes) on 8 and 16 GPUs of 141 GB, 16k tokens.
    fn table() -> Vec<String> {
        let mut rows = Vec::new();
        for (name, cfg) in [("8B", qwen3(4096, 36, 12288, 32)), ("14B", qwen3(5120, 40, 17408, 40))] {
            for ranks in [8, 16] {
                for mode in [ShardMode::None, ShardMode::Optimizer, ShardMode::Gradients] {
                    let m = per_rank(&cfg, ranks, mode, 16384);
                    let gb = |x: f64| format!("{:.1}", x / 1e9);
                    // A tenth of the GPU kept for the CUDA context, NCCL's buffers, allocator
                    // slack and the rollouts' KV cache.
                    let headroom = 141e9 - m.total();
                    let fits = if headroom >= 14.1e9 { "yes" } else { "no" };
                    rows.push(format!(
                        "| {name} ({:.2}B) | {ranks} | {} | {} | {} | {} | {} | {} | {} | {fits} |",
                        cfg.num_params() as f64 / 1e9,
                        mode.name(),
                        gb(m.weights),
                        gb(m.gradients),
                        gb(m.optimizer),
                        gb(m.activations),
                        gb(m.total()),
                        gb(headroom)
                    ));
                }
            }
        }
        rows
    }

    /// The accounting by hand for one case, and the docs' table is this accounting's.
    #[test]
    fn docs_table_is_the_accounting() {
        let cfg = qwen3(4096, 36, 12288, 32);
        let p = cfg.num_params() as f64;
        let z1 = per_rank(&cfg, 8, ShardMode::Optimizer, 16384);
        assert_eq!(z1.optimizer, 1.5 * p);
        assert_eq!(z1.gradients, 2.5 * p);
        let z2 = per_rank(&cfg, 8, ShardMode::Gradients, 16384);
        assert_eq!(z2.total() + 0.5 * p, z1.total());
        let docs = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/distributed.md"),
        )
        .unwrap();
        let rows = table();
        let missing: Vec<&String> = rows.iter().filter(|r| !docs.contains(r.as_str())).collect();
        assert!(
            missing.is_empty(),
            "docs/distributed.md lacks the rows (the table is):\n{}",
            rows.join("\n")
        );
    }
}
