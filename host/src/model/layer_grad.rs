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
//! 2. attention: the output projection's backward, then attention's (the
//!    kernel kept from the forward, [`fused::attention::attention_kept`]),
//!    then the per-head norm and rotary embedding of q and k, the q, k and v
//!    projections together, the input norm's, and the residual.
//!
//! Every pass runs on all cores: the residual adds happen inside the
//! products of the forward and inside the norms' backwards, and the copies
//! (the layer's output, v's gradient back to rows) are parallel.
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
use super::fused::attention::AttentionKept;
use super::layer::{Layer, LayerCtx};
use super::precomputed::Held;
use super::recompute::{weight_token, Stash};
use crate::{Error, Result};

/// True when [`layer_from`] serves `layer` on `x`: the fused kernels serve `x`,
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
    /// The first position the output holds (see [`layer_from`]; 0 for a whole layer).
    from: usize,
    x: Tensor,
    /// The normed input, the q, k and v projections' input.
    h1: Tensor,
    /// The q projection `(B, L - from, Hq · D)` and the k projection `(B, L,
    /// Hkv · D)`, before their norm and rotary embedding.
    ql: Tensor,
    kl: Tensor,
    /// Attention over q, k and v (kept by the kernel), with its output `(B, L, Hq · D)`.
    attn: AttentionKept,
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

/// One decoder layer with its activations kept and a hand-written backward,
/// its output at positions `from..L` (all of them when `from` is 0); the same
/// value as [`super::layer::layer_from`] (see there) with a recorded graph.
/// `q_ctx` is the context of those positions' queries (`ctx` when `from` is 0).
pub(super) fn layer_from(
    layer: &Layer,
    (ctx, q_ctx): (&LayerCtx, &LayerCtx),
    from: usize,
    x: &Tensor,
) -> Result<Tensor> {
    let (token, stash) = weight_token(layer)?;
    let (y, kept) = forward(layer, ctx, q_ctx, from, &x.detach())?;
    let op = KeptLayer {
        layer: layer.clone(),
        ctx: ctx.clone(),
        q_ctx: q_ctx.clone(),
        y: Held::new(y, "decoder layer"),
        kept: Mutex::new(Some(kept)),
        stash,
    };
    Ok(x.apply_op2(&token, op)?)
}

