//! Differentiable building blocks of the Qwen3 forward pass.
//!
//! Each op matches its PyTorch counterpart in `modeling_qwen3.py`: RMSNorm in
//! f32 then cast back, rotate-half rotary embeddings, eager attention with an
//! additive mask and softmax in f32.
//!
//! Each op dispatches: CPU tensors in f32/f64 go to the fused kernels of
//! [`super::fused`] (one pass per row, hand-written backward); every other
//! device or dtype (CUDA, bf16) goes to the `*_composed` versions, built from
//! candle ops that have a backward. The composed versions are also the
//! reference the fused kernels are tested against.

use candle_core::{DType, Device, Tensor, Var, D};

use super::{budget, fused};
use crate::Result;

/// Additive bias for a masked attention score. Finite, so that a query whose
/// keys are all masked (left padding) yields finite garbage instead of NaN.
pub const MASKED: f32 = -1e9;

/// The dtype reductions run in: f32 for half types, else the input's own.
pub fn compute_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// Whether a forward pass records the autograd graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grad {
    /// Record operations so that `loss.backward()` reaches the parameters.
    Track,
    /// Inference: compute on detached views of the weights.
    Off,
}

/// The weight `v` as the forward uses it: tracked, or a detached view.
pub(super) fn weight(v: &Var, grad: Grad) -> Tensor {
    match grad {
        Grad::Track => v.as_tensor().clone(),
        Grad::Off => v.as_tensor().detach(),
    }
}

/// `x @ w^T + b` over the last dimension; `x` is `(.., in)`, `w` is `(out, in)`.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    if fused::supported(x) {
        let y = fused::linear(x, w)?;
        return Ok(match b {
            Some(b) => y.broadcast_add(&b.to_dtype(y.dtype())?)?,
            None => y,
        });
    }
    let dims = x.dims();
    let (n_in, n_out) = (dims[dims.len() - 1], w.dim(0)?);
    let rows = x.elem_count() / n_in.max(1);
    // A copy when `x` is strided, the matmul, the bias.
    budget::launch(budget::copy_of(x) + 1 + usize::from(b.is_some()));
    let y = x.reshape((rows, n_in))?.matmul(&w.t()?)?;
    let y = match b {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    let mut out_dims = dims.to_vec();
    *out_dims.last_mut().unwrap_or(&mut 0) = n_out;
    Ok(y.reshape(out_dims)?)
}

/// RMSNorm over the last dimension, computed in f32: `w * (x / sqrt(mean(x^2) + eps))`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    if fused::supported(x) {
        return fused::rms_norm(x, &w.to_dtype(x.dtype())?, eps);
    }
    #[cfg(feature = "cuda")]
    if super::cuda_ops::serves(x) && !w.track_op() {
        // The kernel; x's copy when strided, the weight's cast.
        budget::launch(1 + budget::copy_of(x) + budget::cast_of(w, x.dtype()));
        return super::cuda_ops::rms_norm(x, &w.to_dtype(x.dtype())?, eps);
    }
    rms_norm_composed(x, w, eps)
}

/// [`rms_norm`] from candle ops.
pub fn rms_norm_composed(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    // sqr, mean (a sum and a scale), + eps, sqrt, div, mul; and the casts to
    // the compute dtype and back.
    budget::launch(7 + 2 * budget::cast_of(x, compute_dtype(dtype)));
    let xf = x.to_dtype(compute_dtype(dtype))?;
    let var = xf.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = xf.broadcast_div(&(var + eps)?.sqrt()?)?;
    Ok(normed.to_dtype(dtype)?.broadcast_mul(w)?)
}

/// Rotary embedding, rotate-half form: for `x = [x1, x2]` along the last dim,
/// `[x1 cos - x2 sin, x2 cos + x1 sin]`. `x` is `(B, H, L, D)`, `cos`/`sin` are
/// `(B, 1, L, D/2)`.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    // Four products, a difference, a sum, and the concatenation's two copies.
    budget::launch(8);
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let a = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?;
    let b = (x2.broadcast_mul(cos)? + x1.broadcast_mul(sin)?)?;
    Ok(Tensor::cat(&[a, b], D::Minus1)?)
}

