//! One Qwen3 decoder layer: its weights (`Layer`), what it reads besides them
//! (`LayerCtx`), and its two halves (attention, MLP) as functions over any
//! range of positions. `qwen3.rs` stacks layers; `recompute.rs` reruns them in
//! the backward pass; both depend on this file, which depends on neither: it imports
//! `config.rs`, `ops.rs` (the ops, [`Grad`]) and `lora.rs`, whose `LinearLike` runs
//! each projection with or without its adapter.
//!
//! Follows `transformers/models/qwen3/modeling_qwen3.py` (`Qwen3DecoderLayer`).

use candle_core::{Tensor, Var};

use super::config::Config;
use super::lora::{Adapter, LayerLora, LinearLike, Target};
use super::ops::{self, weight, Grad};
use crate::Result;

/// The weights of one decoder layer.
#[derive(Clone)]
pub(super) struct Layer {
    pub(super) q_proj: Var,
    pub(super) k_proj: Var,
    pub(super) v_proj: Var,
    pub(super) o_proj: Var,
    /// q, k, v, o biases when `attention_bias` is set.
    pub(super) biases: Option<[Var; 4]>,
    pub(super) q_norm: Var,
    pub(super) k_norm: Var,
    pub(super) input_layernorm: Var,
    pub(super) post_attention_layernorm: Var,
    pub(super) gate_proj: Var,
    pub(super) up_proj: Var,
    pub(super) down_proj: Var,
    /// LoRA adapters on the projections (none by default).
    pub(super) lora: LayerLora,
}

impl Layer {
    /// Every weight of the layer that trains, in a fixed order (for
    /// recomputation): with a frozen base (LoRA) the adapters alone.
    pub(super) fn vars(&self) -> Vec<&Var> {
        if self.lora.frozen() {
            return self.lora.vars().collect();
        }
        let mut v = vec![
            &self.q_proj,
            &self.k_proj,
            &self.v_proj,
            &self.o_proj,
            &self.q_norm,
            &self.k_norm,
            &self.input_layernorm,
            &self.post_attention_layernorm,
            &self.gate_proj,
            &self.up_proj,
            &self.down_proj,
        ];
        if let Some(bs) = &self.biases {
            v.extend(bs.iter());
        }
        v.extend(self.lora.vars());
        v
    }
}

/// What a decoder layer reads besides its weights and input: the config, the
/// rotary tables `(B, 1, L, D/2)` and the attention mask.
#[derive(Clone)]
pub(super) struct LayerCtx {
    pub cfg: Config,
    pub cos: Tensor,
    pub sin: Tensor,
    pub mask: ops::AttnMask,
}

impl Layer {
    /// The base weight `(out, in)` of projection `t`.
    pub(super) fn base(&self, t: Target) -> &Var {
        match t {
            Target::QProj => &self.q_proj,
            Target::KProj => &self.k_proj,
            Target::VProj => &self.v_proj,
            Target::OProj => &self.o_proj,
            Target::GateProj => &self.gate_proj,
            Target::UpProj => &self.up_proj,
            Target::DownProj => &self.down_proj,
        }
    }

    /// Projection `t` of this layer as the forward calls it ([`LinearLike`]).
    pub(super) fn proj(&self, t: Target) -> Proj<'_> {
        Proj { layer: self, t }
    }

    /// `W + scale * B A` in the base weight's dtype (the merged weight of
    /// projection `t`; the base weight itself without an adapter).
    pub(super) fn merged_weight(&self, t: Target) -> Result<Tensor> {
        self.proj(t).merged_weight()
    }

    /// How the forward reads the base weights (projections, norms, biases):
    /// never tracked when the base is frozen.
    pub(super) fn base_grad(&self, grad: Grad) -> Grad {
        if self.lora.frozen() {
            Grad::Off
        } else {
            grad
        }
    }
}

/// Projection `t` of a decoder layer: its base weight and the layer's adapter slot for
/// `t`, seen through [`LinearLike`] (which adds the adapter's term).
pub(super) struct Proj<'a> {
    layer: &'a Layer,
    t: Target,
}

