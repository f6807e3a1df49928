//! The budget of a decode step: how many device operations (kernel launches)
//! each decoder layer issues, how many device-to-host copies a step makes,
//! and how many bytes a step must read from device memory at the least.
//!
//! **Counting rule.** Every op of the composed path (the one CUDA takes, and
//! the CPU under `--kernels composed` / `STAPO_NO_FUSED=1`) and of the CUDA
//! kernels calls [`launch`] with the number of kernels it launches on a CUDA
//! device, whatever device it runs on, so the CPU counts what a GPU would
//! launch:
//!
//! - a candle elementwise op (unary, binary with or without broadcast,
//!   affine, `where_cond`), a reduction over one dimension (`sum_keepdim`,
//!   `max_keepdim`), a matmul (one cuBLAS call), an `index_select`, a
//!   `scatter_set` and a `slice_set`, a custom op: 1;
//! - candle's `mean_keepdim`: 2 (a sum, then a scale);
//! - a cast (`to_dtype`) to another dtype: 1; to the same dtype: 0;
//! - a view (`reshape` of a contiguous tensor, `narrow`, `transpose`,
//!   `squeeze`, `unsqueeze`, `broadcast_as`, `t`): 0;
//! - `contiguous` of a strided tensor, and `reshape` of one: 1 (a copy);
//! - `Tensor::cat` of `n` contiguous pieces along a dimension: `n` (one copy
//!   each);
//! - host-to-device uploads (`Tensor::from_vec` on the device) are not
//!   launches and are not counted.
//!
//! The fused CPU kernels ([`super::fused`]) are not a device path and count
//! nothing. Every copy to the host in the rollout's decode step (`to_vec*`,
//! a scalar read, `to_device(Cpu)`) calls [`host_copy`].
//!
//! The counts are per thread ([`snapshot`]), so a test or a bench reads the
//! difference around the work it runs.

use std::cell::Cell;

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use super::config::Config;

/// Counts of device work, since the thread started or between two
/// [`snapshot`]s.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    /// Kernel launches (see the counting rule of the module).
    pub launches: u64,
    /// Of those, the launches inside decoder layers.
    pub layer_launches: u64,
    /// Decoder-layer passes run (a call over `n` layers adds `n`).
    pub layers: u64,
    /// Copies from the device to the host.
    pub host_copies: u64,
}

impl Counts {
    /// The counts of the work between `before` and `self`.
    pub fn since(&self, before: &Counts) -> Counts {
        Counts {
            launches: self.launches - before.launches,
            layer_launches: self.layer_launches - before.layer_launches,
            layers: self.layers - before.layers,
            host_copies: self.host_copies - before.host_copies,
        }
    }

    /// Adds `other` to `self`.
    pub fn add(&mut self, other: &Counts) {
        self.launches += other.launches;
        self.layer_launches += other.layer_launches;
        self.layers += other.layers;
        self.host_copies += other.host_copies;
    }

    /// Launches per decoder layer (0 when no layer ran).
    pub fn launches_per_layer(&self) -> f64 {
        self.layer_launches as f64 / self.layers.max(1) as f64
    }
}

thread_local! {
    static COUNTS: Cell<Counts> = const {
        Cell::new(Counts { launches: 0, layer_launches: 0, layers: 0, host_copies: 0 })
    };
}

/// The counts of this thread so far.
pub fn snapshot() -> Counts {
    COUNTS.with(|c| c.get())
}

fn update(f: impl FnOnce(&mut Counts)) {
    COUNTS.with(|c| {
        let mut v = c.get();
        f(&mut v);
        c.set(v);
    });
}

/// Counts `n` kernel launches.
pub fn launch(n: usize) {
    update(|c| c.launches += n as u64);
}

/// Counts one copy from the device to the host.
pub fn host_copy() {
    update(|c| c.host_copies += 1);
}

/// Records that `layers` decoder layers ran and launched `launches` kernels
/// between them (part of the launches already counted).
pub fn layers(layers: usize, launches: u64) {
    update(|c| {
        c.layers += layers as u64;
        c.layer_launches += launches;
    });
}

/// 1 when `t` is strided (its `contiguous()` or a `reshape` copies), else 0.
pub fn copy_of(t: &Tensor) -> usize {
    usize::from(!t.is_contiguous())
}

/// 1 when casting `t` to `dtype` launches a kernel, else 0.
pub fn cast_of(t: &Tensor, dtype: DType) -> usize {
    usize::from(t.dtype() != dtype)
}

/// What the CUDA norm + rope kernels' wrappers launch to lay out the rotary
/// tables `cos` (and `sin`, alike) `(B, 1, L, D/2)` for `x`: a cast each when
/// their dtype differs from `x`'s, a copy each when they are strided.
pub fn rotary_of(cos: &Tensor, x: &Tensor) -> usize {
    2 * (cast_of(cos, x.dtype()) + copy_of(cos))
}

