//! The math of the RL update: advantages, token masks and per-token objectives.
//! No model and no optimizer live here, so every formula can be tested on small
//! hand-made tensors.
//!
//! - [`advantage`]: GRPO (DeepSeekMath, arXiv:2402.03300) and Dr.GRPO (arXiv:2503.20783)
//!   group advantages, DAPO (arXiv:2503.14476) dynamic sampling and overlong shaping.
//! - [`mask`]: STAPO's S2T mask (silence spurious tokens: A > 0, p < tau_p, H < tau_h) and
//!   the 20-Entropy top-entropy mask (Wang et al. 2025, arXiv:2506.01939).
//! - [`objective`]: PPO-clip with clip-higher and dual-clip, GSPO (arXiv:2507.18071),
//!   SAPO (arXiv:2511.20347), REINFORCE, k1/k2/k3 KL, entropy bonus and verl's loss
//!   aggregation modes, following verl `trainer/ppo/core_algos.py`.
//! - [`config`]: the configuration types ([`ObjectiveConfig`], [`MaskConfig`], ...) and the
//!   paper's S2T defaults, written once.
//! - [`preset`]: named presets of [`ObjectiveConfig`], one line each; a preset is adjusted
//!   by laying a partial serde form on it ([`ObjectiveConfig::overlay`], `crate::overlay`).
//!
//! Tensors are `(B, T)` f32: B sequences of T response positions; masks are 0/1 f32.

pub mod advantage;
pub mod config;
pub mod mask;
pub mod objective;
pub mod preset;

pub use advantage::{
    contiguous_group_ids, dynamic_sampling, group_advantages, AdvEstimator, Advantages, DynamicSampling,
    OverlongConfig, RewardScale, StdKind,
};
pub use config::{
    AggMode, KlConfig, KlKind, MaskConfig, ObjectiveConfig, PolicyLoss, QuantileOver, S2tThresholds, TauH,
    TAU_H_QUANTILE_DEFAULT, TAU_P_DEFAULT,
};
pub use mask::{
    compose_masks, quantile_linear, s2t_mask, s2t_population_entropies, top_entropy_mask, S2tStats,
    TopEntropyStats,
};
pub use objective::{aggregate, compute_loss, LossInputs, LossMetrics, LossOutput, Normaliser};
pub use preset::{preset_names, presets_help, Preset, PRESETS};

use candle_core::Tensor;

use crate::{Error, Result};

/// The `(B, T)` dims of a rank-2 tensor, or an error naming it and its shape.
pub(crate) fn dims_bt(t: &Tensor, name: &str) -> Result<(usize, usize)> {
    match t.dims() {
        &[b, l] => Ok((b, l)),
        d => Err(Error::invalid(format!("{name}: expected shape (B, T), found {d:?}"))),
    }
}

/// Checks that `t` has shape `(b, l)`.
pub(crate) fn expect_bt(t: &Tensor, name: &str, b: usize, l: usize) -> Result<()> {
    if t.dims() != [b, l] {
        return Err(Error::invalid(format!(
            "{name}: expected shape ({b}, {l}) like logp, found {:?}",
            t.dims()
        )));
    }
    Ok(())
}

/// Advantages of shape `(B,)` (one per sequence) or `(B, T)` (per token), as a
/// `(B, T)` f32 tensor with no gradient.
pub fn expand_advantages(adv: &Tensor, b: usize, l: usize) -> Result<Tensor> {
    let adv = adv.detach().to_dtype(candle_core::DType::F32)?;
    match adv.dims() {
        &[n] if n == b => Ok(adv.reshape((b, 1))?.broadcast_as((b, l))?.contiguous()?),
        &[n, m] if n == b && m == l => Ok(adv),
        d => Err(Error::invalid(format!("advantages: expected shape ({b},) or ({b}, {l}), found {d:?}"))),
    }
}
