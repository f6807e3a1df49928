//! Fused grouped-query attention. The backward follows FlashAttention's (Dao et
//! al., 2022): probabilities are recomputed from q and k instead of being stored.
//!
//! Two kernels: [`attention`] takes a dense additive `(B, L, S)` mask and forms
//! one head's `L × S` scores at a time (short chunks, decoding with a cache);
//! [`attention_blockwise`] is causal with a bias per key and runs over blocks
//! of queries and keys with an online softmax, so no `L × S` tensor exists in
//! the forward or the backward and key blocks after a query block are skipped.

use std::sync::Mutex;

use candle_core::{bail, CpuStorage, DType, Layout, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::{
    mm, one, par_zeros, split_like, with_host, zero, Grads, Host, Input, Kernel, Op, Out, Real, SendPtr,
};
use crate::Result;

/// Grouped-query attention with an additive mask (see [`super::ops::attention`]).
/// Inputs q `(B, Hq, L, D)` contiguous; k, v `(B, Hkv, S, D)` with unit stride
/// over D (any other strides, e.g. a narrowed KV cache or a transposed view).
/// `mask` is `(B, L, S)` contiguous, in the inputs' dtype, a constant.
struct Attention {
    mask: Tensor,
    scale: f64,
}

/// Element offsets of a `(B, H, S, D)` view with unit stride over D.
#[derive(Clone, Copy)]
struct View4 {
    start: usize,
    sb: usize,
    sh: usize,
    ss: usize,
}

impl View4 {
    fn of(l: &Layout) -> candle_core::Result<Self> {
        let st = l.stride();
        if st.len() != 4 || (st[3] != 1 && l.dims()[3] > 1) {
            bail!("fused attention: k/v need 4 dims with unit stride over D, found strides {st:?}")
        }
        Ok(Self { start: l.start_offset(), sb: st[0], sh: st[1], ss: st[2] })
    }

    fn at(&self, b: usize, h: usize) -> usize {
        self.start + b * self.sb + h * self.sh
    }
}

/// q `(B, Hq, L, D)` contiguous and k, v `(B, Hkv, S, D)` with unit stride
/// over D: the inputs of one attention call, with their sizes (`g` query
/// heads per kv head).
#[derive(Clone, Copy)]
struct Qkv<'a, T> {
    q: &'a [T],
    /// The whole storages of k and v, read through `kv` and `vv`.
    k: &'a [T],
    v: &'a [T],
    kv: View4,
    vv: View4,
    b: usize,
    nq: usize,
    nkv: usize,
    g: usize,
    l: usize,
    s: usize,
    d: usize,
}

impl<'a, T: WithDType> Qkv<'a, T> {
    fn of([q, k, v]: [Input<'a>; 3]) -> candle_core::Result<Self> {
        let (b, nq, l, d) = q.layout.shape().dims4()?;
        let (kv, vv) = (View4::of(k.layout)?, View4::of(v.layout)?);
        let (nkv, s) = (k.layout.dims()[1], k.layout.dims()[2]);
        let (q, k, v) = (q.data()?, k.storage()?, v.storage()?);
        Ok(Self { q, k, v, kv, vv, b, nq, nkv, g: nq / nkv, l, s, d })
    }

    /// Elements of dk (and of dv) in a backward's `[dq | dk | dv]` buffer.
    fn kv_len(&self) -> usize {
        self.b * self.nkv * self.s * self.d
    }
}

/// Below this, `exp` is 0 in f32 (and under 1e-45 in f64): the masked scores (`MASKED`,
/// -1e9) land here, where libm's `expf` takes its slow underflow path.
const EXP_ZERO_BELOW: f64 = -104.0;

/// `x <- exp(x - m)` over a row; returns the row's sum after.
#[inline]
fn exp_sum<T: Real>(row: &mut [T], m: T) -> T {
    let floor = T::from_f64(EXP_ZERO_BELOW);
    let none = T::from_f64(f64::NEG_INFINITY);
    for x in row.iter_mut() {
        let z = *x - m;
        *x = if z < floor { none } else { z };
    }
    T::exp_in_place(row);
    row.iter().fold(zero::<T>(), |s, &x| s + x)
}

/// `sum_i a_i b_i`, in order.
#[inline]
fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    a.iter().zip(b).fold(zero::<T>(), |s, (&x, &y)| s + x * y)
}