/// Bytes a decode step of a model of `cfg` must read from device memory at
/// the least: every weight once (in `weight_dtype`; the LM head's matrix, tied
/// or not, but of the embedding table only the `rows` looked up), and the
/// keys and values (in `kv_dtype`) of every token each row attends to,
/// `context_tokens` summed over the rows (the new tokens included). What
/// bounds a decode step's speed from below: these bytes over the device's
/// memory bandwidth.
pub fn decode_step_bytes(
    cfg: &Config,
    weight_dtype: DType,
    kv_dtype: DType,
    rows: usize,
    context_tokens: usize,
) -> u64 {
    let emb = cfg.vocab_size * cfg.hidden_size;
    // num_params counts the table once when tied (read as the head) and twice
    // when not (the table is only looked up, the head read whole).
    let weights = cfg.num_params() - if cfg.tie_word_embeddings { 0 } else { emb } + rows * cfg.hidden_size;
    // Keys and values of every layer, as `PagedKvCache::bytes_per_token`.
    let per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim;
    let kv = context_tokens * per_token * kv_dtype.size_in_bytes();
    (weights * weight_dtype.size_in_bytes() + kv) as u64
}

/// Model FLOPs of one token of an update over sequences of `seq` tokens
/// (forward and backward, the layers' recomputation not counted: the
/// numerator of MFU): `6 N` for the `N` weights every token multiplies (the
/// layers' and the LM head's; the embedding is looked up), plus attention's
/// two products, `2 x 2 x Hq x D` per key, over the `(seq + 1) / 2` keys a
/// causal query sees on average, times 3 for forward and backward:
/// `6 N + 6 layers Hq D (seq + 1)`.
pub fn update_flops_per_token(cfg: &Config, seq: usize) -> f64 {
    let emb = cfg.vocab_size * cfg.hidden_size;
    let norms = cfg.num_hidden_layers * (2 * cfg.hidden_size + 2 * cfg.head_dim) + cfg.hidden_size;
    // The weights a token multiplies: the table's count once, as the head.
    let n = cfg.num_params() - norms - if cfg.tie_word_embeddings { 0 } else { emb };
    let attn = cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * (seq + 1);
    6.0 * n as f64 + 6.0 * attn as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Qwen3-1.7B shape.
    fn qwen3_1_7b() -> Config {
        Config {
            hidden_size: 2048,
            intermediate_size: 6144,
            num_hidden_layers: 28,
            num_attention_heads: 16,
            num_key_value_heads: 8,
            head_dim: 128,
            vocab_size: 151_936,
            rope_theta: 1e6,
            rms_norm_eps: 1e-6,
            max_position_embeddings: 40_960,
            tie_word_embeddings: true,
            attention_bias: false,
            bos_token_id: None,
            eos_token_id: None,
            torch_dtype: "bfloat16".into(),
        }
    }

    /// The Qwen3-1.7B shape (hidden 2048, MLP 6144, 28 layers, 16 query heads
    /// over 8 kv heads of 128, vocabulary 151,936, tied embeddings), by hand:
    /// per layer q and o 2 x 2048 x 2048 = 8,388,608, k and v
    /// 2 x 2048 x 1024 = 4,194,304, q/k norms 256, MLP 3 x 2048 x 6144 =
    /// 37,748,736, two norms 4,096: 50,336,000; x 28 = 1,409,408,000; the
    /// table 151,936 x 2048 = 311,164,928 (read once, as the head); the final
    /// norm 2,048: 1,720,574,976 weights, 3,441,149,952 bytes in bf16 (the
    /// 3.44 GB a step reads). Two rows look up 2 x 2048 bf16 values: 8,192
    /// bytes. Their contexts of 10 and 20 tokens in a bf16 cache:
    /// 30 x (2 x 28 x 8 x 128 x 2 = 114,688) = 3,440,640 bytes.
    /// Total 3,441,149,952 + 8,192 + 3,440,640 = 3,444,598,784.
    #[test]
    fn decode_step_bytes_match_a_hand_count_at_the_1_7b_shape() {
        let cfg = qwen3_1_7b();
        assert_eq!(decode_step_bytes(&cfg, DType::BF16, DType::BF16, 2, 30), 3_444_598_784);
        // Untied: the table is looked up, not read; the head (another
        // 311,164,928 weights) is: the same bytes.
        let untied = Config { tie_word_embeddings: false, ..cfg.clone() };
        assert_eq!(decode_step_bytes(&untied, DType::BF16, DType::BF16, 2, 30), 3_444_598_784);
        // f32 weights over a bf16 cache: the weights' bytes double, the cache's do not.
        assert_eq!(
            decode_step_bytes(&cfg, DType::F32, DType::BF16, 2, 30),
            2 * (3_441_149_952 + 8_192) + 3_440_640
        );
    }

    /// At the 1.7B shape of the test above, 8192-token sequences: the
    /// weights a token multiplies are 28 x (50,336,000 - 4,352 norm weights)
    /// = 1,409,286,144 plus the head's 311,164,928 = 1,720,451,072;
    /// 6 N = 10,322,706,432; attention 6 x 28 x 16 x 128 x 8193 =
    /// 2,818,916,352; 13,141,622,784 FLOPs per token.
    #[test]
    fn update_flops_match_a_hand_count_at_the_1_7b_shape() {
        let cfg = qwen3_1_7b();
        assert_eq!(update_flops_per_token(&cfg, 8192), 13_141_622_784.0);
    }

    #[test]
    fn counts_are_differences_between_snapshots() {
        let before = snapshot();
        launch(3);
        host_copy();
        layers(2, 3);
        let d = snapshot().since(&before);
        assert_eq!(d, Counts { launches: 3, layer_launches: 3, layers: 2, host_copies: 1 });
        assert_eq!(d.launches_per_layer(), 1.5);
    }
}
