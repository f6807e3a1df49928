//! Activation checkpointing per decoder layer: the forward keeps only each
//! layer's input; the backward reruns the layer with the graph recorded and
//! backpropagates through it (Chen et al., 2016, "Training deep nets with
//! sublinear memory cost"; `torch.utils.checkpoint` as verl and TRL use it).
//!
//! candle has no checkpoint primitive, so a layer becomes one custom op over
//! `(x, token)`: its forward returns the output of a graph-free run of the
//! layer, its backward reruns the layer on a copy of `x` and takes `dx` and the
//! weights' gradients from that nested backward. The weight gradients reach
//! the outer graph through `token`, a scalar zero computed from every weight
//! of the layer by `Inject` nodes: `token` is an input of the layer op, so
//! candle runs the layer's backward first and the `Inject` backwards after
//! it, and each hands its weight the gradient the layer's backward left in a
//! shared stash. The recomputation repeats the same kernels on the same
//! inputs, so the gradients equal those of the plain graph.
//!
//! The ops' forwards hand candle a precomputed output (`precomputed.rs`) on
//! whichever backend the inputs live, so this serves every device and dtype.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CudaStorage, CustomOp1, CustomOp2, Layout, MetalStorage, Shape, Tensor, Var};

use super::config::Config;
use super::layer::{attention_out, layer_forward, mlp_block, qkv, Layer, LayerCtx};
use super::ops::Grad;
use super::precomputed::{zero_like, Held};
use crate::{Error, Result};

/// When decoder layers are recomputed in the backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Recompute {
    /// Never: every layer keeps its activations for the backward pass.
    Off,
    /// Always (when a graph is recorded).
    On,
    /// When the activations the backward would keep come to at least
    /// [`Recompute::AUTO_BYTES`] ([`activation_bytes`]).
    #[default]
    Auto,
}

impl Recompute {
    /// Bytes of kept activations per forward pass from which `Auto`
    /// recomputes: 4 GiB, about 1500 tokens at the Qwen3-0.6B shape in f32,
    /// and no small model's usual batch (the bundled model's 512 sequences of
    /// 50 tokens keep about 1.5 GB), whose backward then runs as one graph.
    pub const AUTO_BYTES: usize = 4 << 30;

    /// Parses `off`, `on` or `auto`; `what` names the field in the error.
    pub fn parse(s: &str, what: &str) -> Result<Self> {
        match s {
            "off" | "false" => Ok(Self::Off),
            "on" | "true" => Ok(Self::On),
            "auto" => Ok(Self::Auto),
            _ => Err(Error::invalid(format!("{what}: expected \"auto\", \"on\" or \"off\", got {s:?}"))),
        }
    }

    /// The name [`Recompute::parse`] reads.
    pub fn name(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::On => "on",
            Self::Auto => "auto",
        }
    }

    /// Whether a forward pass of `tokens` tokens of the model `cfg` with
    /// activations of `elem_bytes` bytes each recomputes (the same rule on
    /// every device).
    pub fn active(self, tokens: usize, cfg: &Config, elem_bytes: usize) -> bool {
        match self {
            Self::Off => false,
            Self::On => true,
            Self::Auto => activation_bytes(cfg, elem_bytes).saturating_mul(tokens) >= Self::AUTO_BYTES,
        }
    }

    pub(super) fn to_u8(self) -> u8 {
        self as u8
    }

    pub(super) fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Off,
            1 => Self::On,
            _ => Self::Auto,
        }
    }
}

/// Bytes of the activations one token keeps for the backward over every
/// decoder layer, without recomputation: per layer the input, the normed
/// input, the attention output and its residual, the normed residual and the
/// MLP output (six hidden-sized rows), q before and after its norm and rotary
/// embedding and attention's output (three of `heads · head_dim`), k before
/// and after, and v (three of `kv_heads · head_dim`, one more for the strided
/// copy attention reads), and gate, up and their product (three of the MLP
/// width). An estimate within a few rows of what candle's graph holds.
pub fn activation_bytes(c: &Config, elem_bytes: usize) -> usize {
    let q = c.num_attention_heads * c.head_dim;
    let kv = c.num_key_value_heads * c.head_dim;
    let per_layer = 6 * c.hidden_size + 3 * q + 4 * kv + 3 * c.intermediate_size;
    per_layer * c.num_hidden_layers * elem_bytes
}