/// The frame of both backward kernels over `(q, dctx)`: k and v held by the
/// op, and the flat `[dq | dk | dv]` buffer (dk and dv contiguous
/// `(B, Hkv, S, D)`) that `f` fills through the pointer it gets.
fn backward<T: Real>(
    ins: [Input<'_>; 2],
    (k, v): (&Tensor, &Tensor),
    what: &'static str,
    f: impl FnOnce(&Qkv<'_, T>, &[T], SendPtr<T>) -> candle_core::Result<()>,
) -> Out<T> {
    let (kh, vh) = (Host::of(k, what)?, Host::of(v, what)?);
    let io = Qkv::<T>::of([ins[0], kh.input(), vh.input()])?;
    let mut out = par_zeros::<T>(io.q.len() + 2 * io.kv_len());
    f(&io, ins[1].data::<T>()?, SendPtr(out.as_mut_ptr()))?;
    let len = out.len();
    Ok((out, Shape::from(len)))
}

/// Where one query head works in a backward: its rows from `i0` in q, dctx
/// and dq, and its kv head's k, v, dk and dv from key 0.
struct Head<T> {
    q: *const T,
    /// Offset of the first row in dctx (and in the forward's output).
    row0: usize,
    dctx: *const T,
    /// Row stride of dctx, `(B, L, Hq · D)`.
    dctx_rs: usize,
    dq: *mut T,
    /// Whether dq accumulates over key blocks (else a block overwrites it).
    dq_acc: bool,
    k: *const T,
    v: *const T,
    /// Row strides of k and v.
    k_ss: usize,
    v_ss: usize,
    dk: *mut T,
    dv: *mut T,
    d: usize,
}

impl<T: Real> Head<T> {
    /// Query head `hi` of batch row `bi` from query row `i0`, writing into
    /// `out = [dq | dk | dv]`.
    ///
    /// # Safety
    /// `out` holds `q.len() + 2 · kv_len` elements, `dctx` is q-sized, and
    /// `bi`, `hi`, `i0` are inside the shapes of `io`.
    unsafe fn at(
        io: &Qkv<'_, T>,
        dctx: &[T],
        out: *mut T,
        (bi, hi, i0): (usize, usize, usize),
        dq_acc: bool,
    ) -> Self {
        let (bh, hk, d) = (bi * io.nq + hi, hi / io.g, io.d);
        let bk = bi * io.nkv + hk;
        let row0 = (bi * io.l + i0) * io.nq * d + hi * d;
        let dk = out.add(io.q.len() + bk * io.s * d);
        Self {
            q: io.q.as_ptr().add((bh * io.l + i0) * d),
            row0,
            dctx: dctx.as_ptr().add(row0),
            dctx_rs: io.nq * d,
            dq: out.add((bh * io.l + i0) * d),
            dq_acc,
            k: io.k.as_ptr().add(io.kv.at(bi, hk)),
            v: io.v.as_ptr().add(io.vv.at(bi, hk)),
            k_ss: io.kv.ss,
            v_ss: io.vv.ss,
            dk,
            dv: dk.add(io.kv_len()),
            d,
        }
    }
}

/// The backward of one block of `rows` queries × `cols` keys from key `j0`,
/// given its probabilities `p`: `dv += pᵀ dctx`, `dp = dctx vᵀ`,
/// `ds = p ∘ (dp − D) · scale` (in `dp`), `dq (+)= ds k`, `dk += dsᵀ q`.
/// `di` holds `D_i = Σ_j p_ij dp_ij` per row, or is `None` when the block
/// spans every key of its rows and `D` is summed here from `p` and `dp`.
///
/// # Safety
/// `h` addresses `rows` query rows and keys `j0..j0 + cols`, and no other
/// task writes its dq rows or its dk, dv; `p` and `dp` hold `rows × cols`.
unsafe fn block_bwd<T: Real>(
    h: &Head<T>,
    j0: usize,
    (rows, cols): (usize, usize),
    p: &[T],
    dp: &mut [T],
    di: Option<&[T]>,
    scale: T,
) {
    let d = h.d;
    let (kb, vb) = (h.k.add(j0 * h.k_ss), h.v.add(j0 * h.v_ss));
    // dv += pᵀ dctx
    mm((cols, d, rows), h.dv.add(j0 * d), d, true, p.as_ptr(), (1, cols), h.dctx, (h.dctx_rs, 1), one());
    // dp = dctx vᵀ
    mm((rows, cols, d), dp.as_mut_ptr(), cols, false, h.dctx, (h.dctx_rs, 1), vb, (1, h.v_ss), one());
    // ds = p ∘ (dp − D) · scale, in dp.
    for (r, (pr, dr)) in p.chunks_exact(cols).zip(dp.chunks_exact_mut(cols)).enumerate() {
        let dd = match di {
            Some(di) => di[r],
            None => dot(pr, dr),
        };
        for (&pv, x) in pr.iter().zip(dr.iter_mut()) {
            *x = pv * (*x - dd) * scale;
        }
    }
    // dq (+)= ds k ; dk += dsᵀ q
    mm((rows, d, cols), h.dq, d, h.dq_acc, dp.as_ptr(), (cols, 1), kb, (h.k_ss, 1), one());
    mm((cols, d, rows), h.dk.add(j0 * d), d, true, dp.as_ptr(), (1, cols), h.q, (d, 1), one());
}

/// Scaled, masked scores of one query head then softmax in place: `p (L×S)`.
///
/// # Safety
/// `q` must address `L×D` contiguous elements, `k` an `S×D` matrix with row stride `ss`.
#[allow(clippy::too_many_arguments)]
unsafe fn probs<T: Real>(
    p: &mut [T],
    q: *const T,
    k: *const T,
    ss: usize,
    mask: &[T],
    (l, s, d): (usize, usize, usize),
    scale: T,
) {
    mm((l, s, d), p.as_mut_ptr(), s, false, q, (d, 1), k, (1, ss), scale);
    for (row, mrow) in p.chunks_exact_mut(s).zip(mask.chunks_exact(s)) {
        let mut mx = T::from_f64(f64::NEG_INFINITY);
        for (v, &m) in row.iter_mut().zip(mrow) {
            *v += m;
            mx = mx.fmax(*v);
        }
        let inv = one::<T>() / exp_sum(row, mx);
        row.iter_mut().for_each(|v| *v *= inv);
    }
}

/// Decoding steps (one query per head) in f32 with AVX-512: per (batch row,
/// kv head), its query heads' scores, softmax and weighted sum of values in
/// registers, instead of two small gemm calls per head whose set-up costs
/// more than the products.
#[cfg(target_arch = "x86_64")]
mod decode {
    use std::arch::x86_64::*;

    use candle_core::{DType, WithDType};
    use rayon::prelude::*;

    use super::{Qkv, SendPtr};

    /// Whether [`run`] serves a call of `l` queries of dimension `d` in `T`:
    /// head dimensions of 1, 2, 4 or 8 registers (16 to 128), held in registers.
    pub fn serves<T: WithDType>(l: usize, d: usize) -> bool {
        T::DTYPE == DType::F32 && l == 1 && matches!(d, 16 | 32 | 64 | 128) && super::super::avx512()
    }

    /// `out (B, 1, Hq·D)` from q, k, v and the dense mask `(B, 1, S)`.
    ///
    /// # Safety
    /// [`serves`] holds for the call (so `T` is f32); `out` addresses `B × Hq × D` elements.
    pub unsafe fn run<T: WithDType>(qkv: &Qkv<'_, T>, mask: &[T], scale: f32, out: *mut f32) {
        let f = |x: &[T]| std::slice::from_raw_parts(x.as_ptr() as *const f32, x.len());
        let (q, k, v, mask) = (f(qkv.q), f(qkv.k), f(qkv.v), f(mask));
        let Qkv { kv, vv, b, nq, nkv, g, s, d, .. } = *qkv;
        let o = SendPtr(out);
        (0..b * nkv).into_par_iter().for_each(|bk| {
            let (bi, hk) = (bk / nkv, bk % nkv);
            // Capture the whole SendPtr (edition 2021 closures would capture its field).
            #[allow(clippy::redundant_locals)]
            let o = o;
            let mut p = vec![0f32; s];
            for gi in 0..g {
                let h = hk * g + gi;
                // SAFETY: q/k/v offsets stay inside their storages (shapes and
                // strides come from their layouts); task (b, kv head) writes only
                // the D columns of its query heads in row b of `out`.
                unsafe {
                    let args = Head {
                        q: q.as_ptr().add((bi * nq + h) * d),
                        k: k.as_ptr().add(kv.at(bi, hk)),
                        ks: kv.ss,
                        v: v.as_ptr().add(vv.at(bi, hk)),
                        vs: vv.ss,
                        mask: &mask[bi * s..(bi + 1) * s],
                        scale,
                        dst: o.0.add((bi * nq + h) * d),
                    };
                    match d / 16 {
                        1 => head::<1>(&args, &mut p),
                        2 => head::<2>(&args, &mut p),
                        4 => head::<4>(&args, &mut p),
                        _ => head::<8>(&args, &mut p),
                    }
                }
            }
        });
    }

    /// One query head's inputs: its query `q (D)`, the keys and values of its
    /// kv head (row strides `ks`, `vs`), the additive mask over the keys, the
    /// score scale, and where its output row `dst (D)` goes.
    struct Head<'a> {
        q: *const f32,
        k: *const f32,
        ks: usize,
        v: *const f32,
        vs: usize,
        mask: &'a [f32],
        scale: f32,
        dst: *mut f32,
    }

    /// `dst = softmax(scale · K q + mask) V` for D = 16·C, over the mask's `S`
    /// keys, `p` the scratch of `S` probabilities.
    ///
    /// # Safety
    /// The CPU has AVX-512F; the pointers address the rows they are read or written at.
    #[target_feature(enable = "avx512f")]
    unsafe fn head<const C: usize>(h: &Head<'_>, p: &mut [f32]) {
        let Head { q, k, ks, v, vs, mask, scale, dst } = *h;
        let mut qv = [_mm512_setzero_ps(); C];
        for (c, r) in qv.iter_mut().enumerate() {
            *r = _mm512_loadu_ps(q.add(c * 16));
        }
        let mut mx = f32::NEG_INFINITY;
        for (j, (pj, &m)) in p.iter_mut().zip(mask).enumerate() {
            let kr = k.add(j * ks);
            let mut acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
            for (c, r) in qv.iter().enumerate().skip(1) {
                acc = _mm512_fmadd_ps(*r, _mm512_loadu_ps(kr.add(c * 16)), acc);
            }
            *pj = _mm512_reduce_add_ps(acc) * scale + m;
            mx = mx.max(*pj);
        }
        let mut sum = 0f32;
        for x in p.iter_mut() {
            *x = (*x - mx).exp();
            sum += *x;
        }
        let inv = 1.0 / sum;
        let mut acc = [_mm512_setzero_ps(); C];
        for (j, &pj) in p.iter().enumerate() {
            let w = _mm512_set1_ps(pj * inv);
            let vr = v.add(j * vs);
            for (c, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr.add(c * 16)), *a);
            }
        }
        for (c, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(dst.add(c * 16), *a);
        }
    }
}

