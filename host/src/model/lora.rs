//! LoRA adapters on the linear layers of the Qwen3 blocks (Hu et al. 2021, as
//! `peft` implements them): `y = x W^T + scale * (x A^T) B^T` with `A` `(r,
//! in)` kaiming-uniform and `B` `(out, r)` zero at the start, so the adapted
//! model starts as the base model. `scale` is `alpha / r`, or `alpha /
//! sqrt(r)` with rsLoRA. No dropout: RL samples from the policy it trains.
//!
//! The base stays frozen (its Vars are not handed to the optimizer; see
//! [`super::Qwen3::lora_params`]) and may be bf16 while the adapters are f32: the
//! adapter term is computed in the adapters' dtype and cast to the output's.
//!
//! A leaf below layer.rs and qwen3.rs (it imports only `ops` and `frozen`): it knows
//! adapters and the projection trait `LinearLike` (mistral.rs's `LinearLayerLike`),
//! not layers. `layer.rs` implements the trait for each projection of a layer (its base
//! weight and adapter slot) and calls it for every projection; `qwen3.rs` puts adapters
//! on a model and merges them (`LinearLike::merged_weight`).

use candle_core::{DType, Device, Tensor, Var};
use rand::Rng;
use serde::{Deserialize, Serialize};

use super::frozen::frozen_linear;
use super::ops::{self, weight, Grad};
use crate::{Error, Result};

/// A linear layer of a Qwen3 block that may carry an adapter (peft's
/// `target_modules` names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Target {
    /// Attention's query projection.
    QProj,
    /// Attention's key projection.
    KProj,
    /// Attention's value projection.
    VProj,
    /// Attention's output projection.
    OProj,
    /// The MLP's gate projection.
    GateProj,
    /// The MLP's up projection.
    UpProj,
    /// The MLP's down projection.
    DownProj,
}

impl Target {
    /// Every target, in the order of a layer's adapter slots.
    pub const ALL: [Target; 7] =
        [Self::QProj, Self::KProj, Self::VProj, Self::OProj, Self::GateProj, Self::UpProj, Self::DownProj];

    /// The module's path inside a decoder layer, as in Hugging Face names.
    pub fn module(self) -> &'static str {
        match self {
            Self::QProj => "self_attn.q_proj",
            Self::KProj => "self_attn.k_proj",
            Self::VProj => "self_attn.v_proj",
            Self::OProj => "self_attn.o_proj",
            Self::GateProj => "mlp.gate_proj",
            Self::UpProj => "mlp.up_proj",
            Self::DownProj => "mlp.down_proj",
        }
    }

    fn slot(self) -> usize {
        self as usize
    }
}

fn default_targets() -> Vec<Target> {
    Target::ALL.to_vec()
}

fn default_lr_scale() -> f64 {
    // "LoRA Without Regret" (Thinking Machines, 2025): about 10x the full
    // fine-tune's learning rate.
    10.0
}

/// Which layers get adapters and how they are scaled and trained.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraConfig {
    /// Rank `r` of every adapter.
    pub rank: usize,
    /// `alpha`: the adapter term is scaled by `alpha / r` (`alpha / sqrt(r)`
    /// with `rslora`). Defaults to `rank` (scale 1).
    #[serde(default)]
    pub alpha: Option<f64>,
    /// The adapted linear layers of every block (all seven by default).
    #[serde(default = "default_targets")]
    pub targets: Vec<Target>,
    /// rsLoRA scaling, `alpha / sqrt(r)`.
    #[serde(default)]
    pub rslora: bool,
    /// The adapters' learning rate is the run's times this.
    #[serde(default = "default_lr_scale")]
    pub lr_scale: f64,
}

impl LoraConfig {
    /// All seven targets, alpha = rank, the 10x learning rate.
    pub fn new(rank: usize) -> Self {
        Self { rank, alpha: None, targets: default_targets(), rslora: false, lr_scale: default_lr_scale() }
    }

    /// The factor of the adapter term.
    pub fn scale(&self) -> f64 {
        let alpha = self.alpha.unwrap_or(self.rank as f64);
        if self.rslora {
            alpha / (self.rank as f64).sqrt()
        } else {
            alpha / self.rank as f64
        }
    }

