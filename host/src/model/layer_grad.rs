//! A decoder layer as one op with a hand-written backward, for the CPU's
//! fused kernels (f32, f64) when its activations are kept (no recomputation).
//!
//! candle's autograd runs every node of a layer's graph (about fifteen:
//! norms, projections, rotary, attention, SwiGLU, residual adds, reshapes)
//! as its own backward step, and before each it fills a fresh zero gradient
//! and adds into it: two single-threaded passes over every activation per
//! node on top of the kernels. Here the forward runs the layer without a
//! graph and keeps what its backward reads; the backward calls the fused
//! kernels' backward passes directly, in the order of
//! [`super::layer::layer_forward`] reversed:
//! 1. the MLP: `down`'s backward, SwiGLU's, then `gate` and `up` together
//!    ([`fused::linear::linears_bwd`]: one `dx`, summed inside the products),
//!    the post-attention norm's, and the residual;
//! 2. attention: the output projection's backward, then attention's, through
//!    a graph of the attention op alone (kept from the forward: q, k and v as
//!    variables), then the per-head norm and rotary embedding of q and k, the
//!    q, k and v projections together, the input norm's, and the residual.
//!
//! The weights' gradients reach the outer graph as for a recomputed layer
//! ([`super::recompute`]): through a token computed from every weight, whose
//! backward nodes hand each weight the gradient the layer's backward left.
//! Served when [`serves`] says so: no adapters, no biases, weights in the
//! activations' dtype; every other layer takes the plain graph.

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor, Var};

use super::config::Config;
use super::fused;
use super::layer::{Layer, LayerCtx};
use super::ops;
use super::precomputed::Held;
use super::recompute::{weight_token, Stash};
use crate::{Error, Result};

/// True when [`layer`] serves `layer` on `x`: the fused kernels serve `x`,
/// and the layer has no adapters, no biases and weights in `x`'s dtype.
pub(super) fn serves(layer: &Layer, x: &Tensor) -> bool {
    fused::supported(x)
        && layer.biases.is_none()
        && layer.lora.vars().next().is_none()
        && !layer.lora.frozen()
        && layer.vars().iter().all(|v| v.dtype() == x.dtype())
}

/// What the backward of one layer reads, from its forward.
struct Kept {
    x: Tensor,
    /// The normed input, the q, k and v projections' input.
    h1: Tensor,
    /// The q and k projections `(B, L, H · D)`, before their norm and rotary embedding.
    ql: Tensor,
    kl: Tensor,
    /// q, k and v as variables of the attention graph, and its output `(B, L, Hq · D)`.
    q: Var,
    k: Var,
    v: Var,
    o: Tensor,
    /// The residual after attention, the MLP's input.
    x2: Tensor,
    /// The normed `x2`, the gate and up projections' input.
    h2: Tensor,
    gate: Tensor,
    up: Tensor,
    /// SwiGLU of gate and up, the down projection's input.
    act: Tensor,
}

/// One decoder layer with its activations kept and a hand-written backward;
/// the same value as [`super::layer::layer_forward`] with a recorded graph.
pub(super) fn layer(layer: &Layer, ctx: &LayerCtx, x: &Tensor) -> Result<Tensor> {
    let (token, stash) = weight_token(layer)?;
    let (y, kept) = forward(layer, ctx, &x.detach())?;
    let op = KeptLayer {
        layer: layer.clone(),
        ctx: ctx.clone(),
        y: Held::new(y, "decoder layer"),
        kept: Mutex::new(Some(kept)),
        stash,
    };
    Ok(x.apply_op2(&token, op)?)
}

/// The layer's forward without a graph (attention's own aside), keeping what
/// the backward reads.
fn forward(layer: &Layer, ctx: &LayerCtx, x: &Tensor) -> Result<(Tensor, Kept)> {
    let c = &ctx.cfg;
    let w = |v: &Var| v.as_tensor().detach();
    let (b, l, _) = x.dims3()?;
    let (nq, nkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let h1 = fused::rms_norm(x, &w(&layer.input_layernorm), c.rms_norm_eps)?;
    let ql = fused::linear(&h1, &w(&layer.q_proj))?;
    let kl = fused::linear(&h1, &w(&layer.k_proj))?;
    let vl = fused::linear(&h1, &w(&layer.v_proj))?;
    let q = fused::norm_rope(&ql, nq, &w(&layer.q_norm), (&ctx.cos, &ctx.sin), c.rms_norm_eps)?;
    let k = fused::norm_rope(&kl, nkv, &w(&layer.k_norm), (&ctx.cos, &ctx.sin), c.rms_norm_eps)?;
    let v = vl.reshape((b, l, nkv, d))?.transpose(1, 2)?.contiguous()?;
    let (q, k, v) = (Var::from_tensor(&q)?, Var::from_tensor(&k)?, Var::from_tensor(&v)?);
    let o = ops::attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), &ctx.mask, nkv)?;
    let x2 = (x + fused::linear(&o.detach(), &w(&layer.o_proj))?)?;
    let h2 = fused::rms_norm(&x2, &w(&layer.post_attention_layernorm), c.rms_norm_eps)?;
    let gate = fused::linear(&h2, &w(&layer.gate_proj))?;
    let up = fused::linear(&h2, &w(&layer.up_proj))?;
    let act = fused::swiglu(&gate, &up)?;
    let y = (&x2 + fused::linear(&act, &w(&layer.down_proj))?)?;
    let kept = Kept { x: x.clone(), h1, ql, kl, q, k, v, o, x2, h2, gate, up, act };
    Ok((y, kept))
}

