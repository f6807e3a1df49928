//! Fused log-softmax + gather + entropy over vocabulary logits, with its
//! backward: log_softmax is never materialised.

use candle_core::{bail, DType, Shape, Tensor};
use rayon::prelude::*;

use super::{data, par_zeros, with_host, zero, Grads, Input, Kernel, Op, Out, Real};
use crate::Result;

/// Per row of logits `x (N, V)` and target `t`: `[x_t - lse, H, lse]` with
/// `lse = logsumexp(x)` and `H = -sum p log p = lse - sum p x`, from a max pass
/// and one exp pass; log_softmax is never materialised.
struct LogpEntropy;

/// `(lse, sum_j p_j x_j)` of one row, accumulated in f64.
#[inline]
fn lse_and_mean<T: Real>(x: &[T]) -> (f64, f64) {
    let mx = x.iter().fold(T::from_f64(f64::NEG_INFINITY), |a, &v| a.fmax(v));
    let (mut s, mut t) = (0f64, 0f64);
    for &v in x {
        let z = v - mx;
        let e = z.exp().to_f64();
        s += e;
        // A -inf logit has p = 0 and adds nothing (not 0 * -inf = NaN).
        if e > 0.0 {
            t += e * z.to_f64();
        }
    }
    let lse = mx.to_f64() + s.ln();
    (lse, t / s + mx.to_f64())
}

/// `(lse, sum_j p_j x_j, sum_j p_j^2)` of one row, accumulated in f64 (the
/// collision probability from the same exp pass: `sum e^2 / (sum e)^2`).
#[inline]
pub(super) fn row_stats<T: Real>(x: &[T]) -> (f64, f64, f64) {
    let mx = x.iter().fold(T::from_f64(f64::NEG_INFINITY), |a, &v| a.fmax(v));
    let (mut s, mut t, mut s2) = (0f64, 0f64, 0f64);
    for &v in x {
        let z = v - mx;
        let e = z.exp().to_f64();
        s += e;
        s2 += e * e;
        if e > 0.0 {
            t += e * z.to_f64();
        }
    }
    let lse = mx.to_f64() + s.ln();
    (lse, t / s + mx.to_f64(), s2 / (s * s))
}

impl Kernel<2> for LogpEntropy {
    const NAME: &'static str = "fused-logp-entropy";

    fn fwd<T: Real>(&self, ins: [Input<'_>; 2]) -> Out<T> {
        let vocab = *ins[0].layout.dims().last().unwrap_or(&1);
        let n = ins[0].layout.shape().elem_count() / vocab.max(1);
        let targets = ins[1].data::<u32>()?;
        if targets.len() != n {
            bail!("fused logprob_entropy: {} targets for {n} rows of logits", targets.len())
        }
        if let Some(&t) = targets.iter().find(|&&t| t as usize >= vocab) {
            bail!("fused logprob_entropy: target {t} outside a vocabulary of {vocab}")
        }
        let x = ins[0].data::<T>()?;
        let mut out = par_zeros::<T>(3 * n);
        out.par_chunks_mut(3).zip(x.par_chunks(vocab)).zip(targets.par_iter()).for_each(|((o, row), &t)| {
            let (lse, mean) = lse_and_mean(row);
            o[0] = T::from_f64(row[t as usize].to_f64() - lse);
            o[1] = T::from_f64(lse - mean);
            o[2] = T::from_f64(lse);
        });
        Ok((out, Shape::from((n, 3))))
    }

    fn bwd(&self, [x, targets]: [&Tensor; 2], res: &Tensor, dres: &Tensor) -> Grads<2> {
        let op = LogpEntropyBwd { targets: targets.clone() };
        Ok([Some(x.apply_op3_no_bwd(res, &dres.contiguous()?, &Op(op))?), None])
    }
}

/// Backward of [`LogpEntropy`] over `(x, res, dres)`: with `p = exp(x - lse)`,
/// `dx_j = gl (1[j = t] - p_j) - ge p_j (x_j - lse + H)`.
struct LogpEntropyBwd {
    targets: Tensor,
}

impl Kernel<3> for LogpEntropyBwd {
    const NAME: &'static str = "fused-logp-entropy-bwd";

