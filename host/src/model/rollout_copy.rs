//! Mixed precision for RL: a low-precision copy of the policy for rollouts,
//! next to the f32 master weights that the update trains.
//!
//! Decoding is bound by reading the weights once per token, so on a GPU it
//! runs on bf16 weights (half the bytes, tensor-core matmuls), while the
//! optimizer keeps f32 master weights so that small updates (lr 1e-6) are
//! not rounded away. This is how verl and OpenRLHF pair their rollout engine
//! with the trainer: the engine's bf16 weights are overwritten from the
//! master after every optimizer step. The old-policy log-probabilities that
//! enter the PPO ratio are recomputed by the master (or taken from the
//! rollout, as the run's `old_logp` setting says), so the update itself never
//! sees bf16 weights.
//!
//! [`RolloutCopy`] holds the second [`Qwen3`] (same configuration and device,
//! its own dtype); [`RolloutCopy::refresh`] copies the master into it in place
//! (`Var::set`: no reallocation, nothing leaves the device).

use std::collections::HashMap;

use candle_core::{DType, Tensor};

use super::qwen3::{Qwen3, WeightSource};
use crate::{Error, Result};

/// The master's parameters by name, as a [`WeightSource`] for [`Qwen3::new`].
struct FromModel {
    params: HashMap<String, Tensor>,
}

impl WeightSource for FromModel {
    fn get(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self
            .params
            .get(name)
            .ok_or_else(|| Error::invalid(format!("rollout copy: the master has no parameter {name}")))?;
        if t.dims() != shape {
            return Err(Error::invalid(format!(
                "rollout copy: parameter {name} has shape {:?}, expected {shape:?}",
                t.dims()
            )));
        }
        Ok(t.clone())
    }

    fn contains(&self, name: &str) -> bool {
        self.params.contains_key(name)
    }
}

/// A copy of a model's weights in another dtype, for sampling.
pub struct RolloutCopy {
    model: Qwen3,
}

impl RolloutCopy {
    /// Builds the copy of `master` in `dtype` on the master's device; a master
    /// with LoRA adapters is copied merged ([`Qwen3::merged_params`]), so the
    /// copy computes the adapted function without adapters.
    pub fn new(master: &Qwen3, dtype: DType) -> Result<Self> {
        let params = master.merged_params()?.into_iter().collect();
        let model = Qwen3::new(master.config(), &mut FromModel { params }, dtype, master.device())?;
        Ok(Self { model })
    }

    /// The copy, to sample from.
    pub fn model(&self) -> &Qwen3 {
        &self.model
    }

    /// The copy's dtype.
    pub fn dtype(&self) -> DType {
        self.model.dtype()
    }