impl Kernel<3> for Attention {
    const NAME: &'static str = "fused-attention";

    fn fwd<T: Real>(&self, ins: [Input<'_>; 3]) -> Out<T> {
        let qkv = Qkv::<T>::of(ins)?;
        let Qkv { q, k, v, kv, vv, b, nq, g, l, s, d, .. } = qkv;
        let scale = T::from_f64(self.scale);
        let mut out = par_zeros::<T>(b * l * nq * d);
        let optr = SendPtr(out.as_mut_ptr());
        #[cfg(target_arch = "x86_64")]
        if decode::serves::<T>(l, d) {
            // SAFETY: T is f32 and the CPU has AVX-512F (`serves`); `out` holds
            // b × nq × d elements.
            with_host::<T, _>(&self.mask, Self::NAME, |mask| unsafe {
                decode::run(&qkv, mask, self.scale as f32, optr.0 as *mut f32);
                Ok(())
            })?;
            return Ok((out, Shape::from((b, l, nq * d))));
        }
        with_host::<T, _>(&self.mask, Self::NAME, |mask| {
            (0..b * nq).into_par_iter().for_each(|bh| {
                let (bi, hi) = (bh / nq, bh % nq);
                let hk = hi / g;
                let mut p = vec![zero::<T>(); l * s];
                let o = optr;
                // SAFETY: q/k/v offsets stay inside their storages (shapes and
                // strides come from their layouts). Task (b, h) writes only the
                // D columns of head h in rows (b, 0..L) of `out`, disjoint from
                // every other task; `out` outlives the loop.
                unsafe {
                    probs(
                        &mut p,
                        q.as_ptr().add(bh * l * d),
                        k.as_ptr().add(kv.at(bi, hk)),
                        kv.ss,
                        &mask[bi * l * s..][..l * s],
                        (l, s, d),
                        scale,
                    );
                    let dst = o.0.add(bi * l * nq * d + hi * d);
                    mm(
                        (l, d, s),
                        dst,
                        nq * d,
                        false,
                        p.as_ptr(),
                        (s, 1),
                        v.as_ptr().add(vv.at(bi, hk)),
                        (vv.ss, 1),
                        T::from_f64(1.0),
                    );
                }
            });
            Ok(())
        })?;
        Ok((out, Shape::from((b, l, nq * d))))
    }

    fn bwd(&self, [q, k, v]: [&Tensor; 3], _ctx: &Tensor, dctx: &Tensor) -> Grads<3> {
        let op = AttentionBwd { mask: self.mask.clone(), scale: self.scale, k: k.clone(), v: v.clone() };
        split_like(&q.apply_op2_no_bwd(&dctx.contiguous()?, &Op(op))?, [q, k, v])
    }
}

/// Backward of [`Attention`] over `(q, dctx)`, with k, v and the mask held by
/// the op. Returns a flat buffer `[dq | dk | dv]`, dk and dv contiguous
/// `(B, Hkv, S, D)`. One task per (batch, kv head), looping over its query
/// heads, so dk/dv accumulate without races.
struct AttentionBwd {
    mask: Tensor,
    scale: f64,
    k: Tensor,
    v: Tensor,
}

impl Kernel<2> for AttentionBwd {
    const NAME: &'static str = "fused-attention-bwd";

