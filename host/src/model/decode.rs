//! The decode step's projections fused into fewer, larger products, and the
//! ops of the decode layer that runs on them.
//!
//! A rollout reads every weight once per step; what it launches per layer is
//! what bounds a GPU step at small batches. As vLLM's `QKVParallelLinear`
//! and `MergedColumnParallelLinear` (and mistral.rs's fused projections) do,
//! [`DecodeWeights`] holds each layer's `[Wq; Wk; Wv]` (rows stacked: one
//! product gives every token's queries, keys and values side by side in one
//! row) and `[Wgate; Wup]`, so a layer runs two products where it ran five.
//! The queries, keys and values are then read from the fused rows in place,
//! by column offset and row stride (the CUDA norm + rope and cache-write
//! kernels take them so, `model/cuda/norm_rope.cu`), and SwiGLU reads the gate
//! and up halves of each row likewise (`model/cuda/swiglu.cu`).
//!
//! The weights the update trains, the checkpoint and the peft files keep
//! their separate tensors: the fused ones are a copy for sampling, built from
//! the model's current weights (adapters merged, `W + scale B A`) when a
//! generation starts (`rollout::engine`), so whatever changed the weights
//! before it (an optimizer step, a rollout copy's refresh, a broadcast from
//! rank 0, a loaded adapter) is in them. The copy costs the bytes of the five
//! projections while the generation runs (about two thirds of a layer's weights).
//!
//! **The ops and their count.** Each op here runs the project's CUDA kernel
//! on a CUDA tensor and the fused CPU kernel on a CPU one, and on either
//! device adds to [`budget`] the kernels its CUDA path launches: so the
//! layer's launches, counted on the CPU by the tests, are the ones the GPU
//! makes (see `model::paged`, whose layer calls them).

use candle_core::{DType, Device, Tensor};

use super::budget;
use super::lora::Target;
use super::ops::{self, weight, Grad};
use super::qwen3::Qwen3;
use crate::{Error, Result};

/// One layer's projections for decoding.
pub(super) struct FusedLayer {
    /// `[Wq; Wk; Wv]`, `((Hq + 2 Hkv) D, hidden)`.
    pub qkv: Tensor,
    /// `[bq; bk; bv]` when the model has attention biases.
    pub qkv_bias: Option<Tensor>,
    /// The output projection (merged with its adapter, if any).
    pub o: Tensor,
    /// `[Wgate; Wup]`, `(2 I, hidden)`.
    pub gate_up: Tensor,
    /// The down projection (merged with its adapter, if any).
    pub down: Tensor,
}

/// Every layer's projections fused for decoding, built from a model's
/// current weights (see the module's documentation).
pub struct DecodeWeights {
    pub(super) layers: Vec<FusedLayer>,
    /// The device and dtype of the weights they were built from.
    device: Device,
    dtype: DType,
}

impl DecodeWeights {
    /// Fuses `model`'s projections as they are now, adapters merged.
    pub fn new(model: &Qwen3) -> Result<Self> {
        let mut layers = Vec::with_capacity(model.layers.len());
        for layer in &model.layers {
            let w = |t: Target| layer.merged_weight(t);
            let qkv = Tensor::cat(&[w(Target::QProj)?, w(Target::KProj)?, w(Target::VProj)?], 0)?;
            let qkv_bias = match &layer.biases {
                Some([q, k, v, _]) => {
                    Some(Tensor::cat(&[weight(q, Grad::Off), weight(k, Grad::Off), weight(v, Grad::Off)], 0)?)
                }
                None => None,
            };
            let gate_up = Tensor::cat(&[w(Target::GateProj)?, w(Target::UpProj)?], 0)?;
            layers.push(FusedLayer {
                qkv,
                qkv_bias,
                o: w(Target::OProj)?,
                gate_up,
                down: w(Target::DownProj)?,
            });
        }
        Ok(Self { layers, device: model.device().clone(), dtype: model.dtype() })
    }

    /// Checks that these are `model`'s (same depth, device and dtype).
    pub(super) fn check(&self, model: &Qwen3) -> Result<()> {
        let same_device = self.device.same_device(model.device());
        if self.layers.len() != model.layers.len() || !same_device || self.dtype != model.dtype() {
            return Err(Error::invalid(format!(
                "decode weights of {} layers in {:?} on {:?} given for a model of {} layers in {:?} on {:?}",
                self.layers.len(),
                self.dtype,
                self.device,
                model.layers.len(),
                model.dtype(),
                model.device()
            )));
        }
        Ok(())
    }