impl LinearLike for Proj<'_> {
    fn base_weight(&self) -> &Var {
        self.layer.base(self.t)
    }

    fn adapter(&self) -> Option<&Adapter> {
        self.layer.lora.get(self.t)
    }

    fn frozen_base(&self) -> bool {
        self.layer.lora.frozen()
    }
}

/// `x W^T + bias` of projection `t` of `layer`, plus its adapter's term when
/// it has one. Every projection of a decoder layer goes through here.
fn linear(x: &Tensor, layer: &Layer, t: Target, bias: Option<&Tensor>, grad: Grad) -> Result<Tensor> {
    layer.proj(t).forward(x, bias, grad)
}

/// One decoder layer, `(B, L, hidden)` -> `(B, L, hidden)`. `offset` is the
/// number of cached keys before this chunk, `cache` this layer's `(k, v)`.
pub(super) fn layer_forward(
    layer: &Layer,
    ctx: &LayerCtx,
    x: &Tensor,
    offset: usize,
    cache: Option<(&Tensor, &Tensor)>,
    grad: Grad,
) -> Result<Tensor> {
    layer_from(layer, (ctx, ctx), x, 0, offset, cache, grad)
}

/// [`layer_forward`] with its output from position `from` on, `(B, L - from, hidden)`.
/// With `from > 0` (no cache) the output is read only at positions `from..L`:
/// the last layer of a forward whose head reads the response positions alone.
/// Keys and values come from every position; the queries, attention's output,
/// the output projection and the MLP only from `from` on, so the output is the
/// whole layer's narrowed to those positions. `q_ctx` is the [`LayerCtx`] of
/// the queries (their rotary tables, and the mask of `L - from` queries after
/// `from` keys); `ctx` that of every position (`q_ctx` is `ctx` when `from` is 0).
#[allow(clippy::too_many_arguments)]
pub(super) fn layer_from<'a>(
    layer: &Layer,
    (ctx, q_ctx): (&'a LayerCtx, &'a LayerCtx),
    x: &Tensor,
    from: usize,
    offset: usize,
    cache: Option<(&Tensor, &Tensor)>,
    grad: Grad,
) -> Result<Tensor> {
    let l = x.dim(1)?;
    let rot = |c: &'a LayerCtx| (&c.cos, &c.sin);
    let (q, k, v) = qkv_from(layer, &ctx.cfg, x, from, (rot(q_ctx), rot(ctx)), grad)?;
    let (k, v) = match cache {
        Some((ck, cv)) => {
            ck.slice_set(&k.contiguous()?, 2, offset)?;
            cv.slice_set(&v.contiguous()?, 2, offset)?;
            (ck.narrow(2, 0, offset + l)?, cv.narrow(2, 0, offset + l)?)
        }
        None => (k, v),
    };
    let xq = if from == 0 { x.clone() } else { x.narrow(1, from, l - from)? };
    let x = (xq + attention_out(layer, q_ctx, &q, &k, &v, grad)?)?;
    mlp_block(layer, &ctx.cfg, &x, grad)
}

/// The attention inputs of a decoder layer from its input `x` `(B, L,
/// hidden)` and the rotary tables `cos`, `sin` `(B, 1, L, D/2)` of its
/// positions: q `(B, Hq, L, D)` and k `(B, Hkv, L, D)` after the per-head
/// norm and the rotary embedding, v `(B, Hkv, L, D)` (a strided view). Each
/// position on its own, so it may run over any range of positions.
pub(super) fn qkv(
    layer: &Layer,
    c: &Config,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    grad: Grad,
) -> Result<(Tensor, Tensor, Tensor)> {
    qkv_from(layer, c, x, 0, ((cos, sin), (cos, sin)), grad)
}

/// Rotary tables `(cos, sin)`, each `(B, 1, L, D/2)`.
type Rotary<'a> = (&'a Tensor, &'a Tensor);