/// The gradients of one layer from its kept activations and the gradient of
/// its output `dy`: `dx` and the gradients of [`Layer::vars`], in that order.
fn backward(
    layer: &Layer,
    c: &Config,
    ctx: &LayerCtx,
    kept: Kept,
    dy: &Tensor,
) -> Result<(Tensor, Vec<Tensor>)> {
    let w = |v: &Var| v.as_tensor().detach();
    let eps = c.rms_norm_eps;
    let (nq, nkv) = (c.num_attention_heads, c.num_key_value_heads);
    let (b, l, _) = kept.x.dims3()?;
    let dy = dy.contiguous()?;
    // 1. The MLP.
    let (dact, dw_down) = one(fused::linear::linears_bwd(&kept.act, &[(&w(&layer.down_proj), &dy)])?)?;
    let (dgate, dup) = fused::swiglu::swiglu_bwd(&kept.gate, &kept.up, &dact)?;
    drop((kept.gate, kept.up, kept.act, dact));
    let (dh2, dw_gu) =
        fused::linear::linears_bwd(&kept.h2, &[(&w(&layer.gate_proj), &dgate), (&w(&layer.up_proj), &dup)])?;
    drop((dgate, dup, kept.h2));
    let (dx2n, dw_post) =
        fused::norm::rms_norm_bwd(&kept.x2, &w(&layer.post_attention_layernorm), eps, &dh2)?;
    let dx2 = (&dy + dx2n)?;
    // 2. Attention.
    let (d_o, dw_o) = one(fused::linear::linears_bwd(&kept.o.detach(), &[(&w(&layer.o_proj), &dx2)])?)?;
    let grads = (kept.o * d_o)?.sum_all()?.backward()?;
    let grad = |v: &Var, what: &str| {
        grads
            .get(v.as_tensor())
            .cloned()
            .ok_or_else(|| Error::invalid(format!("decoder layer: no gradient for {what}")))
    };
    let (dq, dk, dv) = (grad(&kept.q, "q")?, grad(&kept.k, "k")?, grad(&kept.v, "v")?);
    drop(grads);
    let cs = (&ctx.cos, &ctx.sin);
    let (dql, dw_qn) = fused::rope::norm_rope_bwd(&kept.ql, nq, &w(&layer.q_norm), cs, eps, &dq)?;
    let (dkl, dw_kn) = fused::rope::norm_rope_bwd(&kept.kl, nkv, &w(&layer.k_norm), cs, eps, &dk)?;
    let dvl = dv.transpose(1, 2)?.contiguous()?.reshape((b, l, nkv * c.head_dim))?;
    let (dh1, dw_qkv) = fused::linear::linears_bwd(
        &kept.h1,
        &[(&w(&layer.q_proj), &dql), (&w(&layer.k_proj), &dkl), (&w(&layer.v_proj), &dvl)],
    )?;
    let (dxn, dw_in) = fused::norm::rms_norm_bwd(&kept.x, &w(&layer.input_layernorm), eps, &dh1)?;
    let dx = (dx2 + dxn)?;
    // In the order of `Layer::vars` (no biases, no adapters: see `serves`).
    let [dq_w, dk_w, dv_w]: [Tensor; 3] =
        dw_qkv.try_into().map_err(|_| Error::invalid("decoder layer: q, k, v"))?;
    let [dg_w, du_w]: [Tensor; 2] =
        dw_gu.try_into().map_err(|_| Error::invalid("decoder layer: gate, up"))?;
    Ok((dx, vec![dq_w, dk_w, dv_w, dw_o, dw_qn, dw_kn, dw_in, dw_post, dg_w, du_w, dw_down]))
}

/// The one `dx` and `dw` of a single projection's [`fused::linear::linears_bwd`].
fn one((dx, mut dws): (Tensor, Vec<Tensor>)) -> Result<(Tensor, Tensor)> {
    let dw = dws.pop().ok_or_else(|| Error::invalid("decoder layer: a projection without its gradient"))?;
    Ok((dx, dw))
}

/// The layer op over `(x, token)`.
struct KeptLayer {
    layer: Layer,
    ctx: LayerCtx,
    /// The output, copied into the op's storage by the forward.
    y: Held,
    /// The activations, taken by the backward (once).
    kept: Mutex<Option<Kept>>,
    stash: Stash,
}

fn op_err(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("decoder layer: {e}"))
}

impl CustomOp2 for KeptLayer {
    fn name(&self) -> &'static str {
        "decoder-layer"
    }

    fn cpu_fwd(
        &self,
        _s1: &CpuStorage,
        _l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.y.cpu()
    }

    fn bwd(
        &self,
        _x: &Tensor,
        token: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let kept = self.kept.lock().map_err(op_err)?.take().ok_or_else(|| op_err("backward ran twice"))?;
        let (dx, grads) = backward(&self.layer, &self.ctx.cfg, &self.ctx, kept, dy).map_err(op_err)?;
        let mut stash = self.stash.lock().map_err(op_err)?;
        for (slot, g) in stash.iter_mut().zip(grads) {
            *slot = Some(g);
        }
        Ok((Some(dx), Some(token.zeros_like()?)))
    }
}