    /// Bytes of the fused copies (`[Wq; Wk; Wv]`, `[Wgate; Wup]`, the biases;
    /// not the output and down projections, which share the model's storage
    /// unless an adapter is merged into them).
    pub fn bytes(&self) -> usize {
        let b = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        self.layers.iter().map(|l| b(&l.qkv) + b(&l.gate_up) + l.qkv_bias.as_ref().map_or(0, b)).sum()
    }
}

/// True when the decode layer's CUDA kernels serve `x` (else the CPU's
/// fused kernels run it).
fn on_cuda(x: &Tensor) -> bool {
    x.device().is_cuda()
}

/// An error for an op of the decode layer on a device it has no kernel for.
#[cfg_attr(feature = "cuda", allow(dead_code))]
fn no_kernel(what: &str, x: &Tensor) -> Error {
    Error::invalid(format!("decode layer: no {what} kernel for {:?} on {:?}", x.dtype(), x.device()))
}

/// `x W^T + b`: one product (a copy first when `x` is strided, the bias's add after).
pub(super) fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    // ops::linear counts its launches off the fused CPU path; on it, the same count here.
    if super::fused::supported(x) {
        budget::launch(budget::copy_of(x) + 1 + usize::from(b.is_some()));
    }
    ops::linear(x, w, b)
}

/// RMSNorm of `x` with weight `w`: one kernel (the weight's cast first when
/// it is in another dtype).
pub(super) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    budget::launch(1 + budget::copy_of(x) + budget::cast_of(w, x.dtype()));
    let w = w.to_dtype(x.dtype())?;
    if on_cuda(x) {
        #[cfg(feature = "cuda")]
        return super::cuda_ops::rms_norm(x, &w, eps);
        #[cfg(not(feature = "cuda"))]
        return Err(no_kernel("RMSNorm", x));
    }
    super::fused::rms_norm(x, &w, eps)
}

/// `(x + r, RMSNorm(x + r))`: one kernel.
pub(super) fn add_rms_norm(x: &Tensor, r: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let casts = budget::cast_of(w, x.dtype());
    budget::launch(1 + budget::copy_of(x) + budget::copy_of(r) + casts);
    let w = w.to_dtype(x.dtype())?;
    if on_cuda(x) {
        #[cfg(feature = "cuda")]
        return super::cuda_ops::add_rms_norm(x, r, &w, eps);
        #[cfg(not(feature = "cuda"))]
        return Err(no_kernel("RMSNorm", x));
    }
    let sum = (x + r)?;
    let normed = super::fused::rms_norm(&sum, &w, eps)?;
    Ok((sum, normed))
}

/// Per-head RMSNorm and rotary embedding of the `n_heads` heads of `D` (the
/// norm weight's size) that start at column `col` of the rows of `qkv`
/// `(B, L, S)`, read in place; `(B, H, L, D)`. One kernel.
pub(super) fn norm_rope_rows(
    qkv: &Tensor,
    col: usize,
    n_heads: usize,
    w: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    eps: f64,
) -> Result<Tensor> {
    budget::launch(1 + budget::copy_of(qkv) + budget::cast_of(w, qkv.dtype()) + budget::rotary_of(cos, qkv));
    if on_cuda(qkv) {
        #[cfg(feature = "cuda")]
        return super::cuda_ops::norm_rope_rows(qkv, col, n_heads, w, (cos, sin), eps);
        #[cfg(not(feature = "cuda"))]
        return Err(no_kernel("norm + rope", qkv));
    }
    let heads = qkv.narrow(2, col, n_heads * w.elem_count())?;
    super::fused::norm_rope(&heads, n_heads, &w.to_dtype(qkv.dtype())?, (cos, sin), eps)
}

/// `silu(gate) * up` of `gate_up` `(.., 2 I)`, whose rows hold the gate then
/// up (one product over `[Wgate; Wup]`), read in place; `(.., I)`. One kernel.
pub(super) fn swiglu_rows(gate_up: &Tensor, cols: usize) -> Result<Tensor> {
    budget::launch(1 + budget::copy_of(gate_up));
    if on_cuda(gate_up) {
        #[cfg(feature = "cuda")]
        return super::cuda_ops::swiglu_rows(gate_up, cols);
        #[cfg(not(feature = "cuda"))]
        return Err(no_kernel("SwiGLU", gate_up));
    }
    let last = gate_up.rank() - 1;
    super::fused::swiglu(&gate_up.narrow(last, 0, cols)?, &gate_up.narrow(last, cols, cols)?)
}