/// A [`Recompute`] setting shared by every holder of a model.
#[derive(Debug, Default)]
pub(super) struct RecomputeCell(AtomicU8);

impl RecomputeCell {
    pub(super) fn new(r: Recompute) -> Self {
        Self(AtomicU8::new(r.to_u8()))
    }
    pub(super) fn get(&self) -> Recompute {
        Recompute::from_u8(self.0.load(Ordering::Relaxed))
    }
    pub(super) fn set(&self, r: Recompute) {
        self.0.store(r.to_u8(), Ordering::Relaxed)
    }
}

/// Weight gradients left by a layer's backward for its [`Inject`] nodes.
pub(super) type Stash = Arc<Mutex<Vec<Option<Tensor>>>>;

/// A scalar zero computed from every weight of [`Layer::vars`] by [`Inject`]
/// nodes, and the stash their backwards read: a layer op that takes the
/// token as an input runs its backward before theirs, and leaves each
/// weight's gradient at its index in the stash.
pub(super) fn weight_token(layer: &Layer) -> Result<(Tensor, Stash)> {
    let vars = layer.vars();
    let stash: Stash = Arc::new(Mutex::new(vec![None; vars.len()]));
    let mut token: Option<Tensor> = None;
    for (i, v) in vars.iter().enumerate() {
        let z = v.as_tensor().apply_op1(Inject { stash: stash.clone(), index: i })?;
        token = Some(match token {
            None => z,
            Some(t) => (t + z)?,
        });
    }
    let token = token.ok_or_else(|| Error::invalid("decoder layer: a layer without weights"))?;
    Ok((token, stash))
}

fn op_err(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("recomputed layer: {e}"))
}

/// A decoder layer whose activations are recomputed in the backward pass;
/// same value as [`layer_forward`] with a recorded graph.
pub(super) fn layer(layer: &Layer, ctx: &LayerCtx, x: &Tensor) -> Result<Tensor> {
    let (token, stash) = weight_token(layer)?;
    let y = layer_forward(layer, ctx, &x.detach(), 0, None, Grad::Off)?;
    let op =
        Checkpoint { layer: layer.clone(), ctx: ctx.clone(), y: Held::new(y, "recomputed layer"), stash };
    Ok(x.apply_op2(&token, op)?)
}

/// The layer op over `(x, token)`; see the module docs.
struct Checkpoint {
    layer: Layer,
    ctx: LayerCtx,
    /// The graph-free output, copied into the op's storage by the forward.
    y: Held,
    stash: Stash,
}

impl CustomOp2 for Checkpoint {
    fn name(&self) -> &'static str {
        "recomputed-layer"
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

    fn cuda_fwd(
        &self,
        _s1: &CudaStorage,
        _l1: &Layout,
        _s2: &CudaStorage,
        _l2: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        self.y.cuda()
    }

    fn metal_fwd(
        &self,
        _s1: &MetalStorage,
        _l1: &Layout,
        _s2: &MetalStorage,
        _l2: &Layout,
    ) -> candle_core::Result<(MetalStorage, Shape)> {
        self.y.metal()
    }

    fn bwd(
        &self,
        x: &Tensor,
        token: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let chunk = chunk_tokens(&self.ctx.cfg, x.dtype().size_in_bytes());
        let (dx, grads) = layer_backward(&self.layer, &self.ctx, x, dy, chunk).map_err(op_err)?;
        let mut stash = self.stash.lock().map_err(op_err)?;
        for ((slot, g), v) in stash.iter_mut().zip(grads).zip(self.layer.vars()) {
            *slot = Some(match g {
                Some(g) => g,
                None => v.as_tensor().zeros_like()?,
            });
        }
        Ok((Some(dx), Some(token.zeros_like()?)))
    }
}

/// Tokens (positions times rows) per piece of a recomputed layer's backward,
/// at least.
pub(super) const CHUNK_TOKENS: usize = 1024;

/// Bytes of one layer's activations per piece of a recomputed layer's
/// backward ([`activation_bytes`] of one layer), at most, beyond
/// [`CHUNK_TOKENS`] tokens.
const PIECE_BYTES: usize = 64 << 20;