    fn fwd<T: Real>(&self, ins: [Input<'_>; 3]) -> Out<T> {
        let vocab = *ins[0].layout.dims().last().unwrap_or(&1);
        let [x, res, dres] = data::<T, 3>(&ins)?;
        let mut dx = par_zeros::<T>(x.len());
        with_host::<u32, _>(&self.targets, Self::NAME, |targets| {
            dx.par_chunks_mut(vocab).zip(x.par_chunks(vocab)).enumerate().for_each(|(i, (dr, xr))| {
                let (h, lse) = (res[3 * i + 1], res[3 * i + 2]);
                let (gl, ge) = (dres[3 * i], dres[3 * i + 1]);
                let shift = h - lse;
                for (d, &v) in dr.iter_mut().zip(xr) {
                    let p = (v - lse).exp();
                    *d = if p > zero() { -p * (gl + ge * (v + shift)) } else { zero() };
                }
                dr[targets[i] as usize] += gl;
            });
            Ok(())
        })?;
        Ok((dx, ins[0].layout.shape().clone()))
    }
}

/// Fused log-prob of `targets` and entropy from logits `(.., V)` in f32/f64.
pub fn logprob_entropy(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let x = logits.contiguous()?;
    let t = targets.flatten_all()?.to_dtype(DType::U32)?.contiguous()?.detach();
    let out = x.apply_op2(&t, Op(LogpEntropy))?;
    let logp = out.narrow(1, 0, 1)?.reshape(targets.shape())?;
    let entropy = out.narrow(1, 1, 1)?.reshape(targets.shape())?;
    Ok((logp, entropy))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fused::test_util::*;
    use crate::model::ops;
    use candle_core::Device;

    #[test]
    fn logprob_entropy_matches_composed() {
        for dtype in [DType::F64, DType::F32] {
            let x = randn(&[3, 4, 50], dtype, 11);
            let t =
                Tensor::from_vec((0..12u32).map(|i| (i * 7) % 50).collect::<Vec<_>>(), (3, 4), &Device::Cpu)
                    .unwrap();
            let scaled = || x.as_tensor().affine(5.0, 0.0).unwrap();
            for which in 0..2 {
                check(
                    &[&x],
                    &|| {
                        let (lp, h) = logprob_entropy(&scaled(), &t).unwrap();
                        if which == 0 {
                            lp
                        } else {
                            h
                        }
                    },
                    &|| {
                        let (lp, h) = ops::logprob_entropy_composed(&scaled(), &t).unwrap();
                        if which == 0 {
                            lp
                        } else {
                            h
                        }
                    },
                    tol(dtype),
                    if which == 0 { "logp" } else { "entropy" },
                );
            }
            // Both outputs at once, as the entropy-bonus loss uses them.
            check(
                &[&x],
                &|| {
                    let (lp, h) = logprob_entropy(&scaled(), &t).unwrap();
                    (lp - h.affine(0.3, 0.0).unwrap()).unwrap()
                },
                &|| {
                    let (lp, h) = ops::logprob_entropy_composed(&scaled(), &t).unwrap();
                    (lp - h.affine(0.3, 0.0).unwrap()).unwrap()
                },
                tol(dtype),
                "logp - 0.3 entropy",
            );
        }
    }

    #[test]
    fn out_of_range_target_is_an_error() {
        let x = Tensor::zeros((2, 5), DType::F32, &Device::Cpu).unwrap();
        let t = Tensor::from_vec(vec![1u32, 5], 2, &Device::Cpu).unwrap();
        let err = logprob_entropy(&x, &t).unwrap_err().to_string();
        assert!(err.contains("target 5"), "{err}");
    }
}