    fn fwd<T: Real>(&self, ins: [Input<'_>; 2]) -> Out<T> {
        backward(ins, (&self.k, &self.v), Self::NAME, |io, dctx, optr| {
            let Qkv { b, nkv, g, l, s, d, kv, .. } = *io;
            let scale = T::from_f64(self.scale);
            let mask = Host::of(&self.mask, Self::NAME)?;
            let mask = mask.input().data::<T>()?;
            (0..b * nkv).into_par_iter().for_each(|bk| {
                let (bi, hk) = (bk / nkv, bk % nkv);
                let o = optr;
                let mut p = vec![zero::<T>(); l * s];
                let mut dp = vec![zero::<T>(); l * s];
                // SAFETY: reads stay inside q, dctx, k, v (shapes and strides
                // from their layouts). Task (b, hk) writes dq of its g query
                // heads and its own dk, dv blocks: disjoint from other tasks.
                unsafe {
                    for hi in hk * g..(hk + 1) * g {
                        let h = Head::at(io, dctx, o.0, (bi, hi, 0), false);
                        probs(&mut p, h.q, h.k, kv.ss, &mask[bi * l * s..][..l * s], (l, s, d), scale);
                        block_bwd(&h, 0, (l, s), &p, &mut dp, None, scale);
                    }
                }
            });
            Ok(())
        })
    }
}

/// Fused grouped-query attention (see [`crate::model::ops::attention`]): q `(B, Hq, L, D)`,
/// k/v `(B, Hkv, S, D)`, additive mask broadcastable to `(B, 1, L, S)`.
/// Returns `(B, L, Hq * D)`.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let op = dense_op(q, k, mask)?;
    Ok(q.contiguous()?.apply_op3(&unit_d(k)?, &unit_d(v)?, Op(op))?)
}

/// k or v as the kernels read them: unit stride over D (a copy otherwise).
fn unit_d(t: &Tensor) -> Result<Tensor> {
    Ok(if t.stride()[3] == 1 { t.clone() } else { t.contiguous()? })
}

/// The dense kernel for q `(B, Hq, L, D)` and k `(B, Hkv, S, D)` under `mask`.
fn dense_op(q: &Tensor, k: &Tensor, mask: &Tensor) -> Result<Attention> {
    let (b, _, l, d) = q.dims4()?;
    let s = k.dim(2)?;
    let mask =
        mask.broadcast_as((b, 1, l, s))?.to_dtype(q.dtype())?.contiguous()?.reshape((b, l, s))?.detach();
    Ok(Attention { mask, scale: 1.0 / (d as f64).sqrt() })
}

/// The mask of one [`attention_kept`] call: the dense bias `(B, 1, L, S)`
/// ([`attention`]) or the key bias and offset of [`attention_blockwise`].
pub enum KeptMask<'a> {
    /// The dense additive bias, broadcastable to `(B, 1, L, S)`.
    Dense(&'a Tensor),
    /// Causal blocks after `offset` cached keys, with a bias per key `(B, S)`.
    Blockwise {
        /// The additive bias of every key.
        key_bias: &'a Tensor,
        /// Keys before the first query.
        offset: usize,
    },
}

/// The kernel one [`attention_kept`] call ran, with what it left for the backward.
enum KeptOp {
    Dense(Op<Attention>),
    Blockwise(Op<Blockwise>),
}

/// Attention run without a graph by [`attention_kept`], holding what its
/// backward reads: the inputs, the output and the kernel (the blockwise one
/// keeps its log-sum-exps).
pub struct AttentionKept {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    op: KeptOp,
}

/// [`attention`] or [`attention_blockwise`] (by `mask`) without a graph: the
/// output `(B, L, Hq * D)` and what [`AttentionKept::backward`] needs, so a
/// hand-written backward takes the gradients of q, k and v without making
/// them variables (a copy each) or recording a graph. k and v may be strided
/// views with unit stride over D (v as the projection leaves it, transposed).
pub fn attention_kept(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: KeptMask<'_>,
) -> Result<(Tensor, AttentionKept)> {
    let (q, k, v) = (q.contiguous()?.detach(), unit_d(&k.detach())?, unit_d(&v.detach())?);
    let (o, op) = match mask {
        KeptMask::Dense(m) => {
            let op = Op(dense_op(&q, &k, m)?);
            (q.apply_op3_no_bwd(&k, &v, &op)?, KeptOp::Dense(op))
        }
        KeptMask::Blockwise { key_bias, offset } => {
            let op = Op(blockwise_op(&q, &k, key_bias, offset, BLOCKS)?);
            (q.apply_op3_no_bwd(&k, &v, &op)?, KeptOp::Blockwise(op))
        }
    };
    Ok((o.clone(), AttentionKept { q, k, v, o, op }))
}

impl AttentionKept {
    /// The gradients of q, k and v from the output's gradient `d_o`
    /// `(B, L, Hq * D)`: dq `(B, Hq, L, D)`, dk and dv `(B, Hkv, S, D)`, all
    /// contiguous.
    pub fn backward(self, d_o: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let ins = [&self.q, &self.k, &self.v];
        let [dq, dk, dv] = match &self.op {
            KeptOp::Dense(op) => op.0.bwd(ins, &self.o, d_o)?,
            KeptOp::Blockwise(op) => op.0.bwd(ins, &self.o, d_o)?,
        };
        let some =
            |t: Option<Tensor>| t.ok_or_else(|| crate::Error::invalid("attention: a gradient missing"));
        Ok((some(dq)?, some(dk)?, some(dv)?))
    }
}

/// `(B, H, L, D)` heads as rows `(B, L, H · D)` (the layout the projections
/// read), copied in parallel over the rows; `t` contiguous, f32 or f64.
pub fn heads_to_rows(t: &Tensor) -> Result<Tensor> {
    let (b, h, l, d) = t.dims4()?;
    let t = t.contiguous()?;
    let out = match t.dtype() {
        DType::F32 => Tensor::from_vec(
            with_host::<f32, _>(&t, "heads-to-rows", |s| Ok(merge(s, (b, h, l, d))))?,
            (b, l, h * d),
            t.device(),
        )?,
        DType::F64 => Tensor::from_vec(
            with_host::<f64, _>(&t, "heads-to-rows", |s| Ok(merge(s, (b, h, l, d))))?,
            (b, l, h * d),
            t.device(),
        )?,
        dt => return Err(crate::Error::invalid(format!("heads_to_rows: {dt:?} is not served"))),
    };
    Ok(out)
}

fn merge<T: Copy + Default + Send + Sync>(src: &[T], (b, h, l, d): (usize, usize, usize, usize)) -> Vec<T> {
    let mut out = vec![T::default(); b * l * h * d];
    out.par_chunks_mut(h * d).enumerate().for_each(|(row, dst)| {
        let (bi, li) = (row / l.max(1), row % l.max(1));
        for (hi, dst) in dst.chunks_exact_mut(d.max(1)).enumerate() {
            let at = ((bi * h + hi) * l + li) * d;
            dst.copy_from_slice(&src[at..at + d]);
        }
    });
    out
}

/// Default block sizes of [`attention_blockwise`]: query rows and keys per block.
/// A block's scores (`64 × 256` values) stay in L2; the products are big
/// enough for the gemm microkernels.
pub const BLOCKS: (usize, usize) = (64, 256);

/// Blockwise causal grouped-query attention with an online softmax
/// (FlashAttention, Dao et al., 2022; FlashAttention-2's loop order). Query
/// `i` of `L` sees keys `j <= offset + i`, each with the additive bias
/// `key_bias[b, j]`. The forward keeps only the output and each row's
/// log-sum-exp; the backward recomputes the probabilities block by block.
/// Key blocks wholly after a query block's last row are never visited.
struct Blockwise {
    /// `(B, S)` contiguous, in the inputs' dtype, a constant.
    key_bias: Tensor,
    offset: usize,
    scale: f64,
    blocks: (usize, usize),
    /// Log-sum-exp of every score row, `(B, Hq, L)`, left by the forward for the backward.
    lse: Mutex<Option<CpuStorage>>,
}

/// The shape of one blockwise problem.
#[derive(Clone, Copy)]
struct Dims {
    l: usize,
    s: usize,
    offset: usize,
    bq: usize,
    bk: usize,
}

impl Dims {
    /// Query rows `i0..i0 + rows` of block `qb`, and the number of keys the
    /// block's last row sees.
    fn qblock(&self, qb: usize) -> (usize, usize, usize) {
        let i0 = qb * self.bq;
        let rows = self.bq.min(self.l - i0);
        (i0, rows, self.s.min(self.offset + i0 + rows))
    }

