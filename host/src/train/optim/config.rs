//! [`AdamWConfig`]: the optimizer's hyper-parameters and learning-rate schedule (a run's
//! `actor.optim`, as verl's `actor.optim`), validated, and the usual weight-decay
//! exclusion [`is_norm_or_bias`].

use serde::{Deserialize, Serialize};

use super::LrSchedule;
use crate::{Error, Result};

/// The name used in configuration errors.
const CONFIG_NAME: &str = "adamw config";

/// AdamW hyper-parameters. Defaults are PyTorch's except `lr` and `max_grad_norm`,
/// which follow the STAPO paper (lr 1e-6, clip at 1.0).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdamWConfig {
    /// Base learning rate (a schedule scales it; [`AdamW::step`](super::AdamW::step) takes the final value).
    #[serde(default = "default_lr")]
    pub lr: f64,
    /// Decay rate of the first moment.
    #[serde(default = "default_beta1")]
    pub beta1: f64,
    /// Decay rate of the second moment.
    #[serde(default = "default_beta2")]
    pub beta2: f64,
    /// Added to the bias-corrected root second moment.
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Decoupled weight decay: each step multiplies weights by `1 - lr * weight_decay`.
    #[serde(default = "default_weight_decay")]
    pub weight_decay: f64,
    /// Clip the global L2 norm of all gradients to this value; `null` disables clipping.
    #[serde(default = "default_max_grad_norm")]
    pub max_grad_norm: Option<f64>,
    /// How the learning rate moves over the steps of a run ([`LrSchedule::lr_at`] of `lr`);
    /// [`AdamW::step`](super::AdamW::step) itself takes the final value.
    #[serde(default)]
    pub schedule: LrSchedule,
}

fn default_lr() -> f64 {
    1e-6
}
fn default_beta1() -> f64 {
    0.9
}
fn default_beta2() -> f64 {
    0.999
}
fn default_eps() -> f64 {
    1e-8
}
fn default_weight_decay() -> f64 {
    0.01
}
fn default_max_grad_norm() -> Option<f64> {
    Some(1.0)
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: default_lr(),
            beta1: default_beta1(),
            beta2: default_beta2(),
            eps: default_eps(),
            weight_decay: default_weight_decay(),
            max_grad_norm: default_max_grad_norm(),
            schedule: LrSchedule::default(),
        }
    }
}

impl AdamWConfig {
    /// Checks every field's range, naming the first bad field.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, msg: String| {
            Err(Error::Config { file: CONFIG_NAME.into(), field: field.into(), msg })
        };
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad("lr", format!("expected a finite value >= 0, found {}", self.lr));
        }
        for (field, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return bad(field, format!("expected a value in [0, 1), found {b}"));
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad("eps", format!("expected a finite value > 0, found {}", self.eps));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad("weight_decay", format!("expected a finite value >= 0, found {}", self.weight_decay));
        }
        if let Some(n) = self.max_grad_norm {
            if !(n.is_finite() && n > 0.0) {
                return bad("max_grad_norm", format!("expected a finite value > 0 or null, found {n}"));
            }
        }
        Ok(())
    }
}

/// How the optimizer's state is split over the ranks of a data-parallel run
/// (DeepSpeed's ZeRO stages 0-2; see `ShardedAdamW`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ShardMode {
    /// Every rank holds all moments; gradients are all-reduced (plain data parallelism).
    #[default]
    None,
    /// ZeRO-1: each rank holds the moments (and f32 master weights of a bf16 model) of
    /// its contiguous range of the flattened parameters; gradients are all-reduced.
    Optimizer,
    /// ZeRO-2: as `optimizer`, and gradients are reduce-scattered, each rank keeping
    /// only its range's summed gradient.
    Gradients,
}

impl ShardMode {
    /// The mode named `s` (`none`, `optimizer`, `gradients`; also `zero1`/`zero2`),
    /// or an error naming `field` and the choices.
    pub fn parse(s: &str, field: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" | "off" | "zero0" => Ok(Self::None),
            "optimizer" | "zero1" => Ok(Self::Optimizer),
            "gradients" | "zero2" => Ok(Self::Gradients),
            other => Err(Error::Config {
                file: "run config".into(),
                field: field.into(),
                msg: format!(
                    "unknown shard mode `{other}`; expected none, optimizer (ZeRO-1) or gradients (ZeRO-2)"
                ),
            }),
        }
    }

    /// The mode's name, as the configuration spells it.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Optimizer => "optimizer",
            Self::Gradients => "gradients",
        }
    }
}

/// The usual weight-decay exclusion for transformer weights: RMSNorm/LayerNorm
/// scales (Qwen3's `*_layernorm.weight`, `q_norm.weight`, `k_norm.weight`,
/// `model.norm.weight`) and biases. Pass it to [`AdamW::with_no_decay`](super::AdamW::with_no_decay).
pub fn is_norm_or_bias(name: &str) -> bool {
    name.ends_with("norm.weight") || name.ends_with(".bias") || name == "bias"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_defaults_and_validation() {
        let cfg: AdamWConfig = serde_json::from_str(r#"{"lr": 2e-6}"#).unwrap();
        assert_eq!(cfg, AdamWConfig { lr: 2e-6, ..AdamWConfig::default() });
        let off: AdamWConfig = serde_json::from_str(r#"{"max_grad_norm": null}"#).unwrap();
        assert_eq!(off.max_grad_norm, None);
        assert!(serde_json::from_str::<AdamWConfig>(r#"{"betta1": 0.9}"#).is_err());
        match (AdamWConfig { beta2: 1.0, ..AdamWConfig::default() }).validate() {
            Err(Error::Config { field, .. }) => assert_eq!(field, "beta2"),
            other => panic!("expected a config error, got {other:?}"),
        }
    }
}
