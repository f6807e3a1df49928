//! Fused `y = x w^T` (the projections) with its backward; `w` may be bf16
//! under f32 `x` (bf16 weights, f32 activations: see [`super::simd`]).

use candle_core::{bail, CpuStorage, DType, Shape, Tensor, WithDType};
use half::bf16;
use rayon::prelude::*;

use super::{
    all_threads, data, gemv, mm_bf16, mm_par, par_copy, par_zeros, simd, split_like, zero, Grads, Input,
    Kernel, Op, Out, Real,
};
use crate::Result;

/// `y = x w^T` for contiguous `x (.., in)` and `w (out, in)`: one gemm call
/// forward and two backward, with `dw` produced directly in `w`'s layout
/// (candle's `x.matmul(&w.t())` adds a transpose node and a strided
/// accumulation of the weight gradient).
struct Linear;

impl Kernel<2> for Linear {
    const NAME: &'static str = "fused-linear";

    fn fwd<T: Real>(&self, ins: [Input<'_>; 2]) -> Out<T> {
        let (o, k) = ins[1].layout.shape().dims2()?;
        let dims = ins[0].layout.dims();
        if dims.last() != Some(&k) {
            bail!("fused linear: x of shape {dims:?} does not end in the {k} features w expects")
        }
        let n = ins[0].layout.shape().elem_count() / k.max(1);
        let mut out_dims = dims.to_vec();
        *out_dims.last_mut().expect("checked above") = o;
        // A decoding step (one position per sequence, or rows without a
        // sequence axis) of a few rows streams the weights once. Multi-token
        // inputs (training, prefill) always take gemm, so that a sequence's
        // values do not depend on how many sequences share its batch.
        let one_position = dims.len() < 3 || dims[dims.len() - 2] == 1;
        if let CpuStorage::BF16(_) = ins[1].storage {
            let y = bf16_weights(ins, (n, o, k), one_position && n <= gemv::MAX_ROWS_BF16)?;
            return Ok((T::cpu_storage_data(f32::to_cpu_storage_owned(y))?, Shape::from(out_dims)));
        }
        let [x, w] = data::<T, 2>(&ins)?;
        if one_position && n <= gemv::MAX_ROWS {
            let mut y = vec![zero::<T>(); n * o];
            gemv::gemv(x, w, &mut y, n, o, k);
            return Ok((y, Shape::from(out_dims)));
        }
        Ok((x_wt(x, w, (n, o, k)), Shape::from(out_dims)))
    }

    fn bwd(&self, [x, w]: [&Tensor; 2], _y: &Tensor, dy: &Tensor) -> Grads<2> {
        if w.dtype() != x.dtype() {
            let path = simd::cpu_path();
            let [dx, dw] = if path.bf16_dot() && w.dtype() == DType::BF16 && x.dtype() == DType::F32 {
                // bf16 weights under f32 activations on the CPU's bf16 dot
                // products ([`LinearBwdBf16`]).
                let flat = x.apply_op3_no_bwd(w, &dy.contiguous()?, &Op(LinearBwdBf16(path)))?;
                split_like(&flat, [x, w])?
            } else {
                // Elsewhere: the backward in f32 on the widened weights.
                let wx = w.to_dtype(x.dtype())?;
                let flat = x.apply_op3_no_bwd(&wx, &dy.contiguous()?, &Op(LinearBwd))?;
                split_like(&flat, [x, &wx])?
            };
            // Either way the weight gradient is rounded to the weight's dtype.
            return Ok([dx, dw.map(|d| d.to_dtype(w.dtype())).transpose()?]);
        }
        split_like(&x.apply_op3_no_bwd(w, &dy.contiguous()?, &Op(LinearBwd))?, [x, w])
    }
}

/// `y = x w^T` for f32 `x` (n×k) and bf16 `w` (o×k), accumulated in f32: the
/// decoding kernel of [`simd`] reads the bf16 weights directly (`decode`);
/// larger products take the CPU's bf16 dot products ([`mm_bf16`], `x` rounded
/// to bf16) where it has them, else widen `w` once and take f32 gemm.
fn bf16_weights(ins: [Input<'_>; 2], (n, o, k): (usize, usize, usize), decode: bool) -> Result32 {
    let x = ins[0].data::<f32>()?;
    let w = ins[1].data::<bf16>()?;
    if decode {
        let mut y = vec![0f32; n * o];
        simd::gemv_w(x, w, &mut y, n, o, k);
        return Ok(y);
    }
    let path = simd::cpu_path();
    if path.bf16_dot() {
        return Ok(mm_bf16::xwt(path, x, w, (n, o, k)));
    }
    Ok(x_wt(x, &simd::widen(w), (n, o, k)))
}

/// `x w^T` for `x` (n×k) and `w` (o×k), one gemm over all threads: the product
/// of every projection too large for the decoding gemv.
pub(crate) fn x_wt<T: Real>(x: &[T], w: &[T], (n, o, k): (usize, usize, usize)) -> Vec<T> {
    let mut y = par_zeros::<T>(n * o);
    x_wt_into(x, w, &mut y, (n, o, k), false);
    y
}

/// [`x_wt`] into `y` (n×o), added to what `y` holds when `accumulate`.
fn x_wt_into<T: Real>(x: &[T], w: &[T], y: &mut [T], (n, o, k): (usize, usize, usize), accumulate: bool) {
    assert!(
        x.len() == n * k && w.len() == o * k && y.len() == n * o,
        "x_wt: operands do not match ({n}, {o}, {k})"
    );
    // SAFETY: x is n×k, w is o×k, y is n×o (checked above), all contiguous; y is an exclusive borrow.
    unsafe {
        mm_par(
            (n, o, k),
            y.as_mut_ptr(),
            o,
            accumulate,
            x.as_ptr(),
            (k, 1),
            w.as_ptr(),
            (1, k),
            T::from_f64(1.0),
            all_threads(),
        );
    }
}

/// What [`bf16_weights`] returns.
type Result32 = candle_core::Result<Vec<f32>>;

/// Backward of [`Linear`] over `(x, w, dy)`: `[dx = dy w | dw = dy^T x]`.
struct LinearBwd;

impl Kernel<3> for LinearBwd {
    const NAME: &'static str = "fused-linear-bwd";

    fn fwd<T: Real>(&self, ins: [Input<'_>; 3]) -> Out<T> {
        let (o, k) = ins[1].layout.shape().dims2()?;
        let n = ins[0].layout.shape().elem_count() / k.max(1);
        let [x, w, dy] = data::<T, 3>(&ins)?;
        if x.len() != n * k || w.len() != o * k || dy.len() != n * o {
            bail!(
                "fused linear backward: x ({}), w ({}) and dy ({}) do not match ({n}, {o}, {k})",
                x.len(),
                w.len(),
                dy.len()
            )
        }
        let mut out = par_zeros::<T>(n * k + o * k);
        let (dx, dw) = out.split_at_mut(n * k);
        bwd_into((x, w, dy), (dx, false), dw, (n, o, k));
        let len = out.len();
        Ok((out, Shape::from(len)))
    }
}

/// The two products of `y = x w^T`'s backward over all threads, for `x`
/// (n×k), `w` (o×k), `dy` (n×o), all contiguous: `dw = dy^T x` into `dw`
/// (o×k), and `dy w` into `dx` (n×k), added to what `dx` holds when
/// `accumulate`.
fn bwd_into<T: Real>(
    (x, w, dy): (&[T], &[T], &[T]),
    (dx, accumulate): (&mut [T], bool),
    dw: &mut [T],
    (n, o, k): (usize, usize, usize),
) {
    assert!(
        x.len() == n * k && w.len() == o * k && dy.len() == n * o && dx.len() == n * k && dw.len() == o * k,
        "linear backward: operands do not match ({n}, {o}, {k})"
    );
    let one = T::from_f64(1.0);
    // SAFETY: every operand's length was checked above against its
    // contiguous layout; dx and dw are exclusive borrows.
    unsafe {
        mm_par(
            (n, k, o),
            dx.as_mut_ptr(),
            k,
            accumulate,
            dy.as_ptr(),
            (o, 1),
            w.as_ptr(),
            (k, 1),
            one,
            all_threads(),
        );
        mm_par(
            (o, k, n),
            dw.as_mut_ptr(),
            k,
            false,
            dy.as_ptr(),
            (1, o),
            x.as_ptr(),
            (k, 1),
            one,
            all_threads(),
        );
    }
}

/// Backward of [`Linear`] for f32 `x` (n×k) and bf16 `w` (o×k) on a bf16
/// dot-product path ([`mm_bf16::xwt`]): `[dx = dy w | dw = dy^T x]` in f32,
/// as [`bwd_bf16`] composes it.
struct LinearBwdBf16(simd::Path);

impl Kernel<3> for LinearBwdBf16 {
    const NAME: &'static str = "fused-linear-bwd-bf16";

    fn fwd<T: Real>(&self, ins: [Input<'_>; 3]) -> Out<T> {
        let (o, k) = ins[1].layout.shape().dims2()?;
        let (x, w, dy) = (ins[0].data::<f32>()?, ins[1].data::<bf16>()?, ins[2].data::<f32>()?);
        let n = x.len().checked_div(k).unwrap_or(dy.len() / o.max(1));
        if x.len() != n * k || dy.len() != n * o {
            bail!("fused linear backward: x ({}) and dy ({}) do not match ({n}, {o}, {k})", x.len(), dy.len())
        }
        let path = self.0;
        let (mut out, dw) = bwd_bf16(&|a, b, s| mm_bf16::xwt(path, a, b, s), x, w, dy, (n, o, k), DW_ROWS);
        out.extend_from_slice(&dw);
        let len = out.len();
        Ok((T::cpu_storage_data(f32::to_cpu_storage_owned(out))?, Shape::from(len)))
    }
}

/// Rows of `x` and `dy` (the depth of `dw = dy^T x`) per product in
/// [`bwd_bf16`]: the transposed operands of one product take
/// `DW_ROWS · (4 o + 2 k)` bytes (and about half as much again packed inside
/// the product): 4096 · (4 · 9728 + 2 · 2560) B = 180 MB for Qwen3-4B's MLP
/// (o = 9728, k = 2560), instead of 720 MB for 16K rows at once.
const DW_ROWS: usize = 4096;

/// The backward of `y = x w^T` with bf16 `w`, `[dx (n×k), dw (o×k)]` in
/// f32, composed of two bf16 products `product(a, b, (m, p, q)) = a (m×q) ·
/// b (p×q)^T` (for the model, [`mm_bf16::xwt`]: `a` rounded to bf16, f32
/// accumulation):
/// - `dx = dy · w = product(dy, w^T, (n, k, o))`, `w^T` (k×o) a bf16
///   transpose of the weights (no f32 copy of them);
/// - `dw = dy^T · x`, over blocks `b` of `rows` rows of `x` and `dy` (the
///   last one shorter), the sum in f32 of `product(dy_b^T, x_b^T, (o, k,
///   rows))`, with `dy_b^T` (o×rows) transposed in f32 and `x_b^T` (k×rows)
///   in bf16 (the value the product would round an f32 `x^T` to: round to
///   nearest even either way, at half the memory).
///
/// As PyTorch's autocast: its `linear` casts `x` and `w` to bf16, so its
/// backward multiplies bf16 `dy` (the gradient of a bf16 output) by bf16 `w`
/// and bf16 `x`, accumulating in f32 (oneDNN, cuBLAS) and rounding both
/// gradients to bf16. Here the inputs round the same way, `dy` (the product's
/// `a`) and `x` to bf16, but `dx` stays f32 and only `dw` is rounded to the
/// weight's dtype, by the caller.
///
/// Error bound, relative to `Σ|a_c b_c|` per output, `u = 2^-8` (bf16's
/// unit roundoff, half an ulp): `dx` rounds one factor (`w` is bf16
/// already), so `|dx - dy w| <= (u + o 2^-23) Σ|dy w|`, [`mm_bf16::tolerance`]`(o,
/// true)`; `dw` rounds both factors, `(1 + e_1)(1 + e_2) - 1 <= 2u + u²`, so
/// `|dw - dy^T x| <= (2u + u² + n 2^-23) Σ|dy x|` (the tests' `dw_tolerance`), and
/// within `tolerance(n, true)` of the product of `dy` with bf16-rounded `x`.
/// The sum over the blocks adds one f32 rounding per block, inside the
/// accumulation term (`n 2^-23` is twice the first-order `n 2^-24`).
///
/// Memory beyond the outputs: `w^T` (as large as `w`), and per block of
/// `rows` the two transposes, plus what the products pack.
pub(crate) fn bwd_bf16(
    product: mm_bf16::Product<'_, bf16>,
    x: &[f32],
    w: &[bf16],
    dy: &[f32],
    (n, o, k): (usize, usize, usize),
    rows: usize,
) -> (Vec<f32>, Vec<f32>) {
    let dx = product(dy, &transpose(w, o, k, |v| v), (n, k, o));
    let mut dw: Option<Vec<f32>> = None;
    for r0 in (0..n).step_by(rows.max(1)) {
        let m = rows.max(1).min(n - r0);
        let dyt = transpose(&dy[r0 * o..(r0 + m) * o], m, o, |v| v);
        let xt = transpose(&x[r0 * k..(r0 + m) * k], m, k, bf16::from_f32);
        let part = product(&dyt, &xt, (o, k, m));
        match dw.as_mut() {
            None => dw = Some(part),
            Some(dw) => dw.par_chunks_mut(1 << 16).zip(part.par_chunks(1 << 16)).for_each(|(d, p)| {
                for (d, p) in d.iter_mut().zip(p) {
                    *d += p;
                }
            }),
        }
    }
    (dx, dw.unwrap_or_else(|| vec![0f32; o * k]))
}

/// Side of the square tiles [`transpose`] copies: 32 × 32 elements touch 32
/// cache lines of the source and 32 of the destination.
const TILE_T: usize = 32;

/// `src` (rows×cols) transposed into a cols×rows matrix of `f(src)`: in
/// parallel over blocks of [`TILE_T`] destination rows, each copied in
/// square tiles.
fn transpose<S: Copy + Sync, D: Copy + Default + Send>(
    src: &[S],
    rows: usize,
    cols: usize,
    f: impl Fn(S) -> D + Sync,
) -> Vec<D> {
    let mut dst = vec![D::default(); rows * cols];
    if dst.is_empty() {
        return dst;
    }
    dst.par_chunks_mut(TILE_T * rows).enumerate().for_each(|(b, blk)| {
        let c0 = b * TILE_T;
        let cs = blk.len() / rows;
        for r0 in (0..rows).step_by(TILE_T) {
            for r in r0..(r0 + TILE_T).min(rows) {
                let line = &src[r * cols + c0..r * cols + c0 + cs];
                for (c, v) in line.iter().enumerate() {
                    blk[c * rows + r] = f(*v);
                }
            }
        }
    });
    dst
}

/// Fused `x @ w^T` for `x (.., in)`, `w (out, in)`; returns `(.., out)` with no
/// reshape nodes in the graph.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op2(&w.contiguous()?, Op(Linear))?)
}

/// `res + x w^T` over `(res, x, w)`: the product added into a copy of the
/// residual inside the gemm call (no separate pass for the add).
struct LinearAdd;

impl Kernel<3> for LinearAdd {
    const NAME: &'static str = "fused-linear-add";

    fn fwd<T: Real>(&self, ins: [Input<'_>; 3]) -> Out<T> {
        let (o, k) = ins[2].layout.shape().dims2()?;
        let [res, x, w] = data::<T, 3>(&ins)?;
        let n = x.len().checked_div(k).unwrap_or(0);
        if x.len() != n * k || res.len() != n * o || ins[1].layout.dims().last() != Some(&k) {
            bail!(
                "fused linear-add: res ({}), x {:?} and w ({o}, {k}) do not match",
                res.len(),
                ins[1].layout.dims()
            )
        }
        if w.len() != o * k {
            bail!("fused linear-add: w holds {} elements, not ({o}, {k})", w.len())
        }
        let mut y = par_copy(res);
        x_wt_into(x, w, &mut y, (n, o, k), true);
        Ok((y, ins[0].layout.shape().clone()))
    }
}

/// `res + x @ w^T` without a graph, for `x (.., in)`, `w (out, in)` and `res`
/// `(.., out)` of one dtype (f32 or f64): a residual stream and the
/// projection added to it, the sum formed inside the product.
pub fn linear_add(res: &Tensor, x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(res.contiguous()?.apply_op3_no_bwd(&x.contiguous()?, &w.contiguous()?, &Op(LinearAdd))?)
}

/// The backward of several projections of one input without a graph, `y_i =
/// x w_i^T` for `parts` `(w_i, dy_i)`: `dx = sum_i dy_i w_i`, summed inside
/// the products (each adds into the same `dx`), and `dw_i = dy_i^T x`, each
/// one product over all threads. `x` is `(.., k)`, `w_i` `(o_i, k)`, `dy_i`
/// `(.., o_i)`, all contiguous f32 or f64 on the CPU, of one dtype.
pub fn linears_bwd(x: &Tensor, parts: &[(&Tensor, &Tensor)]) -> Result<(Tensor, Vec<Tensor>)> {
    let k = x.dim(candle_core::D::Minus1)?;
    let n = x.elem_count() / k.max(1);
    for (w, dy) in parts {
        let (o, wk) = w.dims2()?;
        if wk != k || dy.elem_count() != n * o || w.dtype() != x.dtype() || dy.dtype() != x.dtype() {
            return Err(crate::Error::invalid(format!(
                "linears_bwd: x {:?}, w {:?} and dy {:?} do not match",
                x.dims(),
                w.dims(),
                dy.dims()
            )));
        }
    }
    let (dx, dws) = match x.dtype() {
        DType::F32 => linears_bwd_t::<f32>(x, parts, (n, k))?,
        DType::F64 => linears_bwd_t::<f64>(x, parts, (n, k))?,
        d => return Err(crate::Error::invalid(format!("linears_bwd: {d:?} is not served"))),
    };
    Ok((dx.reshape(x.shape())?, dws))
}

fn linears_bwd_t<T: Real>(
    x: &Tensor,
    parts: &[(&Tensor, &Tensor)],
    (n, k): (usize, usize),
) -> Result<(Tensor, Vec<Tensor>)> {
    let device = x.device();
    let (x, parts): (Tensor, Vec<(Tensor, Tensor)>) = (
        x.contiguous()?,
        parts.iter().map(|(w, dy)| Ok((w.contiguous()?, dy.contiguous()?))).collect::<Result<_>>()?,
    );
    let mut dx = par_zeros::<T>(n * k);
    let mut dws = Vec::with_capacity(parts.len());
    super::with_host::<T, _>(&x, "linears-bwd", |xs| {
        for (i, (w, dy)) in parts.iter().enumerate() {
            let o = w.dim(0)?;
            let mut dw = vec![zero::<T>(); o * k];
            super::with_host::<T, _>(w, "linears-bwd", |ws| {
                super::with_host::<T, _>(dy, "linears-bwd", |dys| {
                    bwd_into((xs, ws, dys), (&mut dx, i > 0), &mut dw, (n, o, k));
                    Ok(())
                })
            })?;
            dws.push(Tensor::from_vec(dw, (o, k), device)?);
        }
        Ok(())
    })?;
    Ok((Tensor::from_vec(dx, n * k, device)?, dws))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fused::mm_bf16::{rnd, tolerance, xwt_emulated};
    use crate::model::fused::test_util::*;
    use candle_core::{DType, Device};

    /// [`bwd_bf16`]'s bound on `dw` relative to `Σ|dy_i x_i|`, for depth `n`:
    /// both factors rounded to bf16 (`2u + u²`, `u = 2^-8`) and the f32
    /// accumulation.
    fn dw_tolerance(n: usize) -> f64 {
        let u = 2f64.powi(-8);
        2.0 * u + u * u + n as f64 * 2f64.powi(-23)
    }

    /// Worst `|dx - dy w| / Σ|dy w|` and `|dw - dy^T x| / Σ|dy x|` over every
    /// output, against f64 (`x` as given: pass it rounded to bf16 to
    /// measure the products alone).
    fn worst(
        x: &[f32],
        w: &[bf16],
        dy: &[f32],
        dx: &[f32],
        dw: &[f32],
        (n, o, k): (usize, usize, usize),
    ) -> [f64; 2] {
        let rel = |got: f32, s: f64, a: f64| (got as f64 - s).abs() / a.max(f64::MIN_POSITIVE);
        let (mut ex, mut ew) = (0f64, 0f64);
        for i in 0..n {
            for c in 0..k {
                let (mut s, mut a) = (0f64, 0f64);
                for j in 0..o {
                    let p = dy[i * o + j] as f64 * w[j * k + c].to_f64();
                    s += p;
                    a += p.abs();
                }
                ex = ex.max(rel(dx[i * k + c], s, a));
            }
        }
        for j in 0..o {
            for c in 0..k {
                let (mut s, mut a) = (0f64, 0f64);
                for i in 0..n {
                    let p = dy[i * o + j] as f64 * x[i * k + c] as f64;
                    s += p;
                    a += p.abs();
                }
                ew = ew.max(rel(dw[j * k + c], s, a));
            }
        }
        [ex, ew]
    }

    /// The bf16 backward's composition (transposes, blocks of rows, the two
    /// products) on the emulated AMX tile unit against f64: `dx` within
    /// [`tolerance`] of its depth `o`; `dw` within [`dw_tolerance`] of the
    /// exact product and within [`tolerance`] of the product with
    /// bf16-rounded `x`. Ragged shapes against the 16 × 16 × 32 tiles and the
    /// 32 × 32 transpose tiles, depth 1, depths over 1000 for each product,
    /// and blocks of rows that do not divide `n`.
    #[test]
    fn bf16_backward_emulated_matches_f64() {
        let mut seed = 36u64;
        for &(n, o, k, rows) in &[
            (1, 1, 1, DW_ROWS),
            (3, 17, 33, DW_ROWS),
            (37, 45, 1, 16),
            (40, 70, 100, DW_ROWS),
            (33, 1, 95, 7),
            (1030, 20, 37, DW_ROWS),
            (1030, 20, 37, 300),
            (7, 1030, 33, DW_ROWS),
            (5, 6, 0, DW_ROWS),
            (0, 6, 5, DW_ROWS),
        ] {
            let x: Vec<f32> = (0..n * k).map(|_| rnd(&mut seed) as f32).collect();
            let w: Vec<bf16> = (0..o * k).map(|_| bf16::from_f64(rnd(&mut seed))).collect();
            let dy: Vec<f32> = (0..n * o).map(|_| rnd(&mut seed) as f32).collect();
            let (dx, dw) = bwd_bf16(&|a, b, s| xwt_emulated(a, b, s), &x, &w, &dy, (n, o, k), rows);
            assert_eq!((dx.len(), dw.len()), (n * k, o * k), "({n},{o},{k})");
            let [ex, ew] = worst(&x, &w, &dy, &dx, &dw, (n, o, k));
            assert!(ex <= tolerance(o, true), "dx ({n},{o},{k}) rows {rows}: {ex:e}");
            assert!(ew <= dw_tolerance(n), "dw ({n},{o},{k}) rows {rows}: {ew:e}");
            let xr: Vec<f32> = x.iter().map(|v| bf16::from_f32(*v).to_f32()).collect();
            let [_, er] = worst(&xr, &w, &dy, &dx, &dw, (n, o, k));
            assert!(er <= tolerance(n, true), "dw, rounded x ({n},{o},{k}) rows {rows}: {er:e}");
        }
    }

    /// `dw` rounds both of its factors, so its bound is about twice the
    /// one-sided [`tolerance`]: `dy = x = 1 + 2^-8 + 2^-20` each round down
    /// by just under half an ulp, and the single product lands beyond
    /// `tolerance(1, true)` but within [`dw_tolerance`].
    #[test]
    fn bf16_backward_dw_bound_covers_both_roundings() {
        let v = 1.0 + 2f32.powi(-8) + 2f32.powi(-20);
        let (dx, dw) =
            bwd_bf16(&|a, b, s| xwt_emulated(a, b, s), &[v], &[bf16::ONE], &[v], (1, 1, 1), DW_ROWS);
        let [ex, ew] = worst(&[v], &[bf16::ONE], &[v], &dx, &dw, (1, 1, 1));
        assert!(ex <= tolerance(1, true), "{ex:e}");
        assert!(ew > tolerance(1, true) && ew <= dw_tolerance(1), "{ew:e}");
    }

    /// `Linear`'s backward with bf16 weights under f32 activations: where
    /// the CPU has no bf16 dot products (this machine: AVX2), bit for bit
    /// the f32 backward on the widened weights with `dw` rounded to bf16;
    /// on a bf16 dot-product path, within the bounds of [`bwd_bf16`] (plus
    /// the rounding of `dw` to bf16) against f64.
    #[test]
    fn bf16_weight_backward_by_path() {
        let (n, o, k) = (2 * 37, 45, 70);
        let mut seed = 7u64;
        let xs: Vec<f32> = (0..n * k).map(|_| rnd(&mut seed) as f32).collect();
        let ws: Vec<bf16> = (0..o * k).map(|_| bf16::from_f64(rnd(&mut seed))).collect();
        let dys: Vec<f32> = (0..n * o).map(|_| rnd(&mut seed) as f32).collect();
        let x = Tensor::from_vec(xs.clone(), (2, 37, k), &Device::Cpu).unwrap();
        let w = Tensor::from_vec(ws.clone(), (o, k), &Device::Cpu).unwrap();
        let dy = Tensor::from_vec(dys.clone(), (2, 37, o), &Device::Cpu).unwrap();
        let y = linear(&x, &w).unwrap();
        let [dx, dw] = Linear.bwd([&x, &w], &y, &dy).unwrap().map(Option::unwrap);
        assert_eq!((dx.dims(), dw.dims(), dw.dtype()), (x.dims(), w.dims(), DType::BF16));
        let dxv: Vec<f32> = dx.flatten_all().unwrap().to_vec1().unwrap();
        let dwv: Vec<bf16> = dw.flatten_all().unwrap().to_vec1().unwrap();
        if simd::cpu_path().bf16_dot() {
            let dwf: Vec<f32> = dwv.iter().map(|v| v.to_f32()).collect();
            let [ex, ew] = worst(&xs, &ws, &dys, &dxv, &dwf, (n, o, k));
            assert!(ex <= tolerance(o, true), "dx: {ex:e}");
            assert!(ew <= dw_tolerance(n) + 2f64.powi(-8), "dw: {ew:e}");
            return;
        }
        let wx = w.to_dtype(DType::F32).unwrap();
        let flat = x.apply_op3_no_bwd(&wx, &dy, &Op(LinearBwd)).unwrap();
        let [rx, rw] = split_like(&flat, [&x, &wx]).unwrap().map(Option::unwrap);
        let rxv: Vec<f32> = rx.flatten_all().unwrap().to_vec1().unwrap();
        let rwv: Vec<bf16> = rw.to_dtype(DType::BF16).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&dxv), bits(&rxv));
        assert_eq!(
            dwv.iter().map(|b| b.to_bits()).collect::<Vec<_>>(),
            rwv.iter().map(|b| b.to_bits()).collect::<Vec<_>>()
        );
        // And that backward is the gradient, to f32's accuracy.
        let [ex, ew] =
            worst(&xs, &ws, &dys, &dxv, &rw.flatten_all().unwrap().to_vec1::<f32>().unwrap(), (n, o, k));
        assert!(ex <= tolerance(o, false) && ew <= tolerance(n, false), "{ex:e} {ew:e}");
    }

    /// The residual added inside the product equals the residual plus the
    /// projection, to f32's (f64's) rounding, in both dtypes.
    #[test]
    fn linear_add_is_the_residual_plus_the_projection() {
        for dtype in [DType::F64, DType::F32] {
            let (x, w, res) =
                (randn(&[3, 7, 40], dtype, 1), randn(&[24, 40], dtype, 2), randn(&[3, 7, 24], dtype, 3));
            let (x, w, res) = (x.as_tensor(), w.as_tensor(), res.as_tensor());
            let y = linear_add(res, x, w).unwrap();
            let want = (res + x.broadcast_matmul(&w.t().unwrap()).unwrap()).unwrap();
            assert_eq!(y.dims(), res.dims());
            assert!(rel_err(&y, &want) < tol(dtype), "{dtype:?}: {:e}", rel_err(&y, &want));
        }
        let e = linear_add(
            &Tensor::zeros((3, 5), DType::F32, &Device::Cpu).unwrap(),
            &Tensor::zeros((3, 4), DType::F32, &Device::Cpu).unwrap(),
            &Tensor::zeros((6, 4), DType::F32, &Device::Cpu).unwrap(),
        );
        assert!(e.is_err());
    }

    #[test]
    fn linear_matches_composed() {
        // (2, 7, 12) takes gemm; (3, 1, 40) and (6, 40) the decoding kernel (gemv).
        for (dtype, xs, k) in [
            (DType::F64, &[2, 7, 12][..], 12),
            (DType::F32, &[2, 7, 12], 12),
            (DType::F64, &[3, 1, 40], 40),
            (DType::F32, &[3, 1, 40], 40),
            (DType::F32, &[6, 40], 40),
        ] {
            let x = randn(xs, dtype, 12);
            let w = randn(&[21, k], dtype, 13);
            check(
                &[&x, &w],
                &|| linear(x.as_tensor(), w.as_tensor()).unwrap(),
                &|| x.as_tensor().broadcast_matmul(&w.as_tensor().t().unwrap()).unwrap(),
                tol(dtype),
                "linear",
            );
        }
    }

    /// bf16 weights under f32 rows of one position, up to
    /// [`gemv::MAX_ROWS_BF16`] of them (the paged engine's 64 decoding rows):
    /// the decoding kernel serves them, so each row's outputs are the same
    /// bits as that row alone, and within f32 rounding of the f64 product
    /// of the same bf16 weights.
    #[test]
    fn bf16_decoding_rows_are_independent_up_to_their_cap() {
        let (o, k) = (24, 40);
        let w = randn(&[o, k], DType::BF16, 21);
        let w64 = w.as_tensor().to_dtype(DType::F64).unwrap();
        for n in [1, 33, gemv::MAX_ROWS_BF16] {
            let x = randn(&[n, 1, k], DType::F32, 22);
            let y = linear(x.as_tensor(), w.as_tensor()).unwrap();
            let last = x.as_tensor().narrow(0, n - 1, 1).unwrap();
            let alone = linear(&last, w.as_tensor()).unwrap();
            let row = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(row(&y.narrow(0, n - 1, 1).unwrap()), row(&alone), "{n} rows");
            let want =
                x.as_tensor().to_dtype(DType::F64).unwrap().broadcast_matmul(&w64.t().unwrap()).unwrap();
            let e = (y.to_dtype(DType::F64).unwrap() - &want).unwrap().abs().unwrap().max_all().unwrap();
            assert!(e.to_scalar::<f64>().unwrap() < 1e-5, "{n} rows: {e}");
        }
    }
}