/// Tokens per piece of a recomputed layer's backward for the model `c`:
/// [`CHUNK_TOKENS`], or more for narrow models, as many as keep
/// [`PIECE_BYTES`] of one layer's activations (4369 at the bundled model's
/// shape in f32: few pieces, each one large product per projection).
pub(super) fn chunk_tokens(c: &Config, elem_bytes: usize) -> usize {
    let per_token = (activation_bytes(c, elem_bytes) / c.num_hidden_layers.max(1)).max(1);
    (PIECE_BYTES / per_token).max(CHUNK_TOKENS)
}

/// The backward of one decoder layer from its input `x` and the gradient of
/// its output `dy`: `dx` and the gradients of [`Layer::vars`], in that order
/// (`None` for a weight the layer does not use).
///
/// Only attention mixes positions; everything else in the layer works on
/// each position alone. So the layer is rerun and backpropagated in pieces
/// of about `chunk` tokens wherever it can be, the weight gradients summed
/// over the pieces:
/// 1. q, k and v of every position, a piece at a time, without a graph;
/// 2. attention and the output projection over the whole sequence, with a
///    graph from q, k and v;
/// 3. the MLP half, a piece at a time: the gradient of its input;
/// 4. the backward of step 2: the gradients of q, k and v;
/// 5. the projections, norms and rotary embedding of step 1 again, a piece
///    at a time with a graph, backpropagated from those gradients.
///
/// So at full length the layer holds q, k, v, the attention output and
/// their gradients, not the activations of the norms, projections and MLP
/// (gate, up, their product: three times the MLP width per position), which
/// exist for one piece at a time. With `chunk` at least the token count this
/// is the plain backward of the layer, split at q, k, v and the MLP input.
pub(super) fn layer_backward(
    layer: &Layer,
    ctx: &LayerCtx,
    x: &Tensor,
    dy: &Tensor,
    chunk: usize,
) -> Result<(Tensor, Vec<Option<Tensor>>)> {
    let vars = layer.vars();
    let mut sums: Vec<Option<Tensor>> = vec![None; vars.len()];
    let mut add = |grads: &candle_core::backprop::GradStore| -> Result<()> {
        for (sum, v) in sums.iter_mut().zip(&vars) {
            if let Some(g) = grads.get(v.as_tensor()) {
                *sum = Some(match sum.take() {
                    None => g.clone(),
                    Some(s) => (s + g)?,
                });
            }
        }
        Ok(())
    };
    let grad_of = |grads: &candle_core::backprop::GradStore, t: &Tensor, what: &str| -> Result<Tensor> {
        grads.get(t).cloned().ok_or_else(|| Error::from(op_err(format!("no gradient for {what}"))))
    };
    let c = &ctx.cfg;
    let (x, dy) = (x.detach(), dy.detach());
    let (b, l, _) = x.dims3()?;
    let (dtype, device) = (x.dtype(), x.device());
    let pieces = Pieces::of(b, l, chunk);
    let piece_qkv = |x: &Tensor, p: Piece, grad: Grad| {
        qkv(layer, c, x, &p.of(&ctx.cos, 0, 2)?, &p.of(&ctx.sin, 0, 2)?, grad)
    };
    // 1.
    let (nq, nkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let q = Var::zeros((b, nq, l, d), dtype, device)?;
    let k = Var::zeros((b, nkv, l, d), dtype, device)?;
    let v = Var::zeros((b, nkv, l, d), dtype, device)?;
    for p in pieces.iter() {
        let (qp, kp, vp) = piece_qkv(&p.of(&x, 0, 1)?, p, Grad::Off)?;
        for (full, part) in [(&q, qp), (&k, kp), (&v, vp)] {
            p.set(full.as_tensor(), &part.contiguous()?, 0, 2)?;
        }
    }
    // 2.
    let attn = attention_out(layer, ctx, q.as_tensor(), k.as_tensor(), v.as_tensor(), Grad::Track)?;
    // 3.
    let dh = Tensor::zeros(x.shape(), dtype, device)?;
    for p in pieces.iter() {
        let hv = Var::from_tensor(&(p.of(&x, 0, 1)? + p.of(&attn, 0, 1)?.detach())?)?;
        let y = mlp_block(layer, c, hv.as_tensor(), Grad::Track)?;
        let grads = (y * p.of(&dy, 0, 1)?)?.sum_all()?.backward()?;
        add(&grads)?;
        p.set(&dh, &grad_of(&grads, hv.as_tensor(), "the MLP input")?, 0, 1)?;
    }
    // 4.
    let grads = (attn * &dh)?.sum_all()?.backward()?;
    add(&grads)?;
    let dq = grad_of(&grads, q.as_tensor(), "q")?;
    let dk = grad_of(&grads, k.as_tensor(), "k")?;
    let dv = grad_of(&grads, v.as_tensor(), "v")?;
    drop((grads, q, k, v));
    // 5.
    let dxa = Tensor::zeros(x.shape(), dtype, device)?;
    for p in pieces.iter() {
        let xv = Var::from_tensor(&p.of(&x, 0, 1)?)?;
        let (qp, kp, vp) = piece_qkv(xv.as_tensor(), p, Grad::Track)?;
        let loss = ((qp * p.of(&dq, 0, 2)?)?.sum_all()?
            + (kp * p.of(&dk, 0, 2)?)?.sum_all()?
            + (vp * p.of(&dv, 0, 2)?)?.sum_all()?)?;
        let grads = loss.backward()?;
        add(&grads)?;
        p.set(&dxa, &grad_of(&grads, xv.as_tensor(), "the input")?, 0, 1)?;
    }
    Ok(((dh + dxa)?, sums))
}

/// How [`layer_backward`] cuts a `(B, L)` batch into pieces of about
/// `chunk` tokens: whole rows, `chunk / L` of them a piece, when a row is
/// shorter than `chunk` (contiguous slices of every tensor, each piece one
/// large product per projection); else every row at once, `chunk / B`
/// positions (at least one) a piece.
struct Pieces {
    /// True for pieces of rows, false for pieces of positions.
    by_row: bool,
    /// Rows (or positions) in all.
    len: usize,
    /// Rows (or positions) per piece.
    step: usize,
}

impl Pieces {
    fn of(b: usize, l: usize, chunk: usize) -> Self {
        if l < chunk && b > 1 {
            Self { by_row: true, len: b, step: (chunk / l.max(1)).max(1) }
        } else {
            Self { by_row: false, len: l, step: (chunk / b.max(1)).max(1) }
        }
    }

    fn iter(&self) -> impl Iterator<Item = Piece> + '_ {
        (0..self.len).step_by(self.step).map(|s| Piece {
            by_row: self.by_row,
            start: s,
            len: self.step.min(self.len - s),
        })
    }
}