    /// Overwrites the copy with `master`'s current weights, adapters merged
    /// (call after every optimizer step). Fails if `master` is not the model the
    /// copy was made of (different parameter names or shapes).
    pub fn refresh(&self, master: &Qwen3) -> Result<()> {
        let (src, dst) = (master.merged_params()?, self.model.params());
        if src.len() != dst.len() {
            return Err(Error::invalid(format!(
                "rollout copy: the master has {} parameters, the copy {}",
                src.len(),
                dst.len()
            )));
        }
        let dtype = self.model.dtype();
        for ((sn, s), (dn, d)) in src.iter().zip(&dst) {
            if sn != dn || s.dims() != d.dims() {
                return Err(Error::invalid(format!(
                    "rollout copy: master parameter {sn} {:?} does not match the copy's {dn} {:?}",
                    s.dims(),
                    d.dims()
                )));
            }
            d.set(&s.to_dtype(dtype)?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, D};

    use super::*;
    use crate::model::{init, Config, TokenBatch};
    use crate::train::{AdamW, AdamWConfig};

    fn tiny() -> Qwen3 {
        let text = r#"{"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "tie_word_embeddings": true}"#;
        let cfg = Config::from_json_str(text, "tiny").expect("config");
        init(&cfg, 7, 0.2, DType::F32, &Device::Cpu).expect("init")
    }

    fn batch() -> TokenBatch {
        TokenBatch::left_padded(&[vec![3, 14, 15, 92, 65], vec![35, 89, 79]], 0, &Device::Cpu).expect("batch")
    }

    /// Log-softmax of every position's logits, as f32 on the host, and the
    /// largest |logit| (the scale the bf16 tolerance is relative to).
    fn logp(m: &Qwen3) -> (Vec<f32>, f32) {
        let logits = m.forward(&batch()).expect("forward").to_dtype(DType::F32).expect("f32");
        let scale = logits.abs().and_then(|a| a.max_all()).and_then(|a| a.to_scalar::<f32>()).expect("max");
        let lsm = crate::model::ops::log_softmax(&logits).expect("lsm");
        // Real positions only: row 1 is left-padded by 2.
        let rows = [lsm.get(0).expect("row 0"), lsm.get(1).and_then(|r| r.narrow(0, 2, 3)).expect("row 1")];
        let v = rows
            .iter()
            .flat_map(|r| r.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("vec"))
            .collect();
        (v, scale)
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    /// bf16 keeps 8 significant bits (relative rounding 2^-9 per weight); the
    /// log-probs of a 2-layer model then agree to a few percent of the logit
    /// scale. The bound used: 3% of max |logit|.
    fn bf16_tol(scale: f32) -> f32 {
        0.03 * scale
    }

    #[test]
    fn bf16_copy_tracks_the_master_after_an_update() {
        let master = tiny();
        let copy = RolloutCopy::new(&master, DType::BF16).expect("copy");
        assert_eq!(copy.dtype(), DType::BF16);
        assert_eq!(copy.model().params()[0].1.dtype(), DType::BF16);
        let (m0, scale) = logp(&master);
        let (c0, _) = logp(copy.model());
        let tol = bf16_tol(scale);
        let d0 = max_diff(&m0, &c0);
        assert!(d0 > 0.0, "a bf16 copy should round something");
        assert!(d0 < tol, "bf16 copy vs f32 master before the update: {d0} >= {tol}");

        // One real optimizer step on the master: push up the log-prob of token 5 everywhere.
        let mut opt =
            AdamW::new(master.params(), AdamWConfig { lr: 1e-2, ..AdamWConfig::default() }).expect("adamw");
        let logits = master.forward(&batch()).expect("forward");
        let loss = crate::model::ops::log_softmax(&logits)
            .and_then(|l| Ok(l.narrow(D::Minus1, 5, 1)?.sum_all()?.neg()?))
            .expect("loss");
        opt.step(&loss.backward().expect("backward"), 1e-2).expect("step");

        let (m1, _) = logp(&master);
        let moved = max_diff(&m0, &m1);
        assert!(moved > 10.0 * tol, "the update should move the master well past bf16 noise: {moved}");
        // Stale until refreshed, then within bf16 tolerance of the updated master.
        let (stale, _) = logp(copy.model());
        assert_eq!(max_diff(&stale, &c0), 0.0, "the copy changed before refresh");
        copy.refresh(&master).expect("refresh");
        let (c1, _) = logp(copy.model());
        let d1 = max_diff(&m1, &c1);
        assert!(d1 < tol, "refreshed bf16 copy vs updated master: {d1} >= {tol}");
        // Refresh is exactly a fresh conversion.
        let (fresh, _) = logp(RolloutCopy::new(&master, DType::BF16).expect("copy").model());
        assert_eq!(max_diff(&c1, &fresh), 0.0);
    }

    #[test]
    fn refresh_refuses_another_model() {
        let a = tiny();
        let text = r#"{"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "tie_word_embeddings": true}"#;
        let b =
            init(&Config::from_json_str(text, "one layer").expect("cfg"), 1, 0.2, DType::F32, &Device::Cpu)
                .expect("init");
        let copy = RolloutCopy::new(&a, DType::BF16).expect("copy");
        let err = copy.refresh(&b).expect_err("mismatched models");
        assert!(err.to_string().contains("parameters"), "{err}");
    }
}
