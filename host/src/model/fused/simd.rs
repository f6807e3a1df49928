//! Run-time CPU path selection, and the decode kernels that read bf16
//! weights: `y = x w^T` with `x` and `y` in f32 and `w` in bf16 (half the
//! bytes of an f32 weight), accumulated in f32.
//!
//! Decoding a few rows is bound by reading the weights (see [`super::gemv`]),
//! so a bf16 weight read as bf16 and widened in registers (bf16 is the top
//! half of an f32: a 16-bit shift) halves the memory traffic of the f32 path
//! without rounding the activations, as llama.cpp's and PyTorch's CPU
//! `bf16 x f32` gemv do. The dot products of pairs of bf16 that AVX-512 BF16
//! (`vdpbf16ps`) and AMX (`tdpbf16ps`) offer also round `x` to bf16 and buy
//! nothing on a memory-bound product; they serve the large, compute-bound
//! products of training and prefill ([`super::mm_bf16`]).
//!
//! Paths, chosen once at run time ([`selection`]): AMX, then AVX2, portable
//! (best first), capped by [`ENV`]; AVX-512 BF16 only when [`ENV`] names it (on
//! the one CPU it ran on, its products were slower than AVX2's f32 gemm: see
//! [`select`]); AMX only with the kernel's permission
//! ([`request_amx`]). AMX and AVX-512 BF16 ([`UNVERIFIED`]: run on one CPU model
//! so far) are chosen only after their self-check
//! ([`super::mm_bf16::verify`]) passes on this CPU. The decode kernels here run AVX2 + FMA (8 f32 lanes, 4
//! rows of `x` × 2 or 3 weight rows per register tile) where the CPU has both
//! ([`path`]), else a portable loop of the same arithmetic shape. The f32
//! weights of [`super::gemv`] take the same AVX2 tile where AVX-512F is absent.

use std::sync::OnceLock;

use super::cpu::supports;
pub(crate) use super::cpu::Weight;
pub use super::cpu::{amx_ready, features, permit_amx, ready, request_amx, widen, Features, Path};

/// The environment variable that forces a CPU path (`amx`, `avx512bf16`,
/// `avx2` or `portable`): a lower one than the default to compare paths on one
/// machine, or one of [`UNVERIFIED`] to choose it without its self-check.
pub const ENV: &str = "STAPO_CPU_PATH";

/// The paths [`ENV`] may name, best first.
const CHOICES: [Path; 4] = [Path::Amx, Path::Avx512Bf16, Path::Avx2, Path::Portable];

/// Paths whose kernels have run on one CPU model only: written without a machine
/// that has them (2026-12-04; the AVX-512 BF16 machine code first ran in the Bochs
/// emulator, `docs/bench/emu_bf16_kernels.sh`), then run on a 2-core Intel Xeon
/// virtual machine with AMX and AVX-512 BF16 (`amx-2c` in docs/performance.md,
/// 2026-12-08), where `stapo bench kernels` and the test suite pass on both; never
/// on an AMD CPU (Zen 4 has AVX-512 BF16). By default such a path is chosen only
/// once its self-check ([`super::mm_bf16::verify`]: its products against f64, the
/// checks of `stapo bench kernels`, a few milliseconds) has passed on this CPU, in
/// this process; a failed check falls back to the next path with a note.
pub const UNVERIFIED: [Path; 2] = [Path::Amx, Path::Avx512Bf16];

/// The paths this CPU's instructions support (AMX without asking the kernel
/// for permission), best first.
pub fn supported_paths() -> Vec<Path> {
    let f = features();
    CHOICES.into_iter().filter(|p| supports(f, *p)).collect()
}

/// The chosen path and what the choice had to say (a fallback, a refusal).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// The best path that is supported, permitted and not above the forced one.
    pub path: Path,
    /// One line per fallback, for the log.
    pub notes: Vec<String>,
}

