//! Fused `y = x w^T` (the projections) with its backward; `w` may be bf16
//! under f32 `x` (bf16 weights, f32 activations: see [`super::simd`]).

use candle_core::{bail, CpuStorage, Shape, Tensor, WithDType};
use half::bf16;

use super::{
    all_threads, data, gemv, mm_bf16, mm_par, simd, split_like, zero, Grads, Input, Kernel, Op, Out, Real,
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
            // bf16 weights under f32 activations: the backward in f32 on the
            // widened weights, the weight gradient rounded to the weight's dtype.
            let wx = w.to_dtype(x.dtype())?;
            let flat = x.apply_op3_no_bwd(&wx, &dy.contiguous()?, &Op(LinearBwd))?;
            let [dx, dw] = split_like(&flat, [x, &wx])?;
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
    debug_assert!(x.len() == n * k && w.len() == o * k, "x_wt: operands do not match ({n}, {o}, {k})");
    let mut y = vec![zero::<T>(); n * o];
    // SAFETY: x is n×k, w is o×k (the callers' layouts), y is n×o, all contiguous and owned here.
    unsafe {
        mm_par(
            (n, o, k),
            y.as_mut_ptr(),
            o,
            false,
            x.as_ptr(),
            (k, 1),
            w.as_ptr(),
            (1, k),
            T::from_f64(1.0),
            all_threads(),
        );
    }
    y
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
        let mut out = vec![zero::<T>(); n * k + o * k];
        let (dx, dw) = out.split_at_mut(n * k);
        let one = T::from_f64(1.0);
        // SAFETY: dy is n×o, w o×k, x n×k, dx n×k, dw o×k, all contiguous.
        unsafe {
            mm_par(
                (n, k, o),
                dx.as_mut_ptr(),
                k,
                false,
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
        let len = out.len();
        Ok((out, Shape::from(len)))
    }
}

/// Fused `x @ w^T` for `x (.., in)`, `w (out, in)`; returns `(.., out)` with no
/// reshape nodes in the graph.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op2(&w.contiguous()?, Op(Linear))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fused::test_util::*;
    use candle_core::DType;

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