    fn n_qblocks(&self) -> usize {
        self.l.div_ceil(self.bq)
    }
}

/// Scores of query rows `i0..i0 + rows` against keys `j0..j0 + cols` into
/// `sc` (`rows × cols`): `scale · q kᵀ + bias`, with `-∞` on keys after a
/// row's causal limit. Returns nothing; row maxima are left to the caller.
///
/// # Safety
/// `q` addresses `rows × D` contiguous elements, `k` a `cols × D` matrix with row stride `ss`.
#[allow(clippy::too_many_arguments)]
unsafe fn scores<T: Real>(
    sc: &mut [T],
    q: *const T,
    k: *const T,
    ss: usize,
    bias: &[T],
    (rows, cols, d): (usize, usize, usize),
    (i0, j0, offset): (usize, usize, usize),
    scale: T,
) {
    mm((rows, cols, d), sc.as_mut_ptr(), cols, false, q, (d, 1), k, (1, ss), scale);
    let ninf = T::from_f64(f64::NEG_INFINITY);
    for (r, row) in sc.chunks_exact_mut(cols).enumerate() {
        // Keys j0 + c with c < visible are at or before the row's causal limit.
        let visible = (offset + i0 + r + 1).saturating_sub(j0).min(cols);
        for (v, &bv) in row[..visible].iter_mut().zip(&bias[j0..j0 + visible]) {
            *v += bv;
        }
        row[visible..].iter_mut().for_each(|v| *v = ninf);
    }
}

impl Kernel<3> for Blockwise {
    const NAME: &'static str = "blockwise-attention";