    /// Rejects a rank of 0, a non-finite alpha or an empty target list.
    pub fn validate(&self) -> Result<()> {
        if self.rank == 0 {
            return Err(Error::invalid("lora.rank: must be at least 1"));
        }
        if !self.alpha.unwrap_or(1.0).is_finite() || !self.lr_scale.is_finite() || self.lr_scale <= 0.0 {
            return Err(Error::invalid("lora.alpha / lora.lr_scale: must be finite (lr_scale > 0)"));
        }
        if self.targets.is_empty() {
            return Err(Error::invalid("lora.targets: empty (name at least one of q_proj .. down_proj)"));
        }
        Ok(())
    }
}

/// A linear projection `y = x W^T + b` that may carry a LoRA adapter, as a decoder
/// layer calls it (mistral.rs's `LinearLayerLike`): the implementor says where its base
/// weight and adapter are; the forward with the adapter's term and the merged weight
/// follow from that, so the layer never looks at an adapter itself.
pub(super) trait LinearLike {
    /// The base weight `(out, in)`.
    fn base_weight(&self) -> &Var;

    /// The adapter on this projection, if it has one.
    fn adapter(&self) -> Option<&Adapter>;

    /// True when the base weight takes no gradient (only the adapters train).
    fn frozen_base(&self) -> bool;

    /// `x W^T + bias`, plus the adapter's term `scale * (x A^T) B^T` when there is one.
    /// With a frozen base and `Grad::Track` the base product records only `dx`.
    fn forward(&self, x: &Tensor, bias: Option<&Tensor>, grad: Grad) -> Result<Tensor> {
        let base = self.base_weight();
        let y = if self.frozen_base() && grad == Grad::Track {
            // dx only: no gradient (and no gemm) for the frozen base weight.
            frozen_linear(x, base.as_tensor(), bias)?
        } else {
            ops::linear(x, &weight(base, grad), bias)?
        };
        let Some(ad) = self.adapter() else { return Ok(y) };
        let delta = ad.delta(x, &weight(&ad.a, grad), &weight(&ad.b, grad), y.dtype())?;
        Ok((y + delta)?)
    }

    /// `W + scale * B A` in the base weight's dtype: the merged weight (the base weight
    /// itself without an adapter).
    fn merged_weight(&self) -> Result<Tensor> {
        let w = self.base_weight().as_tensor().detach();
        match self.adapter() {
            Some(ad) => ad.merged(&w),
            None => Ok(w),
        }
    }
}

/// One adapter: `A` `(r, in)`, `B` `(out, r)` and the scale of `B A`.
#[derive(Clone)]
pub struct Adapter {
    /// `A` `(r, in)`: the input side, kaiming-uniform at the start.
    pub a: Var,
    /// `B` `(out, r)`: the output side, zero at the start.
    pub b: Var,
    /// The factor of `B A` (`alpha / r`, or `alpha / sqrt(r)` with rsLoRA).
    pub scale: f64,
}

impl Adapter {
    /// A fresh adapter for a base weight `(out, inp)` in `dtype` on `device`:
    /// `A` as `nn.init.kaiming_uniform_(A, a=sqrt(5))` (uniform in
    /// `±1/sqrt(inp)`), `B` zero, so that the adapted layer starts as the base.
    pub(super) fn kaiming(
        rng: &mut impl Rng,
        (out, inp): (usize, usize),
        rank: usize,
        scale: f64,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        // kaiming_uniform_ with a = sqrt(5): gain sqrt(2 / (1 + 5)),
        // bound gain * sqrt(3 / fan_in) = 1 / sqrt(fan_in).
        let bound = 1.0 / (inp as f32).sqrt();
        let a: Vec<f32> = (0..rank * inp).map(|_| rng.random_range(-bound..bound)).collect();
        let a = Var::from_tensor(&Tensor::from_vec(a, (rank, inp), device)?.to_dtype(dtype)?)?;
        let b = Var::zeros((out, rank), dtype, device)?;
        Ok(Self { a, b, scale })
    }

    /// The adapter's term `scale * (x A^T) B^T` for an input `x` `(.., in)`,
    /// computed in the adapters' dtype and cast to `out_dtype`. `a` and `b` are
    /// the adapter's weights as the forward reads them (tracked or detached).
    pub(super) fn delta(&self, x: &Tensor, a: &Tensor, b: &Tensor, out_dtype: DType) -> Result<Tensor> {
        let xa = ops::linear(&x.to_dtype(a.dtype())?, a, None)?; // (.., r)
        Ok((ops::linear(&xa, b, None)? * self.scale)?.to_dtype(out_dtype)?)
    }