/// Per-head RMSNorm then rotary embedding, for q and k: `x` is `(B, L, H * D)`
/// (the projection's output), `w` is `(D)`, `cos`/`sin` are `(B, 1, L, D/2)`;
/// returns `(B, H, L, D)`.
pub fn norm_rope(
    x: &Tensor,
    n_heads: usize,
    w: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    if fused::supported(x) {
        return fused::norm_rope(x, n_heads, &w.to_dtype(x.dtype())?, (cos, sin), eps);
    }
    #[cfg(feature = "cuda")]
    if super::cuda_ops::serves(x) && !w.track_op() {
        // The kernel; x's copy when strided, the weight's and the tables' casts.
        let casts = budget::cast_of(w, x.dtype()) + budget::rotary_of(cos, x);
        budget::launch(1 + budget::copy_of(x) + casts);
        return super::cuda_ops::norm_rope(x, n_heads, w, cos, sin, eps);
    }
    let (b, l, hd) = x.dims3()?;
    budget::launch(budget::copy_of(x));
    let x = x.reshape((b, l, n_heads, hd / n_heads.max(1)))?;
    rope(&rms_norm_composed(&x, w, eps)?.transpose(1, 2)?, cos, sin)
}

/// SwiGLU's gating: `silu(gate) * up`.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if fused::supported(gate) {
        return fused::swiglu(gate, up);
    }
    #[cfg(feature = "cuda")]
    if super::cuda_ops::serves(gate) && super::cuda_ops::serves(up) {
        // The kernel; the inputs' copies when strided.
        budget::launch(1 + budget::copy_of(gate) + budget::copy_of(up));
        return super::cuda_ops::swiglu(gate, up);
    }
    budget::launch(2);
    Ok((gate.silu()? * up)?)
}

/// Additive causal bias `(1, 1, L, S)` for `L` queries at global positions
/// `offset..offset+L` over `S` keys: 0 where key `j <= offset + i`, else [`MASKED`].
///
/// On the CPU it is written directly; on other devices it is built there from
/// two position vectors, so only `L + S` numbers cross to the device instead
/// of `L x S` (one such mask per query block per layer per pass).
pub fn causal_bias(l: usize, s: usize, offset: usize, device: &Device) -> Result<Tensor> {
    if device.is_cpu() {
        let bias: Vec<f32> =
            (0..l).flat_map(|i| (0..s).map(move |j| if j <= offset + i { 0.0 } else { MASKED })).collect();
        return Ok(Tensor::from_vec(bias, (1, 1, l, s), device)?);
    }
    causal_bias_ops(l, s, offset, device)
}

/// [`causal_bias`] from tensor ops on `device` (what non-CPU devices run).
fn causal_bias_ops(l: usize, s: usize, offset: usize, device: &Device) -> Result<Tensor> {
    let query = Tensor::arange(offset as u32, (offset + l) as u32, device)?.reshape((l, 1))?;
    let key = Tensor::arange(0u32, s as u32, device)?.reshape((1, s))?;
    let seen = key.broadcast_le(&query)?;
    let open = Tensor::zeros((l, s), DType::F32, device)?;
    let shut = Tensor::full(MASKED, (l, s), device)?;
    Ok(seen.where_cond(&open, &shut)?.reshape((1, 1, l, s))?)
}

/// `t` `(B, H, S, D)` as a batched-matmul operand: itself when candle's
/// matmul reads its layout as it is (rows of `D` contiguous, each head's
/// rows adjacent, heads evenly spaced), as a narrowed KV cache is; otherwise
/// a contiguous copy. Saves copying the whole cache at every decode step.
fn matmul_operand(t: &Tensor) -> Result<Tensor> {
    let (dims, stride) = (t.dims(), t.stride());
    let readable = dims.len() == 4
        && stride[3] == 1
        && stride[2] == dims[3]
        && (stride[0] == stride[1] * dims[1] || dims[0] == 1 || dims[1] == 1);
    budget::launch(usize::from(!readable && !t.is_contiguous()));
    Ok(if readable { t.clone() } else { t.contiguous()? })
}

/// The attention mask of one forward pass: causal over global positions
/// (query `i` of the chunk sees keys `j <= offset + i`) plus an additive bias
/// per key (0 for a real token, [`MASKED`] for padding).
///
/// Short chunks and other devices get the dense `(B, 1, L, S)` bias and the
/// dense kernels; from [`AttnMask::BLOCKWISE_FROM`] queries on the CPU the
/// blockwise kernel ([`fused::attention_blockwise`]) needs only the per-key
/// bias, so no `L × S` tensor is built.
#[derive(Clone)]
pub struct AttnMask {
    offset: usize,
    /// `(B, 1, 1, S)` in the compute dtype.
    key_bias: Tensor,
    /// The dense `(B, 1, L, S)` bias; `None` when the blockwise kernel serves.
    dense: Option<Tensor>,
}