    fn fwd<T: Real>(&self, ins: [Input<'_>; 3]) -> Out<T> {
        let Qkv { q, k, v, kv, vv, b, nq, g, l, s, d, .. } = Qkv::<T>::of(ins)?;
        let dm = Dims { l, s, offset: self.offset, bq: self.blocks.0, bk: self.blocks.1 };
        let scale = T::from_f64(self.scale);
        let mut out = par_zeros::<T>(b * l * nq * d);
        let mut lse = par_zeros::<T>(b * nq * l);
        let (optr, lptr) = (SendPtr(out.as_mut_ptr()), SendPtr(lse.as_mut_ptr()));
        let nqb = dm.n_qblocks();
        with_host::<T, _>(&self.key_bias, Self::NAME, |bias| {
            (0..b * nq * nqb).into_par_iter().for_each(|task| {
                let (bh, qb) = (task / nqb, task % nqb);
                let (bi, hi) = (bh / nq, bh % nq);
                let (i0, rows, kend) = dm.qblock(qb);
                let (o, lo) = (optr, lptr);
                let bias = &bias[bi * s..][..s];
                let ninf = T::from_f64(f64::NEG_INFINITY);
                let mut m = vec![ninf; rows];
                let mut sum = vec![zero::<T>(); rows];
                let mut acc = vec![zero::<T>(); rows * d];
                let mut sc = vec![zero::<T>(); rows * dm.bk];
                // SAFETY: q/k/v offsets stay inside their storages (shapes and
                // strides from their layouts; keys < kend <= S). Task (b, h, qb)
                // writes only rows i0..i0+rows of head h in `out` and `lse`,
                // disjoint from every other task; both outlive the loop.
                unsafe {
                    let qp = q.as_ptr().add((bh * l + i0) * d);
                    let kp = k.as_ptr().add(kv.at(bi, hi / g));
                    let vp = v.as_ptr().add(vv.at(bi, hi / g));
                    for j0 in (0..kend).step_by(dm.bk) {
                        let cols = dm.bk.min(kend - j0);
                        let sc = &mut sc[..rows * cols];
                        let (dims, pos) = ((rows, cols, d), (i0, j0, dm.offset));
                        scores(sc, qp, kp.add(j0 * kv.ss), kv.ss, bias, dims, pos, scale);
                        for (r, row) in sc.chunks_exact_mut(cols).enumerate() {
                            let mx = row.iter().fold(ninf, |a, &x| a.fmax(x));
                            if mx == ninf {
                                // No visible key in this block (row before j0).
                                row.iter_mut().for_each(|x| *x = zero());
                                continue;
                            }
                            let mnew = m[r].fmax(mx);
                            let alpha = (m[r] - mnew).exp();
                            sum[r] = sum[r] * alpha + exp_sum(row, mnew);
                            acc[r * d..][..d].iter_mut().for_each(|a| *a *= alpha);
                            m[r] = mnew;
                        }
                        // acc += p v
                        let vb = vp.add(j0 * vv.ss);
                        mm(
                            (rows, d, cols),
                            acc.as_mut_ptr(),
                            d,
                            true,
                            sc.as_ptr(),
                            (cols, 1),
                            vb,
                            (vv.ss, 1),
                            one(),
                        );
                    }
                    for r in 0..rows {
                        let inv = one::<T>() / sum[r];
                        let dst = o.0.add((bi * l + i0 + r) * nq * d + hi * d);
                        for (c, &a) in acc[r * d..][..d].iter().enumerate() {
                            *dst.add(c) = a * inv;
                        }
                        *lo.0.add(bh * l + i0 + r) = m[r] + sum[r].ln();
                    }
                }
            });
            Ok(())
        })?;
        *self.lse.lock().map_err(|e| candle_core::Error::Msg(format!("blockwise attention: {e}")))? =
            Some(T::to_cpu_storage_owned(lse));
        Ok((out, Shape::from((b, l, nq * d))))
    }

    fn bwd(&self, [q, k, v]: [&Tensor; 3], ctx: &Tensor, dctx: &Tensor) -> Grads<3> {
        let lse = self
            .lse
            .lock()
            .map_err(|e| candle_core::Error::Msg(format!("blockwise attention: {e}")))?
            .clone()
            .ok_or_else(|| candle_core::Error::Msg("blockwise attention: backward before forward".into()))?;
        let op = BlockwiseBwd {
            key_bias: self.key_bias.clone(),
            offset: self.offset,
            scale: self.scale,
            blocks: self.blocks,
            k: k.clone(),
            v: v.clone(),
            ctx: ctx.contiguous()?,
            lse,
        };
        split_like(&q.apply_op2_no_bwd(&dctx.contiguous()?, &Op(op))?, [q, k, v])
    }
}

/// Backward of [`Blockwise`] over `(q, dctx)`, with k, v, the output, the
/// log-sum-exps and the key bias held by the op. Returns a flat buffer
/// `[dq | dk | dv]`, dk and dv contiguous `(B, Hkv, S, D)`. One task per
/// (batch, kv head), looping over its query heads and blocks, so dk and dv
/// accumulate without races.
struct BlockwiseBwd {
    key_bias: Tensor,
    offset: usize,
    scale: f64,
    blocks: (usize, usize),
    k: Tensor,
    v: Tensor,
    /// The forward's output `(B, L, Hq · D)`, contiguous.
    ctx: Tensor,
    lse: CpuStorage,
}

impl Kernel<2> for BlockwiseBwd {
    const NAME: &'static str = "blockwise-attention-bwd";