/// One piece of [`Pieces`]: `len` rows or positions from `start`.
#[derive(Clone, Copy)]
struct Piece {
    by_row: bool,
    start: usize,
    len: usize,
}

impl Piece {
    /// The dimension of a tensor this piece cuts, given where its rows and
    /// its positions are.
    fn dim(&self, row_dim: usize, pos_dim: usize) -> usize {
        if self.by_row {
            row_dim
        } else {
            pos_dim
        }
    }

    /// This piece of `t`, whose rows are dimension `row_dim` and positions `pos_dim`.
    fn of(&self, t: &Tensor, row_dim: usize, pos_dim: usize) -> Result<Tensor> {
        Ok(t.narrow(self.dim(row_dim, pos_dim), self.start, self.len)?)
    }

    /// Writes `part` into this piece of `full`.
    fn set(&self, full: &Tensor, part: &Tensor, row_dim: usize, pos_dim: usize) -> Result<()> {
        Ok(full.slice_set(part, self.dim(row_dim, pos_dim), self.start)?)
    }
}

/// A scalar zero computed from one weight, whose backward returns that
/// weight's gradient from the stash of its layer.
struct Inject {
    stash: Stash,
    index: usize,
}

impl CustomOp1 for Inject {
    fn name(&self) -> &'static str {
        "recomputed-layer-weight"
    }

    fn cpu_fwd(&self, s: &CpuStorage, _l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        zero_like(s)
    }

    fn cuda_fwd(&self, s: &CudaStorage, _l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        zero_like(s)
    }

    fn metal_fwd(&self, s: &MetalStorage, _l: &Layout) -> candle_core::Result<(MetalStorage, Shape)> {
        zero_like(s)
    }

    fn bwd(&self, _w: &Tensor, _res: &Tensor, _grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let g = self.stash.lock().map_err(op_err)?.get_mut(self.index).and_then(Option::take);
        g.map(Some).ok_or_else(|| op_err("weight gradient missing (layer backward did not run first)"))
    }
}