/// [`qkv`] with the queries at positions `from..L` only: q `(B, Hq, L - from,
/// D)` rotated by `q_rot`, k and v over every position, k rotated by `kv_rot`
/// (each a `(cos, sin)` pair).
fn qkv_from(
    layer: &Layer,
    c: &Config,
    x: &Tensor,
    from: usize,
    (q_rot, kv_rot): (Rotary<'_>, Rotary<'_>),
    grad: Grad,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, l, _) = x.dims3()?;
    let (nq, nkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let (q, k, v) = qkv_proj(layer, x, c.rms_norm_eps, from, grad)?;
    let v = v.reshape((b, l, nkv, d))?;
    let w = |v: &Var| weight(v, layer.base_grad(grad));
    // Per-head RMSNorm over D, then (B, H, L, D) and rotary embedding.
    let q = ops::norm_rope(&q, nq, &w(&layer.q_norm), q_rot.0, q_rot.1, c.rms_norm_eps)?;
    let k = ops::norm_rope(&k, nkv, &w(&layer.k_norm), kv_rot.0, kv_rot.1, c.rms_norm_eps)?;
    // (B, H, L, D) view; attention reads it strided.
    Ok((q, k, v.transpose(1, 2)?))
}

/// The input norm and the q, k, v projections of `x` `(B, L, hidden)`, as
/// the projections leave them: `(B, L - from, Hq * D)` (the queries from
/// position `from` on), `(B, L, Hkv * D)` twice.
pub(super) fn qkv_proj(
    layer: &Layer,
    x: &Tensor,
    eps: f64,
    from: usize,
    grad: Grad,
) -> Result<(Tensor, Tensor, Tensor)> {
    let w = |v: &Var| weight(v, layer.base_grad(grad));
    let bias = |i: usize| layer.biases.as_ref().map(|bs| weight(&bs[i], layer.base_grad(grad)));
    let h = ops::rms_norm(x, &w(&layer.input_layernorm), eps)?;
    let hq = if from == 0 { h.clone() } else { h.narrow(1, from, h.dim(1)? - from)?.contiguous()? };
    let q = linear(&hq, layer, Target::QProj, bias(0).as_ref(), grad)?;
    let k = linear(&h, layer, Target::KProj, bias(1).as_ref(), grad)?;
    let v = linear(&h, layer, Target::VProj, bias(2).as_ref(), grad)?;
    Ok((q, k, v))
}

/// Attention over `q`, `k`, `v` (as [`qkv`] returns them, k and v over every
/// key) and the output projection: the update the attention half adds to
/// the residual stream, `(B, L, hidden)`.
pub(super) fn attention_out(
    layer: &Layer,
    ctx: &LayerCtx,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    grad: Grad,
) -> Result<Tensor> {
    let o = ops::attention(q, k, v, &ctx.mask, ctx.cfg.num_key_value_heads)?; // (B, L, H*D)
    o_proj(layer, &o, grad)
}

/// The output projection of attention's result `o` `(B, L, Hq * D)`.
pub(super) fn o_proj(layer: &Layer, o: &Tensor, grad: Grad) -> Result<Tensor> {
    let bias = layer.biases.as_ref().map(|bs| weight(&bs[3], layer.base_grad(grad)));
    linear(o, layer, Target::OProj, bias.as_ref(), grad)
}

/// The MLP half of a decoder layer with its residual:
/// `x + down(silu(gate(norm(x))) * up(norm(x)))`. Each position on its own, so
/// it may run over any subset of positions.
pub(super) fn mlp_block(layer: &Layer, c: &Config, x: &Tensor, grad: Grad) -> Result<Tensor> {
    let w = |v: &Var| weight(v, layer.base_grad(grad));
    let h = ops::rms_norm(x, &w(&layer.post_attention_layernorm), c.rms_norm_eps)?;
    mlp_normed(layer, x, &h, grad)
}

/// [`mlp_block`] with the norm of `x` already taken: `x + down(silu(gate(h)) * up(h))`.
pub(super) fn mlp_normed(layer: &Layer, x: &Tensor, h: &Tensor, grad: Grad) -> Result<Tensor> {
    let gate = linear(h, layer, Target::GateProj, None, grad)?;
    let up = linear(h, layer, Target::UpProj, None, grad)?;
    let mlp = linear(&ops::swiglu(&gate, &up)?, layer, Target::DownProj, None, grad)?;
    super::budget::launch(1); // the residual add
    Ok((x + mlp)?)
}