/// The layer's forward without a graph, keeping what the backward reads. The
/// residual adds happen inside the output and down projections' products
/// ([`fused::linear::linear_add`]); v reaches attention as the projection
/// leaves it (a strided view, no copy). Queries, and everything after
/// attention, only at positions `from..L` (`q_ctx` their context).
fn forward(
    layer: &Layer,
    ctx: &LayerCtx,
    q_ctx: &LayerCtx,
    from: usize,
    x: &Tensor,
) -> Result<(Tensor, Kept)> {
    let c = &ctx.cfg;
    let w = |v: &Var| v.as_tensor().detach();
    let (b, l, _) = x.dims3()?;
    let (nq, nkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let rows = |t: &Tensor| -> Result<Tensor> {
        Ok(if from == 0 { t.clone() } else { t.narrow(1, from, l - from)?.contiguous()? })
    };
    let h1 = fused::rms_norm(x, &w(&layer.input_layernorm), c.rms_norm_eps)?;
    let ql = fused::linear(&rows(&h1)?, &w(&layer.q_proj))?;
    let kl = fused::linear(&h1, &w(&layer.k_proj))?;
    let vl = fused::linear(&h1, &w(&layer.v_proj))?;
    let q = fused::norm_rope(&ql, nq, &w(&layer.q_norm), (&q_ctx.cos, &q_ctx.sin), c.rms_norm_eps)?;
    let k = fused::norm_rope(&kl, nkv, &w(&layer.k_norm), (&ctx.cos, &ctx.sin), c.rms_norm_eps)?;
    let v = vl.reshape((b, l, nkv, d))?.transpose(1, 2)?;
    let (o, attn) = fused::attention::attention_kept(&q, &k, &v, q_ctx.mask.kept())?;
    let x2 = fused::linear::linear_add(&rows(x)?, &o, &w(&layer.o_proj))?;
    let h2 = fused::rms_norm(&x2, &w(&layer.post_attention_layernorm), c.rms_norm_eps)?;
    let gate = fused::linear(&h2, &w(&layer.gate_proj))?;
    let up = fused::linear(&h2, &w(&layer.up_proj))?;
    let act = fused::swiglu(&gate, &up)?;
    let y = fused::linear::linear_add(&x2, &act, &w(&layer.down_proj))?;
    let kept = Kept { from, x: x.clone(), h1, ql, kl, attn, o, x2, h2, gate, up, act };
    Ok((y, kept))
}

/// The gradients of one layer from its kept activations and the gradient of
/// its output `dy`: `dx` and the gradients of [`Layer::vars`], in that order.
/// Each residual's gradient is added inside the backward of the norm that
/// reads the stream ([`fused::norm::rms_norm_bwd_add`]). With an output from
/// position `from` on, the gradients of q and of the residual are zero
/// before it.
fn backward(
    layer: &Layer,
    c: &Config,
    (ctx, q_ctx): (&LayerCtx, &LayerCtx),
    kept: Kept,
    dy: &Tensor,
) -> Result<(Tensor, Vec<Tensor>)> {
    let w = |v: &Var| v.as_tensor().detach();
    let eps = c.rms_norm_eps;
    let (nq, nkv) = (c.num_attention_heads, c.num_key_value_heads);
    let dy = dy.contiguous()?;
    // 1. The MLP.
    let (dact, dw_down) = one(fused::linear::linears_bwd(&kept.act, &[(&w(&layer.down_proj), &dy)])?)?;
    let (dgate, dup) = fused::swiglu::swiglu_bwd(&kept.gate, &kept.up, &dact)?;
    drop((kept.gate, kept.up, kept.act, dact));
    let (dh2, dw_gu) =
        fused::linear::linears_bwd(&kept.h2, &[(&w(&layer.gate_proj), &dgate), (&w(&layer.up_proj), &dup)])?;
    drop((dgate, dup, kept.h2));
    let (dx2, dw_post) =
        fused::norm::rms_norm_bwd_add(&kept.x2, &w(&layer.post_attention_layernorm), eps, &dh2, &dy)?;
    drop((dh2, dy));
    // 2. Attention.
    let (d_o, dw_o) = one(fused::linear::linears_bwd(&kept.o, &[(&w(&layer.o_proj), &dx2)])?)?;
    let (dq, dk, dv) = kept.attn.backward(&d_o)?;
    drop(d_o);
    let (qcs, cs) = ((&q_ctx.cos, &q_ctx.sin), (&ctx.cos, &ctx.sin));
    let (dql, dw_qn) = fused::rope::norm_rope_bwd(&kept.ql, nq, &w(&layer.q_norm), qcs, eps, &dq)?;
    let (dkl, dw_kn) = fused::rope::norm_rope_bwd(&kept.kl, nkv, &w(&layer.k_norm), cs, eps, &dk)?;
    let dvl = fused::attention::heads_to_rows(&dv)?;
    drop((dq, dk, dv));
    // Rows before `from` had no query and no output: zero gradients there.
    let all_rows = |t: Tensor| -> Result<Tensor> {
        Ok(if kept.from == 0 { t } else { t.pad_with_zeros(1, kept.from, 0)? })
    };
    let (dql, dx2) = (all_rows(dql)?, all_rows(dx2)?);
    let (dh1, dw_qkv) = fused::linear::linears_bwd(
        &kept.h1,
        &[(&w(&layer.q_proj), &dql), (&w(&layer.k_proj), &dkl), (&w(&layer.v_proj), &dvl)],
    )?;
    let (dx, dw_in) = fused::norm::rms_norm_bwd_add(&kept.x, &w(&layer.input_layernorm), eps, &dh1, &dx2)?;
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
    /// The context of the positions the output holds (`ctx` for a whole layer).
    q_ctx: LayerCtx,
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
        let (dx, grads) =
            backward(&self.layer, &self.ctx.cfg, (&self.ctx, &self.q_ctx), kept, dy).map_err(op_err)?;
        let mut stash = self.stash.lock().map_err(op_err)?;
        for (slot, g) in stash.iter_mut().zip(grads) {
            *slot = Some(g);
        }
        Ok((Some(dx), Some(token.zeros_like()?)))
    }
}