    fn fwd<T: Real>(&self, ins: [Input<'_>; 2]) -> Out<T> {
        backward(ins, (&self.k, &self.v), Self::NAME, |io, dctx, optr| {
            let Qkv { b, nq, nkv, g, l, s, d, kv, .. } = *io;
            let dm = Dims { l, s, offset: self.offset, bq: self.blocks.0, bk: self.blocks.1 };
            let lse = self.lse.as_slice::<T>()?;
            let scale = T::from_f64(self.scale);
            let (ctx, bias) = (Host::of(&self.ctx, Self::NAME)?, Host::of(&self.key_bias, Self::NAME)?);
            let (ctx, bias) = (ctx.input().data::<T>()?, bias.input().data::<T>()?);
            (0..b * nkv).into_par_iter().for_each(|bk| {
                let (bi, hk) = (bk / nkv, bk % nkv);
                let o = optr;
                let bias = &bias[bi * s..][..s];
                let mut p = vec![zero::<T>(); dm.bq * dm.bk];
                let mut dp = vec![zero::<T>(); dm.bq * dm.bk];
                let mut di = vec![zero::<T>(); dm.bq];
                // SAFETY: reads stay inside q, dctx, ctx, k, v (shapes and
                // strides from their layouts; keys < kend <= S). Task (b, hk)
                // writes dq of its g query heads and its own dk, dv blocks:
                // disjoint from other tasks; `out` outlives the loop.
                unsafe {
                    for hi in hk * g..(hk + 1) * g {
                        let bh = bi * nq + hi;
                        for qb in 0..dm.n_qblocks() {
                            let (i0, rows, kend) = dm.qblock(qb);
                            let h = Head::at(io, dctx, o.0, (bi, hi, i0), true);
                            let lse = &lse[bh * l + i0..][..rows];
                            // D_i = dctx_i · ctx_i = Σ_j p_ij dp_ij.
                            for (r, x) in di[..rows].iter_mut().enumerate() {
                                let at = h.row0 + r * h.dctx_rs;
                                *x = dot(&dctx[at..][..d], &ctx[at..][..d]);
                            }
                            for j0 in (0..kend).step_by(dm.bk) {
                                let cols = dm.bk.min(kend - j0);
                                let (p, dp) = (&mut p[..rows * cols], &mut dp[..rows * cols]);
                                let (dims, pos) = ((rows, cols, d), (i0, j0, dm.offset));
                                scores(p, h.q, h.k.add(j0 * kv.ss), kv.ss, bias, dims, pos, scale);
                                for (row, &ls) in p.chunks_exact_mut(cols).zip(lse) {
                                    row.iter_mut().for_each(|x| *x = (*x - ls).exp());
                                }
                                block_bwd(&h, j0, (rows, cols), p, dp, Some(&di[..rows]), scale);
                            }
                        }
                    }
                }
            });
            Ok(())
        })
    }
}

/// Blockwise causal grouped-query attention (see `Blockwise`): q `(B, Hq, L, D)`,
/// k/v `(B, Hkv, S, D)`, `key_bias` an additive bias per key broadcastable to
/// `(B, S)`; query `i` sees keys `j <= offset + i`. Returns `(B, L, Hq * D)`.
/// A query whose visible keys are all masked by the bias gets an average of
/// their values (the dense path averages over every key): finite garbage that
/// no real position reads.
pub fn attention_blockwise(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    key_bias: &Tensor,
    offset: usize,
    blocks: (usize, usize),
) -> Result<Tensor> {
    let (_, nq, l, _) = q.dims4()?;
    let (nkv, s) = (k.dim(1)?, k.dim(2)?);
    if nkv == 0 || nq % nkv != 0 || offset + l > s || blocks.0 == 0 || blocks.1 == 0 {
        return Err(crate::Error::invalid(format!(
            "blockwise attention: q {:?}, k {:?}, offset {offset}, blocks {blocks:?} do not fit",
            q.dims(),
            k.dims()
        )));
    }
    let op = blockwise_op(q, k, key_bias, offset, blocks)?;
    Ok(q.contiguous()?.apply_op3(&unit_d(k)?, &unit_d(v)?, Op(op))?)
}

/// The blockwise kernel for q `(B, Hq, L, D)` and k `(B, Hkv, S, D)`.
fn blockwise_op(
    q: &Tensor,
    k: &Tensor,
    key_bias: &Tensor,
    offset: usize,
    blocks: (usize, usize),
) -> Result<Blockwise> {
    let (b, _, _, d) = q.dims4()?;
    let s = k.dim(2)?;
    let key_bias =
        key_bias.reshape(((), s))?.broadcast_as((b, s))?.to_dtype(q.dtype())?.contiguous()?.detach();
    Ok(Blockwise { key_bias, offset, scale: 1.0 / (d as f64).sqrt(), blocks, lse: Mutex::new(None) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fused::test_util::*;
    use crate::model::ops;
    use candle_core::{DType, Device, Var};

    #[test]
    fn attention_matches_composed() {
        // (l, s, offset, d): whole chunks, a chunk after cached keys, and
        // decoding steps (one query over the cache; in f32 with D of 16 to 128
        // the AVX-512 decoding kernel where the CPU has it).
        let cases = [
            (5, 5, 0, 8),
            (5, 7, 2, 8),
            (1, 1, 0, 20),
            (1, 37, 36, 20),
            (1, 9, 8, 64),
            (1, 5, 4, 16),
            (1, 40, 39, 128),
        ];
        for dtype in [DType::F64, DType::F32] {
            for (l, s, offset, d) in cases {
                let (b, nq, nkv) = (2, 4, 2);
                let q = randn(&[b, nq, l, d], dtype, 6);
                let k = randn(&[b, nkv, s, d], dtype, 7);
                let v = randn(&[b, s, nkv, d], dtype, 8); // transposed view below
                let v_bhsd = |v: &Var| -> Tensor { v.as_tensor().transpose(1, 2).unwrap() };
                // Causal plus left padding of 2 keys in row 1 (a fully masked query too).
                let pad: Vec<f32> =
                    (0..b * s).map(|i| if i / s == 1 && i % s < 2 { ops::MASKED } else { 0.0 }).collect();
                let pad = Tensor::from_vec(pad, (b, 1, 1, s), &Device::Cpu).unwrap();
                let mask = ops::causal_bias(l, s, offset, &Device::Cpu)
                    .unwrap()
                    .broadcast_add(&pad)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                check(
                    &[&q, &k, &v],
                    &|| attention(q.as_tensor(), k.as_tensor(), &v_bhsd(&v), &mask).unwrap(),
                    &|| {
                        ops::attention_composed(q.as_tensor(), k.as_tensor(), &v_bhsd(&v), &mask, nkv)
                            .unwrap()
                    },
                    tol(dtype),
                    "attention",
                );
            }
        }
    }

    /// Causal mask with keys 0..2 of batch row 1 padded: the dense `(B, 1, L, S)`
    /// bias, the per-key bias `(B, 1, 1, S)`, and `(B, L, 1)` with 0 on the
    /// queries that see only padding (their output is garbage on both paths).
    fn padded_masks(b: usize, l: usize, s: usize, offset: usize, dtype: DType) -> (Tensor, Tensor, Tensor) {
        let pad: Vec<f32> =
            (0..b * s).map(|i| if i / s == 1 && i % s < 2 { ops::MASKED } else { 0.0 }).collect();
        let pad = Tensor::from_vec(pad, (b, 1, 1, s), &Device::Cpu).unwrap();
        let dense = ops::causal_bias(l, s, offset, &Device::Cpu).unwrap().broadcast_add(&pad).unwrap();
        let keep: Vec<f64> =
            (0..b * l).map(|i| if i / l == 1 && offset + i % l < 2 { 0.0 } else { 1.0 }).collect();
        let keep = Tensor::from_vec(keep, (b, l, 1), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
        (dense.to_dtype(dtype).unwrap(), pad.to_dtype(dtype).unwrap(), keep)
    }

    #[test]
    fn blockwise_matches_composed() {
        for dtype in [DType::F64, DType::F32] {
            let (b, nq, nkv, d) = (2, 4, 2, 8);
            // Lengths that are and are not multiples of the blocks, cached keys
            // before the chunk, blocks of one row / one key, a single block.
            for (l, offset, blocks) in [
                (5, 0, (2, 3)),
                (13, 0, (4, 4)),
                (13, 3, (5, 2)),
                (16, 0, (16, 16)),
                (9, 4, (1, 1)),
                (7, 2, BLOCKS),
            ] {
                let s = offset + l;
                let q = randn(&[b, nq, l, d], dtype, 6);
                // k narrowed from a longer cache; v a transposed view.
                let kc = randn(&[b, nkv, s + 3, d], dtype, 7);
                let v = randn(&[b, s, nkv, d], dtype, 8);
                let k = || kc.as_tensor().narrow(2, 0, s).unwrap();
                let vt = || v.as_tensor().transpose(1, 2).unwrap();
                let (dense, key_bias, keep) = padded_masks(b, l, s, offset, dtype);
                let what = format!("blockwise attention {dtype:?} l={l} offset={offset} blocks={blocks:?}");
                check(
                    &[&q, &kc, &v],
                    &|| {
                        let y = attention_blockwise(q.as_tensor(), &k(), &vt(), &key_bias, offset, blocks)
                            .unwrap();
                        y.broadcast_mul(&keep).unwrap()
                    },
                    &|| {
                        let y = ops::attention_composed(q.as_tensor(), &k(), &vt(), &dense, nkv).unwrap();
                        y.broadcast_mul(&keep).unwrap()
                    },
                    tol(dtype),
                    &what,
                );
                // Queries that see only padding still get finite values.
                let y = attention_blockwise(q.as_tensor(), &k(), &vt(), &key_bias, offset, blocks).unwrap();
                let y = y.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
                assert!(y.iter().all(|x| x.is_finite()), "{what}: non-finite output");
            }
        }
    }

    #[test]
    fn blockwise_matches_dense_kernel_at_length() {
        // Longer rows, one kv head per query head (no grouping), f32, default blocks.
        let (b, nq, nkv, l, d) = (2, 2, 2, 300, 16);
        let q = randn(&[b, nq, l, d], DType::F32, 11);
        let k = randn(&[b, nkv, l, d], DType::F32, 12);
        let v = randn(&[b, nkv, l, d], DType::F32, 13);
        let (dense, key_bias, keep) = padded_masks(b, l, l, 0, DType::F32);
        check(
            &[&q, &k, &v],
            &|| {
                attention_blockwise(q.as_tensor(), k.as_tensor(), v.as_tensor(), &key_bias, 0, BLOCKS)
                    .unwrap()
                    .broadcast_mul(&keep)
                    .unwrap()
            },
            &|| {
                attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), &dense)
                    .unwrap()
                    .broadcast_mul(&keep)
                    .unwrap()
            },
            1e-5,
            "blockwise vs dense kernel",
        );
    }

    #[test]
    fn blockwise_rejects_shapes_that_do_not_fit() {
        let q = randn(&[1, 3, 4, 8], DType::F32, 1);
        let k = randn(&[1, 2, 4, 8], DType::F32, 2);
        let bias = Tensor::zeros((1, 1, 1, 4), DType::F32, &Device::Cpu).unwrap();
        let e =
            attention_blockwise(q.as_tensor(), k.as_tensor(), k.as_tensor(), &bias, 0, BLOCKS).unwrap_err();
        assert!(e.to_string().contains("do not fit"), "{e}");
    }
}