impl AttnMask {
    /// Queries per chunk from which CPU attention runs blockwise.
    pub const BLOCKWISE_FROM: usize = 512;

    /// The mask of `l` queries after `offset` cached keys, with `key_bias`
    /// `(B, 1, 1, S)` over all keys, for a model in `dtype` on `device`.
    pub fn new(l: usize, offset: usize, key_bias: &Tensor, dtype: DType, device: &Device) -> Result<Self> {
        // Blockwise on every device: the fused kernel on CPU f32/f64, the
        // recomputed query blocks of [`attention_blocks`] elsewhere.
        let _ = device;
        let blockwise = l >= Self::BLOCKWISE_FROM;
        Self::with_kernel(l, offset, key_bias, dtype, blockwise)
    }

    /// [`AttnMask::new`] with the kernel chosen by the caller (tests, A/B checks).
    pub fn with_kernel(
        l: usize,
        offset: usize,
        key_bias: &Tensor,
        dtype: DType,
        blockwise: bool,
    ) -> Result<Self> {
        let key_bias = key_bias.to_dtype(compute_dtype(dtype))?;
        let dense = if blockwise {
            None
        } else {
            let s = key_bias.dim(D::Minus1)?;
            Some(
                causal_bias(l, s, offset, key_bias.device())?
                    .to_dtype(key_bias.dtype())?
                    .broadcast_add(&key_bias)?,
            )
        };
        Ok(Self { offset, key_bias, dense })
    }

    /// True when the blockwise kernel serves this mask.
    pub fn blockwise(&self) -> bool {
        self.dense.is_none()
    }

    /// This mask as the fused kernels' [`fused::attention::attention_kept`] takes it.
    pub(super) fn kept(&self) -> fused::attention::KeptMask<'_> {
        match &self.dense {
            Some(m) => fused::attention::KeptMask::Dense(m),
            None => fused::attention::KeptMask::Blockwise { key_bias: &self.key_bias, offset: self.offset },
        }
    }
}

/// Grouped-query attention. `q` is `(B, Hq, L, D)`, `k`/`v` are `(B, Hkv, S, D)`.
/// Returns `(B, L, Hq * D)`.
///
/// Query head `h` reads key/value head `h / (Hq / Hkv)` (HF's `repeat_kv`); instead
/// of repeating k and v, the queries of one group are stacked along L.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &AttnMask, n_kv: usize) -> Result<Tensor> {
    let dense = match &mask.dense {
        None if fused::supported(q) => {
            return fused::attention_blockwise(q, k, v, &mask.key_bias, mask.offset, fused::attention::BLOCKS)
        }
        None => return attention_blocks(q, k, v, &mask.key_bias, mask.offset, n_kv, ATTN_ELEMS),
        Some(m) => m,
    };
    if fused::supported(q) {
        return fused::attention(q, k, v, dense);
    }
    attention_composed(q, k, v, dense, n_kv)
}

/// [`attention`] from candle ops.
pub fn attention_composed(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, n_kv: usize) -> Result<Tensor> {
    let (b, nq, l, d) = q.dims4()?;
    let s = k.dim(2)?;
    let g = nq / n_kv;
    let dtype = q.dtype();
    let cd = compute_dtype(dtype);
    // q's copy when strided; two matmuls, the scale and the mask's add (the
    // softmax counts its own); the casts of the scores, the mask and the
    // probabilities.
    budget::launch(budget::copy_of(q) + 4 + 2 * usize::from(cd != dtype) + budget::cast_of(mask, cd));
    let q = q.contiguous()?.reshape((b, n_kv, g * l, d))?;
    let k = matmul_operand(k)?;
    let v = matmul_operand(v)?;
    let scores = (q.matmul(&k.t()?)? * (1.0 / (d as f64).sqrt()))?.reshape((b, nq, l, s))?;
    let scores = scores.to_dtype(cd)?.broadcast_add(&mask.to_dtype(cd)?)?;
    let probs = softmax(&scores)?.to_dtype(dtype)?;
    let ctx = probs.reshape((b, n_kv, g * l, s))?.matmul(&v)?; // (B, Hkv, G*L, D)
    let ctx = ctx.reshape((b, nq, l, d))?.transpose(1, 2)?;
    budget::launch(budget::copy_of(&ctx));
    Ok(ctx.reshape((b, l, nq * d))?)
}