/// Chooses the CPU path: the best of AMX > AVX2 > portable that the CPU
/// supports, at or below `forced` (the value of [`ENV`]), with AMX only if
/// `amx_permission` (asked only when AMX would be chosen) succeeds. AVX-512 BF16
/// only when `forced` names it: on the one CPU it has run on (`amx-2c`,
/// 2026-12-08) a bf16-weight update at the 16.8M shape took 1.45x AVX2's time
/// (its `vdpbf16ps` tiles ran at ~65 GFLOP/s, the `gemm` crate's f32 AVX-512
/// kernel on the widened weight at ~100-130), and it rounds the activations to
/// bf16 where AVX2 keeps f32. Unforced, a path in [`UNVERIFIED`] is chosen only
/// if `verify` (its self-check on this CPU, asked only when it would be chosen)
/// passes; a forced path is not checked.
///
/// # Errors
/// `forced` names no path.
pub fn select(
    f: Features,
    forced: Option<&str>,
    amx_permission: &mut dyn FnMut() -> Result<(), String>,
    verify: &mut dyn FnMut(Path) -> Result<String, String>,
) -> Result<Selection, String> {
    let mut notes = Vec::new();
    let forced = forced.map(str::trim).filter(|s| !s.is_empty());
    let cap = match forced {
        None => 0,
        Some(name) => CHOICES.iter().position(|p| p.name() == name).ok_or_else(|| {
            let names: Vec<_> = CHOICES.iter().map(|p| p.name()).collect();
            format!("{ENV}={name}: expected one of {}", names.join(", "))
        })?,
    };
    for &p in &CHOICES[cap..] {
        if !supports(f, p) {
            if forced.is_some() && p == CHOICES[cap] {
                notes.push(format!("{ENV}={}: not supported by this CPU, trying the next path", p.name()));
            }
            continue;
        }
        if p == Path::Avx512Bf16 && forced != Some(p.name()) {
            continue;
        }
        if p == Path::Amx {
            if let Err(e) = amx_permission() {
                notes.push(format!("amx: the kernel did not permit AMX tiles ({e}); falling back"));
                continue;
            }
        }
        if forced.is_none() && UNVERIFIED.contains(&p) {
            match verify(p) {
                Ok(passed) => notes.push(format!(
                    "{}: chosen after its self-check passed on this CPU ({passed}); {ENV}=avx2 opts out",
                    p.name()
                )),
                Err(e) => {
                    notes.push(format!(
                        "{}: its self-check FAILED on this CPU ({e}); falling back to the next path \
                         (please report this with the output of `stapo bench kernels`)",
                        p.name()
                    ));
                    continue;
                }
            }
        }
        return Ok(Selection { path: p, notes });
    }
    unreachable!("the portable path is always supported")
}

/// The process's selection: [`select`] on this CPU and [`ENV`], made once;
/// its notes go to stderr once. An unknown [`ENV`] value is reported there
/// and ignored (the benchmarks check it first with [`check_env`]).
pub fn selection() -> &'static Selection {
    static S: OnceLock<Selection> = OnceLock::new();
    S.get_or_init(|| {
        let forced = std::env::var(ENV).ok();
        let mut verify = super::mm_bf16::verify;
        let s = select(features(), forced.as_deref(), &mut permit_amx, &mut verify).unwrap_or_else(|e| {
            eprintln!("stapo: {e}; ignored");
            select(features(), None, &mut permit_amx, &mut verify).expect("no forced path")
        });
        for n in &s.notes {
            eprintln!("stapo: {n}");
        }
        s
    })
}

/// The CPU path of the bf16 products: [`selection`]'s path.
pub fn cpu_path() -> Path {
    selection().path
}

/// Checks [`ENV`]: an error names the variable and the values it takes.
///
/// # Errors
/// [`ENV`] is set to no path's name.
pub fn check_env() -> Result<(), String> {
    let forced = std::env::var(ENV).ok();
    select(features(), forced.as_deref(), &mut || Ok(()), &mut |_| Ok(String::new())).map(|_| ())
}