    /// `W + scale * B A` in `w`'s dtype: the base weight `w` `(out, in)` with
    /// this adapter folded in.
    pub(super) fn merged(&self, w: &Tensor) -> Result<Tensor> {
        let ba = (self.b.as_tensor().detach().matmul(&self.a.as_tensor().detach())? * self.scale)?;
        Ok((w.to_dtype(ba.dtype())? + ba)?.to_dtype(w.dtype())?)
    }
}

/// The adapters of one decoder layer, one optional slot per [`Target`], and
/// whether the layer's base weights are frozen (they are while it has adapters).
#[derive(Clone, Default)]
pub(super) struct LayerLora {
    slots: [Option<Adapter>; 7],
    frozen: bool,
}

impl LayerLora {
    /// No adapter yet, and the base frozen: what [`LayerLora::insert`] fills.
    pub(super) fn frozen_base() -> Self {
        Self { frozen: true, ..Self::default() }
    }

    /// Puts `adapter` on target `t` (replacing any there was).
    pub(super) fn insert(&mut self, t: Target, adapter: Adapter) {
        self.slots[t.slot()] = Some(adapter);
    }

    /// True when the base weights take no gradient (only the adapters train).
    pub(super) fn frozen(&self) -> bool {
        self.frozen
    }

    pub(super) fn get(&self, t: Target) -> Option<&Adapter> {
        self.slots[t.slot()].as_ref()
    }

