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

use candle_core::{DType, Device, Tensor, D};

use super::fused;
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

/// `x @ w^T + b` over the last dimension; `x` is `(.., in)`, `w` is `(out, in)`.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    if fused::supported(x) {
        let y = fused::linear(x, w)?;
        return Ok(match b {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        });
    }
    let dims = x.dims();
    let (n_in, n_out) = (dims[dims.len() - 1], w.dim(0)?);
    let rows = x.elem_count() / n_in.max(1);
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
        return fused::rms_norm(x, w, eps);
    }
    rms_norm_composed(x, w, eps)
}

/// [`rms_norm`] from candle ops.
pub fn rms_norm_composed(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
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
        return fused::norm_rope(x, n_heads, w, (cos, sin), eps);
    }
    let (b, l, hd) = x.dims3()?;
    let x = x.reshape((b, l, n_heads, hd / n_heads.max(1)))?;
    rope(&rms_norm_composed(&x, w, eps)?.transpose(1, 2)?, cos, sin)
}

/// SwiGLU's gating: `silu(gate) * up`.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if fused::supported(gate) {
        return fused::swiglu(gate, up);
    }
    Ok((gate.silu()? * up)?)
}

/// Additive causal bias `(1, 1, L, S)` for `L` queries at global positions
/// `offset..offset+L` over `S` keys: 0 where key `j <= offset + i`, else [`MASKED`].
pub fn causal_bias(l: usize, s: usize, offset: usize, device: &Device) -> Result<Tensor> {
    let bias: Vec<f32> =
        (0..l).flat_map(|i| (0..s).map(move |j| if j <= offset + i { 0.0 } else { MASKED })).collect();
    Ok(Tensor::from_vec(bias, (1, 1, l, s), device)?)
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
        let blockwise = l >= Self::BLOCKWISE_FROM && fused::supported_on(device, dtype);
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
        None => {
            let (l, s) = (q.dim(2)?, mask.key_bias.dim(D::Minus1)?);
            &causal_bias(l, s, mask.offset, q.device())?
                .to_dtype(mask.key_bias.dtype())?
                .broadcast_add(&mask.key_bias)?
        }
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
    let q = q.contiguous()?.reshape((b, n_kv, g * l, d))?;
    let k = k.contiguous()?;
    let v = v.contiguous()?;
    let scores = (q.matmul(&k.t()?)? * (1.0 / (d as f64).sqrt()))?.reshape((b, nq, l, s))?;
    let scores =
        scores.to_dtype(compute_dtype(dtype))?.broadcast_add(&mask.to_dtype(compute_dtype(dtype))?)?;
    let probs = softmax(&scores)?.to_dtype(dtype)?;
    let ctx = probs.reshape((b, n_kv, g * l, s))?.matmul(&v)?; // (B, Hkv, G*L, D)
    Ok(ctx.reshape((b, nq, l, d))?.transpose(1, 2)?.reshape((b, l, nq * d))?)
}

/// Softmax over the last dimension. The max is subtracted for stability but
/// detached: softmax is shift-invariant, and candle's `max` backward sends the
/// full gradient to every tied maximum, which would make gradients wrong on
/// rows with ties (e.g. identical padding keys).
pub fn softmax(x: &Tensor) -> Result<Tensor> {
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
    let logp = logp_all.gather(&targets.unsqueeze(D::Minus1)?, D::Minus1)?.squeeze(D::Minus1)?;
    let entropy = (logp_all.exp()? * &logp_all)?.sum(D::Minus1)?.neg()?;
    Ok((logp, entropy))
}