/// The path the f32-activation kernels (bf16-weight gemv, roofline) run:
/// AVX2 + FMA where the CPU has both, unless [`ENV`] forces `portable`.
pub fn path() -> Path {
    if features().avx2_fma && cpu_path() != Path::Portable {
        Path::Avx2
    } else {
        Path::Portable
    }
}

/// One line for the benchmarks: the paths chosen and what the CPU has.
pub fn describe() -> String {
    let f = features();
    let yes = |b: bool| if b { "yes" } else { "no" };
    format!(
        "cpu path: {} for bf16 products, {} for bf16-weight decoding (cpu: amx_bf16 {}, avx512_bf16 {}, avx512f {}, avx2+fma {}; {ENV} forces a path; amx only after its self-check, avx512bf16 only when named)",
        cpu_path().name(),
        path().name(),
        yes(f.amx_bf16),
        yes(f.avx512bf16),
        yes(f.avx512f),
        yes(f.avx2_fma)
    )
}

/// Weight rows per rayon task.
const ROWS_PER_TASK: usize = 64;

/// `y (n×o) = x (n×k) · w (o×k)^T`, row-major, `w` in f32 or bf16, on the
/// path of [`path`] (parallel over weight rows unless the product is small).
/// Each output is one dot product in a fixed order: a row's result does not
/// depend on how many rows share the call.
pub(crate) fn gemv_w<W: Weight>(x: &[f32], w: &[W], y: &mut [f32], n: usize, o: usize, k: usize) {
    gemv_w_on(path(), x, w, y, (n, o, k))
}

/// [`gemv_w`] on `path` ([`Path::Avx2`], which the CPU must have, or any
/// other for the portable loop): the self-check compares the two.
pub(crate) fn gemv_w_on<W: Weight>(
    p: Path,
    x: &[f32],
    w: &[W],
    y: &mut [f32],
    (n, o, k): (usize, usize, usize),
) {
    assert!(x.len() >= n * k && w.len() >= o * k && y.len() >= n * o, "gemv: buffers too small");
    assert!(p != Path::Avx2 || features().avx2_fma, "gemv: this CPU has no AVX2 + FMA");
    if n == 0 || o == 0 {
        return;
    }
    let avx2 = p == Path::Avx2;
    let yp = super::SendPtr(y.as_mut_ptr());
    let run = |t: usize| {
        let y = yp;
        let (o0, o1) = (t * ROWS_PER_TASK, ((t + 1) * ROWS_PER_TASK).min(o));
        // SAFETY: each task writes only columns o0..o1 of y; the sizes were
        // checked above; the AVX2 kernel runs only where the CPU has AVX2 + FMA.
        unsafe {
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                return x86::block(x, w, y.0, (n, o, k), (o0, o1));
            }
            let _ = avx2;
            portable(x, w, y.0, (n, o, k), (o0, o1))
        }
    };
    let tasks = o.div_ceil(ROWS_PER_TASK);
    if tasks == 1 || n * o * k < 1 << 16 {
        (0..tasks).for_each(run);
    } else {
        use rayon::prelude::*;
        (0..tasks).into_par_iter().for_each(run);
    }
}

/// Lanes of the portable accumulators (as the AVX2 path's).
const LANES: usize = 8;

/// The portable loop: per output, `LANES` partial sums, a fixed-order reduction, then the tail.
///
/// # Safety
/// `y` addresses `n × o` elements that nobody else writes in columns `o0..o1`.
pub(crate) unsafe fn portable<W: Weight>(
    x: &[f32],
    w: &[W],
    y: *mut f32,
    (n, o, k): (usize, usize, usize),
    (o0, o1): (usize, usize),
) {
    let kv = k - k % LANES;
    for j in o0..o1 {
        let wr = &w[j * k..(j + 1) * k];
        for i in 0..n {
            let xr = &x[i * k..(i + 1) * k];
            let mut acc = [0f32; LANES];
            for c in (0..kv).step_by(LANES) {
                for l in 0..LANES {
                    acc[l] = xr[c + l].mul_add(wr[c + l].f32(), acc[l]);
                }
            }
            let mut s = reduce8(acc);
            for c in kv..k {
                s = xr[c].mul_add(wr[c].f32(), s);
            }
            *y.add(i * o + j) = s;
        }
    }
}