/// Attention scores per query block of [`attention_blocks`]: about 64 MB in f32.
pub const ATTN_ELEMS: usize = 16 << 20;

/// Query rows per block so that one block's scores `(B, Hq, rows, S)` hold
/// about `elems` elements.
fn block_rows(b: usize, nq: usize, s: usize, elems: usize) -> usize {
    (elems / (b * nq * s).max(1)).max(16)
}

/// One query block: queries `r0..r0+m` of `q` (global positions from
/// `offset + r0`) against the keys they may see, `0..offset+r0+m` (the later
/// ones are all causally masked, so skipping them changes nothing on real
/// positions). Returns `(B, m, Hq * D)`.
#[allow(clippy::too_many_arguments)]
fn attention_block(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    key_bias: &Tensor,
    offset: usize,
    n_kv: usize,
    (r0, m): (usize, usize),
) -> Result<Tensor> {
    block_of_queries(&q.narrow(2, r0, m)?, k, v, key_bias, offset, n_kv, r0)
}

/// [`attention_block`] given the block's queries `qb` `(B, Hq, m, D)`, those of
/// positions `r0..r0 + m`: the forward and the backward of [`attention_blocks`]
/// both run it (the backward on leaves of its own).
fn block_of_queries(
    qb: &Tensor,
    k: &Tensor,
    v: &Tensor,
    key_bias: &Tensor,
    offset: usize,
    n_kv: usize,
    r0: usize,
) -> Result<Tensor> {
    let m = qb.dim(2)?;
    let limit = (offset + r0 + m).min(k.dim(2)?);
    let mask = causal_bias(m, limit, offset + r0, qb.device())?
        .to_dtype(key_bias.dtype())?
        .broadcast_add(&key_bias.narrow(D::Minus1, 0, limit)?)?;
    attention_composed(qb, &k.narrow(2, 0, limit)?, &v.narrow(2, 0, limit)?, &mask, n_kv)
}

/// Attention in query blocks from candle ops, on any device and dtype, with
/// no `L x S` tensor: the forward runs each block without a graph, the
/// backward reruns it with one and backpropagates the block's share of the
/// upstream gradient (as [`super::head::token_stats_recomputed`] does for the
/// head). `key_bias` is `(B, 1, 1, S)` in the compute dtype; `elems` bounds
/// one block's scores. Same value as [`attention_composed`] with the dense
/// causal-plus-padding bias, on every query that sees a real key.
pub fn attention_blocks(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    key_bias: &Tensor,
    offset: usize,
    n_kv: usize,
    elems: usize,
) -> Result<Tensor> {
    let (b, nq, l, _) = q.dims4()?;
    let rows = block_rows(b, nq, k.dim(2)?, elems);
    let blocks: Vec<(usize, usize)> = (0..l).step_by(rows).map(|r0| (r0, rows.min(l - r0))).collect();
    let (qd, kd, vd) = (q.detach(), k.detach(), v.detach());
    let parts = blocks
        .iter()
        .map(|&blk| attention_block(&qd, &kd, &vd, key_bias, offset, n_kv, blk))
        .collect::<Result<Vec<_>>>()?;
    let y = Tensor::cat(&parts, 1)?;
    if !(q.track_op() || k.track_op() || v.track_op()) {
        return Ok(y);
    }
    let op = AttentionBlocks {
        key_bias: key_bias.clone(),
        offset,
        n_kv,
        blocks,
        held: super::precomputed::Held::new(y, "blockwise attention"),
    };
    Ok(q.apply_op3(k, v, op)?)
}

/// The op of [`attention_blocks`] over `(q, k, v)`.
struct AttentionBlocks {
    key_bias: Tensor,
    offset: usize,
    n_kv: usize,
    blocks: Vec<(usize, usize)>,
    held: super::precomputed::Held,
}

