//! Shared helpers of the fused kernels' tests: deterministic random inputs and
//! a value-and-gradient comparison against a reference closure.

use candle_core::{DType, Device, Tensor, Var};

/// Max |a - b| relative to max |b| (and at least 1e-30).
pub(crate) fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
    a.iter().zip(&b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

pub(crate) fn randn(shape: &[usize], dtype: DType, seed: u64) -> Var {
    // Deterministic pseudo-random values (the CPU device RNG is not seedable per call).
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let v: Vec<f64> = (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect();
    Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()).unwrap()
}

/// A random linear functional of `y`, so that every output element gets a distinct gradient.
pub(crate) fn probe(y: &Tensor, seed: u64) -> Tensor {
    let w = randn(y.dims(), y.dtype(), seed);
    (y * w.as_tensor()).unwrap().sum_all().unwrap()
}

/// Compares values and gradients w.r.t. `vars` of `fused` and `reference`.
pub(crate) fn check(
    vars: &[&Var],
    fused: &dyn Fn() -> Tensor,
    reference: &dyn Fn() -> Tensor,
    tol: f64,
    what: &str,
) {
    let (yf, yr) = (fused(), reference());
    assert_eq!(yf.dims(), yr.dims(), "{what}: shape");
    let e = rel_err(&yf, &yr);
    assert!(e < tol, "{what}: value error {e:e}");
    let gf = probe(&yf, 99).backward().unwrap();
    let gr = probe(&yr, 99).backward().unwrap();
    for (i, v) in vars.iter().enumerate() {
        let (a, b) =
            (gf.get(v.as_tensor()).expect("fused grad"), gr.get(v.as_tensor()).expect("reference grad"));
        let e = rel_err(a, b);
        assert!(e < tol, "{what}: gradient {i} error {e:e}");
    }
}

pub(crate) fn tol(dtype: DType) -> f64 {
    if dtype == DType::F64 {
        1e-10
    } else {
        1e-5
    }
}