/// The AVX2 kernel over all `o` weight rows on the calling thread (the roofline probe).
///
/// # Safety
/// The CPU has AVX2 and FMA; `x`, `w` hold `n × k` and `o × k` elements; `y` addresses `n × o`.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn avx2_block<W: Weight>(
    x: &[f32],
    w: &[W],
    y: *mut f32,
    (n, o, k): (usize, usize, usize),
) {
    x86::block(x, w, y, (n, o, k), (0, o))
}

/// The fixed reduction order of 8 lanes both paths use: halves, then pairs.
#[inline]
fn reduce8(a: [f32; 8]) -> f32 {
    let q = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let p = [q[0] + q[2], q[1] + q[3]];
    p[0] + p[1]
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{reduce8, Weight};

    /// Rows of `x` per register tile.
    const R: usize = 4;

    /// Up to this many rows of `x`, register tiles hold 2 weight rows
    /// (R × 2 = 8 accumulators); above it, 3 (12 accumulators + 3 weights +
    /// 1 x fill the 16 `ymm` registers), which cuts the loads of `x` (from L2
    /// at 24-64 rows) per FMA by a third. Measured on the 2-core AVX2 EPYC,
    /// 2026-12-05, quiet, alternating with 2-row tiles: the 0.6B-shape bf16
    /// rollout (17.6 rows per call) went from 47 / 47 to 55 / 53 tok/s in one
    /// run and from 50 / 49 to 54 / 52 in another (1.07-1.15x). At 8 rows
    /// (`stapo bench generate --dtype bfloat16`, 16.8M) 3 weight rows measured
    /// 0.88x (means of 3 × 10 reps; identical code differs by up to 8% there),
    /// so 8 rows and fewer keep 2. A throw-away timing loop gave 4 × 3 about
    /// 10% over 4 × 2 at 24 and 48 rows of weights streamed from memory;
    /// 6 × 2 and 3 × 4 were not faster. The tile's shape does not change any
    /// output's arithmetic.
    pub const NARROW_ROWS: usize = 8;

    /// Columns `o0..o1` of `y`, a few weight rows at a time (see
    /// [`NARROW_ROWS`]), each dotted with every row of `x` while it sits in L1.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; as for [`super::portable`].
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn block<W: Weight>(
        x: &[f32],
        w: &[W],
        y: *mut f32,
        (n, o, k): (usize, usize, usize),
        (o0, o1): (usize, usize),
    ) {
        if n <= NARROW_ROWS {
            tiles::<W, 2>(x, w, y, (n, o, k), (o0, o1))
        } else {
            tiles::<W, 3>(x, w, y, (n, o, k), (o0, o1))
        }
    }

    /// [`block`] with register tiles of up to `C` weight rows.
    ///
    /// # Safety
    /// As for [`block`].
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tiles<W: Weight, const C: usize>(
        x: &[f32],
        w: &[W],
        y: *mut f32,
        (n, o, k): (usize, usize, usize),
        (o0, o1): (usize, usize),
    ) {
        let mut j = o0;
        while j < o1 {
            // Four rows left go as two pairs, not three and a single
            // (a task's 64 rows are 20 tiles of three and two of two).
            let c = if C == 3 && o1 - j == 4 { 2 } else { (o1 - j).min(C) };
            let mut i = 0;
            while i < n {
                let r = (n - i).min(R);
                let t = Tile { x: x.as_ptr(), w: w.as_ptr(), y, o, k, i0: i, j0: j };
                match (r, c) {
                    (4, 3) => t.run::<4, 3>(),
                    (3, 3) => t.run::<3, 3>(),
                    (2, 3) => t.run::<2, 3>(),
                    (1, 3) => t.run::<1, 3>(),
                    (4, 2) => t.run::<4, 2>(),
                    (3, 2) => t.run::<3, 2>(),
                    (2, 2) => t.run::<2, 2>(),
                    (1, 2) => t.run::<1, 2>(),
                    (4, _) => t.run::<4, 1>(),
                    (3, _) => t.run::<3, 1>(),
                    (2, _) => t.run::<2, 1>(),
                    _ => t.run::<1, 1>(),
                }
                i += r;
            }
            j += c;
        }
    }

    /// One register tile: rows `i0..` of `x` (row stride `k`) against weight
    /// rows `j0..`, into `y` (row stride `o`).
    struct Tile<W> {
        x: *const f32,
        w: *const W,
        y: *mut f32,
        o: usize,
        k: usize,
        i0: usize,
        j0: usize,
    }

    impl<W: Weight> Tile<W> {
        /// # Safety
        /// As for [`block`]; rows `i0..i0+RR` of x and `j0..j0+CC` of w exist.
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn run<const RR: usize, const CC: usize>(&self) {
            let Self { x, w, y, o, k, i0, j0 } = *self;
            let xp = x.add(i0 * k);
            let wp = w.add(j0 * k);
            let mut acc = [[_mm256_setzero_ps(); CC]; RR];
            let kv = k - k % 8;
            let mut c = 0;
            while c < kv {
                let mut wv = [_mm256_setzero_ps(); CC];
                for (b, v) in wv.iter_mut().enumerate() {
                    *v = W::load8(wp.add(b * k + c));
                }
                for (a, row) in acc.iter_mut().enumerate() {
                    let xv = _mm256_loadu_ps(xp.add(a * k + c));
                    for (b, s) in row.iter_mut().enumerate() {
                        *s = _mm256_fmadd_ps(xv, wv[b], *s);
                    }
                }
                c += 8;
            }
            for (a, row) in acc.iter().enumerate() {
                for (b, s) in row.iter().enumerate() {
                    let mut lanes = [0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), *s);
                    let mut v = reduce8(lanes);
                    for t in kv..k {
                        v = (*xp.add(a * k + t)).mul_add((*wp.add(b * k + t)).f32(), v);
                    }
                    *y.add((i0 + a) * o + j0 + b) = v;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;

    fn rnd(seed: &mut u64) -> f64 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 33) as f64 / (1u64 << 31) as f64) - 0.5
    }

    /// bf16 weights against an f64 dot product of the same (bf16-exact)
    /// weights, on the dispatched path and the portable one, for every tile
    /// remainder and k tail; the two paths agree bit for bit (same order of
    /// operations), and one row alone gives the same bits as in the batch.
    #[test]
    fn bf16_simd_gemv_matches_f64() {
        println!("{}", describe());
        let mut seed = 3u64;
        // Up to `NARROW_ROWS` rows the tiles take 2 weight rows, above it 3
        // (and 2 + 2 for the last 4, 1 for a last single row: (9, 65, 40)).
        let shapes = [
            (1, 1, 1),
            (3, 7, 17),
            (5, 130, 64),
            (8, 67, 33),
            (32, 9, 100),
            (13, 200, 515),
            (9, 65, 40),
            (11, 7, 24),
        ];
        for &(n, o, k) in &shapes {
            let x: Vec<f32> = (0..n * k).map(|_| rnd(&mut seed) as f32).collect();
            let w: Vec<bf16> = (0..o * k).map(|_| bf16::from_f64(rnd(&mut seed))).collect();
            let want: Vec<f64> = (0..n * o)
                .map(|e| (0..k).map(|c| x[(e / o) * k + c] as f64 * w[(e % o) * k + c].to_f64()).sum())
                .collect();
            let mut y = vec![0f32; n * o];
            gemv_w(&x, &w, &mut y, n, o, k);
            let mut yp = vec![0f32; n * o];
            // SAFETY: yp holds n×o elements, written by this call only.
            unsafe { portable(&x, &w, yp.as_mut_ptr(), (n, o, k), (0, o)) };
            for e in 0..n * o {
                // f32 accumulation of k products of magnitude <= 1/4.
                let bound = 1e-6 * k as f64;
                assert!(
                    (y[e] as f64 - want[e]).abs() <= bound,
                    "({n},{o},{k}) [{e}]: {} vs {}",
                    y[e],
                    want[e]
                );
            }
            assert_eq!(y, yp, "{} path vs portable ({n},{o},{k})", path().name());
            let mut one = vec![0f32; o];
            gemv_w(&x[(n - 1) * k..], &w, &mut one, 1, o, k);
            assert_eq!(&one[..], &y[(n - 1) * o..], "row independence ({n},{o},{k})");
        }
    }

    /// The same kernel over f32 weights (the AVX2 path of the f32 gemv) against f64.
    #[test]
    fn bf16_simd_f32_weights_match_f64() {
        let mut seed = 5u64;
        for &(n, o, k) in &[(2, 3, 9), (8, 130, 128), (31, 65, 77)] {
            let x: Vec<f32> = (0..n * k).map(|_| rnd(&mut seed) as f32).collect();
            let w: Vec<f32> = (0..o * k).map(|_| rnd(&mut seed) as f32).collect();
            let mut y = vec![0f32; n * o];
            gemv_w(&x, &w, &mut y, n, o, k);
            for e in 0..n * o {
                let want: f64 = (0..k).map(|c| x[(e / o) * k + c] as f64 * w[(e % o) * k + c] as f64).sum();
                assert!((y[e] as f64 - want).abs() <= 1e-6 * k as f64, "({n},{o},{k}) [{e}]");
            }
        }
    }

    /// Widening is exact: every bf16 bit pattern of a finite value gives the same f32 as `half`.
    #[test]
    fn bf16_simd_widen_is_exact() {
        let all: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).filter(|b| b.is_finite()).collect();
        let wide = widen(&all);
        for (b, f) in all.iter().zip(&wide) {
            assert_eq!(f.to_bits(), b.to_f32().to_bits());
        }
    }

    const ALL: Features = Features { amx_bf16: true, avx512bf16: true, avx512f: true, avx2_fma: true };
    const AVX2: Features = Features { amx_bf16: false, avx512bf16: false, avx512f: false, avx2_fma: true };

    /// A `verify` that must not be called.
    fn no_check(p: Path) -> Result<String, String> {
        panic!("no self-check asked for {}", p.name())
    }

    /// The dispatch: best first; a forced path caps it (and asks no AMX
    /// permission below AMX, and no self-check); a refused permission falls
    /// back with a note; a forced path the CPU lacks falls to the next one
    /// with a note; an unknown name is an error naming the variable.
    #[test]
    fn bf16_simd_select_paths() {
        let mut asked = 0;
        let mut grant = || -> Result<(), String> {
            asked += 1;
            Ok(())
        };
        assert_eq!(
            select(AVX2, None, &mut || Ok(()), &mut no_check).unwrap(),
            Selection { path: Path::Avx2, notes: vec![] }
        );
        assert_eq!(
            select(ALL, Some("amx"), &mut grant, &mut no_check).unwrap(),
            Selection { path: Path::Amx, notes: vec![] }
        );
        assert_eq!(asked, 1);
        for (name, want) in
            [("avx512bf16", Path::Avx512Bf16), ("avx2", Path::Avx2), ("portable", Path::Portable)]
        {
            let s =
                select(ALL, Some(name), &mut || panic!("no AMX permission asked below amx"), &mut no_check)
                    .unwrap();
            assert_eq!(s, Selection { path: want, notes: vec![] }, "{name}");
        }
        // AVX-512 BF16 only by name: a refused AMX falls to AVX2.
        let refused = select(ALL, Some("amx"), &mut || Err("errno 22".into()), &mut no_check).unwrap();
        assert_eq!(refused.path, Path::Avx2);
        assert_eq!(refused.notes.len(), 1);
        assert!(
            refused.notes[0].contains("did not permit") && refused.notes[0].contains("errno 22"),
            "{refused:?}"
        );
        let no512 = Features { avx512bf16: false, ..ALL };
        assert_eq!(
            select(no512, Some("amx"), &mut || Err("no".into()), &mut no_check).unwrap().path,
            Path::Avx2
        );
        let up = select(AVX2, Some("amx"), &mut || panic!("the CPU has no AMX"), &mut no_check).unwrap();
        assert_eq!(up.path, Path::Avx2);
        assert!(up.notes[0].contains("STAPO_CPU_PATH=amx: not supported"), "{up:?}");
        let none = Features { avx2_fma: false, ..AVX2 };
        assert_eq!(select(none, Some("avx2"), &mut || Ok(()), &mut no_check).unwrap().path, Path::Portable);
        assert_eq!(select(AVX2, Some(" "), &mut || Ok(()), &mut no_check).unwrap().path, Path::Avx2);
        let err = select(AVX2, Some("avx9"), &mut || Ok(()), &mut no_check).unwrap_err();
        assert!(
            err.contains("STAPO_CPU_PATH=avx9") && err.contains("amx, avx512bf16, avx2, portable"),
            "{err}"
        );
    }

    /// Unforced, an unverified path is chosen only after its self-check
    /// passes, asked once and only when it would be chosen (AMX after its
    /// permission); a failed check falls back to the next path with a note
    /// that names the failure.
    #[test]
    fn bf16_simd_unverified_paths_need_their_self_check() {
        let mut checked = Vec::new();
        let mut pass = |p: Path| -> Result<String, String> {
            checked.push(p);
            Ok("5 products".into())
        };
        let s = select(ALL, None, &mut || Ok(()), &mut pass).unwrap();
        assert_eq!(s.path, Path::Amx);
        assert_eq!(checked, [Path::Amx]);
        assert!(
            s.notes.len() == 1 && s.notes[0].contains("amx: chosen after its self-check passed"),
            "{s:?}"
        );
        assert!(
            s.notes[0].contains("5 products") && s.notes[0].contains("STAPO_CPU_PATH=avx2 opts out"),
            "{s:?}"
        );

        // AMX refused: its check is not run, and AVX-512 BF16 (only by name) is passed over.
        checked.clear();
        let mut pass = |p: Path| -> Result<String, String> {
            checked.push(p);
            Ok("ok".into())
        };
        let s = select(ALL, None, &mut || Err("errno 1".into()), &mut pass).unwrap();
        assert_eq!(s.path, Path::Avx2);
        assert!(checked.is_empty(), "{checked:?}");
        assert_eq!(s.notes.len(), 1, "{s:?}");

        // AMX fails its check: avx2, with a note naming the failure.
        let mut fail = |p: Path| -> Result<String, String> { Err(format!("{} off by 0.5", p.name())) };
        let s = select(ALL, None, &mut || Ok(()), &mut fail).unwrap();
        assert_eq!(s.path, Path::Avx2);
        assert_eq!(s.notes.len(), 1, "{s:?}");
        assert!(
            s.notes[0].contains("amx: its self-check FAILED") && s.notes[0].contains("amx off by 0.5"),
            "{s:?}"
        );

        // A CPU without them asks nothing.
        assert_eq!(select(AVX2, None, &mut || panic!("no AMX"), &mut no_check).unwrap().path, Path::Avx2);
    }

    /// This process's path is the selection on this CPU (no AMX path without
    /// the CPU's AMX), and the real permission request fails on a CPU
    /// without AMX rather than crashing.
    #[test]
    fn bf16_simd_selection_on_this_cpu() {
        println!("{}", describe());
        let p = cpu_path();
        assert!(supported_paths().contains(&p), "{p:?}");
        if !features().amx_bf16 {
            assert_ne!(p, Path::Amx);
            assert!(request_amx().is_err());
            assert!(!amx_ready());
        }
    }
}