    /// The adapter Vars (A then B per target), so that recomputed layers
    /// return their gradients too.
    pub(super) fn vars(&self) -> impl Iterator<Item = &Var> {
        self.slots.iter().flatten().flat_map(|a| [&a.a, &a.b])
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::*;
    use crate::model::config::Config;
    use crate::model::fused::test_util::{probe, randn};
    use crate::model::qwen3::TokenBatch;
    use crate::model::Recompute;
    use crate::model::{Grad, Qwen3};

    fn tiny(dtype: DType, seed: u64) -> Qwen3 {
        let cfg = Config::from_json_str(
            r#"{"vocab_size": 31, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 64, "tie_word_embeddings": true}"#,
            "tiny",
        )
        .unwrap();
        crate::model::init(&cfg, seed, 0.3, dtype, &Device::Cpu).unwrap()
    }

    fn batch() -> TokenBatch {
        let ids = vec![1, 5, 9, 2, 7, 3, 11, 4, 0, 8, 6, 13];
        TokenBatch::from_parts(ids, vec![vec![1; 6], vec![0, 1, 1, 1, 1, 1]], &Device::Cpu).unwrap()
    }

    fn flat(t: &Tensor) -> Vec<f64> {
        t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    }

    /// Random B (and A) in every adapter, in the adapters' dtype.
    fn randomize(m: &Qwen3, seed: u64) {
        for (k, (_, v)) in m.lora_params().iter().enumerate() {
            v.set(&(randn(v.dims(), v.dtype(), seed + k as u64).as_tensor() * 0.5).unwrap()).unwrap();
        }
    }

    fn max_rel(a: &[f64], b: &[f64]) -> f64 {
        let scale = b.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
        a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
    }

    #[test]
    fn config_scale_and_defaults() {
        let c: LoraConfig = serde_json::from_str(r#"{"rank": 16, "alpha": 32}"#).unwrap();
        assert_eq!(c.scale(), 2.0);
        assert_eq!(c.targets, Target::ALL.to_vec());
        assert_eq!(c.lr_scale, 10.0);
        let c: LoraConfig =
            serde_json::from_str(r#"{"rank": 16, "alpha": 32, "rslora": true, "targets": ["q_proj"]}"#)
                .unwrap();
        assert_eq!(c.scale(), 8.0);
        assert_eq!(c.targets, vec![Target::QProj]);
        assert!(serde_json::from_str::<LoraConfig>(r#"{"rank": 4, "dropout": 0.1}"#).is_err());
        assert!(LoraConfig::new(0).validate().is_err());
    }

    /// B = 0 at the start: the adapted model's logits are the base model's,
    /// and A has peft's kaiming-uniform range.
    #[test]
    fn fresh_adapters_leave_the_logits_unchanged() {
        let mut m = tiny(DType::F32, 1);
        let base = flat(&m.forward(&batch()).unwrap());
        m.add_lora(&LoraConfig::new(4), 7).unwrap();
        assert_eq!(m.lora_params().len(), 2 * 7 * 2);
        let (name, a) = &m.lora_params()[0];
        assert_eq!(name, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
        let a = flat(a.as_tensor());
        let bound = 1.0 / 16f64.sqrt();
        assert!(a.iter().all(|x| x.abs() <= bound) && a.iter().any(|x| x.abs() > bound / 2.0));
        assert_eq!(flat(&m.forward(&batch()).unwrap()), base);
    }

    /// The merged model (`W + scale B A`, adapters dropped) computes the same
    /// logits as the unmerged one, and differs from the base.
    #[test]
    fn merged_forward_equals_unmerged() {
        let mut m = tiny(DType::F32, 2);
        let base = flat(&m.forward(&batch()).unwrap());
        let mut cfg = LoraConfig::new(3);
        cfg.alpha = Some(6.0);
        m.add_lora(&cfg, 3).unwrap();
        randomize(&m, 40);
        let unmerged = flat(&m.forward(&batch()).unwrap());
        m.merge_lora().unwrap();
        assert!(!m.has_lora());
        let merged = flat(&m.forward(&batch()).unwrap());
        assert!(max_rel(&merged, &unmerged) < 1e-5, "{}", max_rel(&merged, &unmerged));
        assert!(max_rel(&base, &unmerged) > 1e-2);
    }

    /// A bf16 base with f32 adapters: the adapter term is added in f32 and
    /// the logits match the f32 computation up to bf16 rounding.
    #[test]
    fn bf16_base_with_f32_adapters() {
        let mut m = tiny(DType::BF16, 4);
        m.add_lora(&LoraConfig::new(2), 5).unwrap();
        assert!(m.lora_params().iter().all(|(_, v)| v.dtype() == DType::F32));
        randomize(&m, 60);
        let y = m.forward(&batch()).unwrap();
        let grads = (y.to_dtype(DType::F32).unwrap().sqr().unwrap().sum_all().unwrap()).backward().unwrap();
        for (name, v) in m.lora_params() {
            let g = grads.get(v.as_tensor()).unwrap_or_else(|| panic!("no gradient for {name}"));
            assert_eq!(g.dtype(), DType::F32);
        }
    }

    /// With the base frozen no base weight gets a gradient (layers, embedding,
    /// norm, the tied head through the chunked statistics), with and without
    /// recomputed layers, and the adapters' gradients equal those of the same
    /// model whose base is not frozen (candle's plain matmul backward).
    #[test]
    fn frozen_base_gets_no_gradient_and_adapters_the_same() {
        for recompute in [Recompute::Off, Recompute::On] {
            for dtype in [DType::F32, DType::F64] {
                let mut m = tiny(dtype, 11);
                m.set_recompute(recompute);
                m.add_lora(&LoraConfig::new(3), 12).unwrap();
                randomize(&m, 90);
                assert!(m.base_frozen());
                let b = batch();
                let targets =
                    Tensor::from_vec((0..12u32).map(|i| (i * 7) % 31).collect(), (2, 6), &Device::Cpu)
                        .unwrap();
                let run = |m: &Qwen3| {
                    let h = m.forward_hidden(&b, Grad::Track).unwrap();
                    let st = m.token_stats(&h, &targets, Grad::Track).unwrap();
                    let loss = (st.logp.sum_all().unwrap() + st.entropy.sum_all().unwrap()).unwrap();
                    loss.backward().unwrap()
                };
                let frozen = run(&m);
                for (name, v) in m.params() {
                    assert!(
                        frozen.get(v.as_tensor()).is_none(),
                        "{recompute:?} {dtype:?}: gradient for {name}"
                    );
                }
                assert_eq!(m.trainable_params().len(), m.lora_params().len());
                for layer in &mut m.layers {
                    layer.lora.frozen = false;
                }
                assert!(!m.base_frozen());
                let open = run(&m);
                assert!(
                    open.get(m.params()[0].1.as_tensor()).is_some(),
                    "the unfrozen reference trains the base"
                );
                for (name, v) in m.lora_params() {
                    let (a, r) = (frozen.get(v.as_tensor()).unwrap(), open.get(v.as_tensor()).unwrap());
                    let e = max_rel(&flat(a), &flat(r));
                    assert!(e < 1e-5, "{recompute:?} {dtype:?} {name}: {e:e}");
                }
            }
        }
    }

    /// The merged parameters are the base ones except the adapted projections,
    /// which are `W + scale B A`.
    #[test]
    fn merged_params_fold_the_adapters() {
        let mut m = tiny(DType::F32, 13);
        let mut cfg = LoraConfig::new(2);
        cfg.targets = vec![Target::VProj, Target::DownProj];
        cfg.alpha = Some(5.0);
        m.add_lora(&cfg, 14).unwrap();
        randomize(&m, 100);
        let merged: std::collections::HashMap<String, Tensor> =
            m.merged_params().unwrap().into_iter().collect();
        for (name, v) in m.params() {
            let w = flat(v.as_tensor());
            let got = flat(&merged[&name]);
            let adapted = name.contains("v_proj.weight") || name.contains("down_proj.weight");
            if !adapted {
                assert_eq!(got, w, "{name}");
                continue;
            }
            let layer: usize = name.split('.').nth(2).unwrap().parse().unwrap();
            let t = if name.contains("v_proj") { Target::VProj } else { Target::DownProj };
            let ad = m.layers[layer].lora.get(t).unwrap();
            let (a, bm) = (flat(ad.a.as_tensor()), flat(ad.b.as_tensor()));
            let (out, inp) = v.dims2().unwrap();
            for o in 0..out {
                for i in 0..inp {
                    let ba: f64 = (0..2).map(|r| bm[o * 2 + r] * a[r * inp + i]).sum();
                    let want = w[o * inp + i] + 2.5 * ba;
                    assert!((got[o * inp + i] - want).abs() < 1e-5, "{name}[{o},{i}]");
                }
            }
        }
    }

    /// The base view (a LoRA run's KL reference) computes the base model's logits
    /// after the adapters changed, and shares the base weights' storage.
    #[test]
    fn base_view_is_the_base_model_on_shared_weights() {
        let mut m = tiny(DType::F32, 21);
        let base = flat(&m.forward(&batch()).unwrap());
        m.add_lora(&LoraConfig::new(2), 22).unwrap();
        randomize(&m, 120);
        assert_ne!(flat(&m.forward(&batch()).unwrap()), base);
        let view = m.base_view();
        assert!(!view.has_lora() && !view.base_frozen() && m.has_lora());
        assert_eq!(flat(&view.forward(&batch()).unwrap()), base);
        for ((n, a), (_, b)) in m.params().iter().zip(view.params().iter()) {
            assert_eq!(a.as_tensor().id(), b.as_tensor().id(), "{n} copied");
        }
    }

    /// Gradients of a random functional of the hidden states with respect to
    /// every adapter, against central finite differences in f64, with and
    /// without recomputed layers; the base weights are in the graph but the
    /// adapters' gradients are what is checked.
    #[test]
    fn adapter_gradients_match_finite_differences() {
        for recompute in [Recompute::Off, Recompute::On] {
            let mut m = tiny(DType::F64, 3);
            m.set_recompute(recompute);
            let mut cfg = LoraConfig::new(2);
            cfg.alpha = Some(3.0);
            m.add_lora(&cfg, 9).unwrap();
            assert!(m.lora_params().iter().all(|(_, v)| v.dtype() == DType::F64));
            randomize(&m, 80);
            let b = batch();
            // The same seed gives the same random functional each call.
            let loss = |m: &Qwen3| -> f64 {
                probe(&m.forward_hidden(&b, Grad::Off).unwrap(), 99).to_scalar::<f64>().unwrap()
            };
            let grads = probe(&m.forward_hidden(&b, Grad::Track).unwrap(), 99).backward().unwrap();
            // Parts of the forward round below f64 (a step of 1e-5 gives
            // differences off by 4e-4), so a step of 1e-3: truncation error
            // O(eps^2) and rounding noise both near 1e-5 here.
            let eps = 1e-3;
            for (name, v) in m.lora_params() {
                let g =
                    flat(grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{recompute:?}: no grad {name}")));
                let x0 = flat(v.as_tensor());
                // A few entries of each adapter (every entry would be slow).
                for j in (0..x0.len()).step_by(x0.len().div_ceil(5)) {
                    let at = |d: f64| {
                        let mut x = x0.clone();
                        x[j] += d;
                        v.set(&Tensor::from_vec(x, v.dims(), &Device::Cpu).unwrap()).unwrap();
                        loss(&m)
                    };
                    let fd = (at(eps) - at(-eps)) / (2.0 * eps);
                    v.set(&Tensor::from_vec(x0.clone(), v.dims(), &Device::Cpu).unwrap()).unwrap();
                    assert!(
                        (fd - g[j]).abs() < 1e-4 * (1.0 + fd.abs()),
                        "{recompute:?} {name}[{j}]: {fd} vs {}",
                        g[j]
                    );
                }
            }
        }
    }
}