impl candle_core::CustomOp3 for AttentionBlocks {
    fn name(&self) -> &'static str {
        "blockwise-attention"
    }

    #[rustfmt::skip]
    fn cpu_fwd(&self, _: &candle_core::CpuStorage, _: &candle_core::Layout, _: &candle_core::CpuStorage, _: &candle_core::Layout, _: &candle_core::CpuStorage, _: &candle_core::Layout) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        self.held.cpu()
    }

    #[rustfmt::skip]
    fn cuda_fwd(&self, _: &candle_core::CudaStorage, _: &candle_core::Layout, _: &candle_core::CudaStorage, _: &candle_core::Layout, _: &candle_core::CudaStorage, _: &candle_core::Layout) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        self.held.cuda()
    }

    #[rustfmt::skip]
    fn metal_fwd(&self, _: &candle_core::MetalStorage, _: &candle_core::Layout, _: &candle_core::MetalStorage, _: &candle_core::Layout, _: &candle_core::MetalStorage, _: &candle_core::Layout) -> candle_core::Result<(candle_core::MetalStorage, candle_core::Shape)> {
        self.held.metal()
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _res: &Tensor,
        dres: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let err = |e: crate::Error| candle_core::Error::Msg(format!("blockwise attention: {e}"));
        let missing = || candle_core::Error::Msg("blockwise attention: a gradient is missing".into());
        let (kv, vv) = (Var::from_tensor(&k.detach())?, Var::from_tensor(&v.detach())?);
        let dq = Tensor::zeros(q.shape(), q.dtype(), q.device())?;
        let (mut dk, mut dv) = (k.zeros_like()?, v.zeros_like()?);
        for &(r0, m) in &self.blocks {
            // The block's queries as a leaf; keys and values as leaves shared
            // by every block, their gradients summed.
            let qb = Var::from_tensor(&q.narrow(2, r0, m)?.detach())?;
            let y = block_of_queries(
                qb.as_tensor(),
                kv.as_tensor(),
                vv.as_tensor(),
                &self.key_bias,
                self.offset,
                self.n_kv,
                r0,
            )
            .map_err(err)?;
            let g = (y * dres.narrow(1, r0, m)?)?.sum_all()?.backward()?;
            dq.slice_set(g.get(qb.as_tensor()).ok_or_else(missing)?, 2, r0)?;
            dk = (dk + g.get(kv.as_tensor()).ok_or_else(missing)?)?;
            dv = (dv + g.get(vv.as_tensor()).ok_or_else(missing)?)?;
        }
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// Softmax over the last dimension. The max is subtracted for stability but
/// detached: softmax is shift-invariant, and candle's `max` backward sends the
/// full gradient to every tied maximum, which would make gradients wrong on
/// rows with ties (e.g. identical padding keys).
pub fn softmax(x: &Tensor) -> Result<Tensor> {
    // max, sub, exp, sum, div.
    budget::launch(5);
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

/// Log-softmax over the last dimension, with the same detached max as [`softmax`].
pub fn log_softmax(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let diff = x.broadcast_sub(&max)?;
    let lse = diff.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok(diff.broadcast_sub(&lse)?)
}

/// Log-probabilities of `targets` and full-vocabulary entropies from logits
/// `(.., V)` in their compute dtype, from candle ops (the reference for
/// [`fused::logprob_entropy`]).
pub fn logprob_entropy_composed(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let logp_all = log_softmax(logits)?;
    // CUDA's gather wants both operands contiguous (targets are often a narrowed view).
    let ids = targets.unsqueeze(D::Minus1)?.contiguous()?;
    let logp = logp_all.contiguous()?.gather(&ids, D::Minus1)?.squeeze(D::Minus1)?;
    let entropy = (logp_all.exp()? * &logp_all)?.sum(D::Minus1)?.neg()?;
    Ok((logp, entropy))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fused::test_util::{check, randn, tol};

    /// Query blocks (`elems` 1 gives the minimum of 16 rows: 37 queries in
    /// blocks of 16, 16 and 5) against the
    /// dense composed attention, with GQA (4 query heads over 2), left
    /// padding on one row and 5 cached keys before the chunk, on values and
    /// the gradients of q, k and v; padded query rows are masked out.
    #[test]
    fn query_blocks_match_dense_attention() {
        let (b, nq, nkv, l, off, d) = (2, 4, 2, 37, 5, 8);
        let s = off + l;
        let pad = 9;
        for dtype in [DType::F64, DType::F32] {
            let bias: Vec<f32> = (0..b)
                .flat_map(|r| (0..s).map(move |j| if r == 1 && j < pad { MASKED } else { 0.0 }))
                .collect();
            let key_bias =
                Tensor::from_vec(bias, (b, 1, 1, s), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let keep: Vec<f64> = (0..b)
                .flat_map(|r| (0..l).map(move |i| if r == 1 && off + i < pad { 0.0 } else { 1.0 }))
                .collect();
            let keep = Tensor::from_vec(keep, (b, l, 1), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let q = randn(&[b, nq, l, d], dtype, 1);
            let k = randn(&[b, nkv, s, d], dtype, 2);
            let v = randn(&[b, nkv, s, d], dtype, 3);
            let dense = causal_bias(l, s, off, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let dense = dense.broadcast_add(&key_bias).unwrap();
            let qs = || q.as_tensor().affine(1.5, 0.0).unwrap();
            check(
                &[&q, &k, &v],
                &|| {
                    let y = attention_blocks(&qs(), k.as_tensor(), v.as_tensor(), &key_bias, off, nkv, 1)
                        .unwrap();
                    y.broadcast_mul(&keep).unwrap()
                },
                &|| {
                    let y = attention_composed(&qs(), k.as_tensor(), v.as_tensor(), &dense, nkv).unwrap();
                    y.broadcast_mul(&keep).unwrap()
                },
                tol(dtype),
                "query blocks",
            );
        }
    }

    /// The causal bias other devices build from position vectors equals the
    /// one written on the host, at offsets 0 and 7 and for a single query.
    #[test]
    fn causal_bias_from_ops_equals_the_host_one() {
        for (l, s, off) in [(5, 5, 0), (4, 11, 7), (1, 9, 8)] {
            let host = causal_bias(l, s, off, &Device::Cpu).unwrap();
            let ops = causal_bias_ops(l, s, off, &Device::Cpu).unwrap();
            assert_eq!(host.dims(), ops.dims());
            let (h, o) = (
                host.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                ops.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            assert_eq!(h, o, "l {l} s {s} offset {off}");
        }
    }

    /// Attention reads a narrowed KV cache `(B, Hkv, S, D)` out of a longer
    /// buffer in place: [`matmul_operand`] keeps the view (no copy) and the
    /// result equals attention over contiguous copies of the same keys.
    #[test]
    fn attention_reads_a_narrowed_cache_in_place() {
        let (b, nq, nkv, s_max, s, d) = (3, 4, 2, 16, 9, 8);
        let q = randn(&[b, nq, 1, d], DType::F64, 7);
        let ck = randn(&[b, nkv, s_max, d], DType::F64, 8);
        let cv = randn(&[b, nkv, s_max, d], DType::F64, 9);
        let (k, v) = (ck.narrow(2, 0, s).unwrap(), cv.narrow(2, 0, s).unwrap());
        assert!(!k.is_contiguous());
        let kept = matmul_operand(&k).unwrap();
        assert!(!kept.is_contiguous(), "the narrowed cache was copied");
        assert_eq!(kept.stride(), k.stride());
        // A transposed view (how v comes out of the projection) is copied.
        assert!(matmul_operand(&k.transpose(1, 2).unwrap().contiguous().unwrap().transpose(1, 2).unwrap())
            .unwrap()
            .is_contiguous());
        let mask = causal_bias(1, s, s - 1, &Device::Cpu).unwrap().to_dtype(DType::F64).unwrap();
        let got = attention_composed(q.as_tensor(), &k, &v, &mask, nkv).unwrap();
        let want =
            attention_composed(q.as_tensor(), &k.contiguous().unwrap(), &v.contiguous().unwrap(), &mask, nkv)
                .unwrap();
        let e = crate::model::fused::test_util::rel_err(&got, &want);
        assert!(e < 1e-12, "strided cache attention differs by {e:e}");
    }

    /// bf16 query blocks against the f64 dense attention on the same values.
    #[test]
    fn bf16_query_blocks_match_an_f64_reference() {
        let (b, nq, nkv, l, d) = (1, 4, 2, 40, 8);
        let q = randn(&[b, nq, l, d], DType::BF16, 4);
        let k = randn(&[b, nkv, l, d], DType::BF16, 5);
        let v = randn(&[b, nkv, l, d], DType::BF16, 6);
        let up = |t: &Var| t.as_tensor().to_dtype(DType::F64).unwrap();
        let kb = Tensor::zeros((b, 1, 1, l), DType::F32, &Device::Cpu).unwrap();
        let y = attention_blocks(q.as_tensor(), k.as_tensor(), v.as_tensor(), &kb, 0, nkv, 1).unwrap();
        let dense = causal_bias(l, l, 0, &Device::Cpu).unwrap().to_dtype(DType::F64).unwrap();
        let r = attention_composed(&up(&q), &up(&k), &up(&v), &dense, nkv).unwrap();
        let e = crate::model::fused::test_util::rel_err(&y, &r);
        assert!(e < 3e-2, "bf16 value error {e:e}");
        let g = y.sum_all().unwrap().backward().unwrap();
        assert_eq!(g.get(q.as_tensor()).unwrap().dtype(), DType::BF16);
    }
}
