//! A linear layer over a frozen weight: `y = x W^T (+ b)` whose backward
//! returns `dx = dy W` and nothing for `W`.
//!
//! candle's matmul backward computes the gradient of both operands whatever
//! they track, so a detached base weight under LoRA would still cost a
//! `(out, in)` gradient per projection and per micro-batch (and the time of
//! its gemm). This op is what peft gets from `requires_grad = False`: the
//! forward is the ordinary projection, run without a graph and handed to
//! candle through `model::precomputed`; the backward is one matmul.

use candle_core::{CpuStorage, CudaStorage, CustomOp1, Layout, MetalStorage, Shape, Tensor};

use super::ops;
use super::precomputed::Held;
use crate::Result;

/// `x W^T + b` for `x (.., in)`, `w (out, in)`, differentiable in `x` only
/// (`w` and `b` are read detached). Without a graph on `x` it is
/// [`ops::linear`] itself.
pub fn frozen_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let (w, b) = (w.detach(), b.map(Tensor::detach));
    let y = ops::linear(&x.detach(), &w, b.as_ref())?;
    if !x.track_op() {
        return Ok(y);
    }
    Ok(x.apply_op1(FrozenLinear { w, y: Held::new(y, "frozen linear") })?)
}

/// The op of [`frozen_linear`] over `x`.
struct FrozenLinear {
    w: Tensor,
    y: Held,
}

impl CustomOp1 for FrozenLinear {
    fn name(&self) -> &'static str {
        "frozen-linear"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.y.cpu()
    }

    fn cuda_fwd(&self, _s: &CudaStorage, _l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        self.y.cuda()
    }

    fn metal_fwd(&self, _s: &MetalStorage, _l: &Layout) -> candle_core::Result<(MetalStorage, Shape)> {
        self.y.metal()
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        // dx = dy W: (rows, out) x (out, in).
        let out = self.w.dim(0)?;
        let rows = dy.elem_count() / out.max(1);
        // bf16 weights under f32 activations (CPU, see `Qwen3::activation_dtype`): in f32.
        let w = if self.w.dtype() == dy.dtype() { self.w.clone() } else { self.w.to_dtype(dy.dtype())? };
        let dx = dy.contiguous()?.reshape((rows, out))?.matmul(&w)?;
        Ok(Some(dx.reshape(x.shape())?.to_dtype(x.dtype())?))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Var};

    use super::*;
    use crate::model::fused::test_util::{randn, rel_err};

    /// Same value as the plain projection; the input's gradient equals the
    /// one of the composed `x W^T + b`, and the weight gets none.
    #[test]
    fn input_gradient_only() {
        for dtype in [DType::F32, DType::F64, DType::BF16] {
            let x = randn(&[2, 5, 12], dtype, 1);
            let w = randn(&[7, 12], dtype, 2);
            let b = randn(&[7], dtype, 3);
            let probe = randn(&[2, 5, 7], dtype, 4);
            let y = frozen_linear(x.as_tensor(), w.as_tensor(), Some(b.as_tensor())).unwrap();
            let reference = x
                .as_tensor()
                .broadcast_matmul(&w.as_tensor().t().unwrap())
                .unwrap()
                .broadcast_add(b.as_tensor())
                .unwrap();
            let tol = if dtype == DType::BF16 { 2e-2 } else { 1e-5 };
            assert!(rel_err(&y, &reference) < tol, "{dtype:?}: value {:e}", rel_err(&y, &reference));
            let g = (y * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
            let r = (reference * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
            let (gx, rx) = (g.get(x.as_tensor()).unwrap(), r.get(x.as_tensor()).unwrap());
            assert!(rel_err(gx, rx) < tol, "{dtype:?}: dx {:e}", rel_err(gx, rx));
            assert!(g.get(w.as_tensor()).is_none() && g.get(b.as_tensor()).is_none());
            assert!(r.get(w.as_tensor()).is_some(), "the reference does differentiate W");
        }
    }

    /// Without a graph on the input the op is not inserted at all.
    #[test]
    fn untracked_input_gives_a_plain_tensor() {
        let x = randn(&[3, 4], DType::F32, 5).as_tensor().detach();
        let w = Var::from_tensor(&randn(&[2, 4], DType::F32, 6).as_tensor().detach()).unwrap();
        let y = frozen_linear(&x, w.as_tensor(), None).unwrap();
        assert!(!y.track_op());
    }
}
