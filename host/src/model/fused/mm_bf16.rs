//! `y = x w^T` on the CPU's bf16 dot-product units: AMX tiles (`tdpbf16ps`)
//! or AVX-512 BF16 (`vdpbf16ps`), both rounding `x` to bf16 (round to nearest
//! even) and accumulating pairs of bf16 products in f32, as PyTorch's autocast
//! and oneDNN do. These serve the large, compute-bound products (training,
//! prefill); decoding a few rows stays on the f32-activation gemv of
//! [`super::simd`], which is bound by reading the weights.
//!
//! Error bound: bf16 keeps 8 significant bits, so rounding `x` to nearest
//! costs at most half an ulp, `2^-8 |x|`, per element (at `x = 1 + 2^-8`),
//! and `|y - x w^T| <= (2^-8 + k 2^-23) Σ|x_c w_c|` per output (the second
//! term the f32 accumulation); [`tolerance`] states it and the tests and the
//! self-check (`stapo bench kernels`) hold every path to it.
//!
//! AMX layout (Intel SDM, `TDPBF16PS`): a tile is at most 16 rows of 64
//! bytes. `C (16×16 f32) += A (16×32 bf16) · B`, where B's row `r` holds, for
//! each of 16 output columns `j`, the pair `(b[2r][j], b[2r+1][j])` ("VNNI"
//! layout). For `x w^T`, B's row `r`, column `j` is `w[j][2r..2r+2]`, two
//! adjacent weights of one row: `pack_b` gathers them. The kernel keeps a
//! 32×32 block of `y` in four C tiles (`tmm0..3`), loads two A (`tmm4, 5`)
//! and two B tiles (`tmm6, 7`) per 32 columns of `k`, as oneDNN's and
//! llama.cpp's AMX kernels do. The instructions are written with `asm!`
//! (stable Rust has no AMX intrinsics); the same driver runs on an emulated
//! tile unit in the tests, so packing, padding and edges are checked on any
//! CPU, and only the instructions themselves need an AMX machine.

use half::bf16;
use rayon::prelude::*;

use super::cpu::{Path, Weight};
use super::SendPtr;

/// The error bound of a bf16-input path relative to `Σ|x_c w_c|` (see the
/// module note), for depth `k`; `round_x` false: the f32-activation paths.
pub fn tolerance(k: usize, round_x: bool) -> f64 {
    let acc = k as f64 * 2f64.powi(-23);
    if round_x {
        2f64.powi(-8) + acc
    } else {
        acc
    }
}

/// `y (n×o) = x (n×k) · w (o×k)^T`, row-major, on `path`, which must be
/// [`Path::Amx`] or [`Path::Avx512Bf16`] and supported (and, for AMX,
/// permitted) on this CPU: [`super::simd::cpu_path`] is such a path.
///
/// # Panics
/// On another path, or if the buffers are smaller than the shape.
pub(crate) fn xwt<W: Weight>(path: Path, x: &[f32], w: &[W], (n, o, k): (usize, usize, usize)) -> Vec<f32> {
    assert!(x.len() >= n * k && w.len() >= o * k, "mm_bf16: buffers smaller than ({n}, {o}, {k})");
    let mut y = vec![0f32; n * o];
    if n == 0 || o == 0 {
        return y;
    }
    match path {
        #[cfg(target_arch = "x86_64")]
        Path::Amx => {
            assert!(super::cpu::amx_ready(), "mm_bf16: AMX is not available (CPU or kernel permission)");
            amx_driver::<amx::Hw, W>(x, w, &mut y, (n, o, k));
        }
        #[cfg(target_arch = "x86_64")]
        Path::Avx512Bf16 => {
            assert!(super::cpu::features().avx512bf16, "mm_bf16: this CPU has no AVX-512 BF16");
            avx512::run(x, w, &mut y, (n, o, k));
        }
        p => panic!("mm_bf16: {} is not a bf16 dot-product path", p.name()),
    }
    y
}

/// The products [`verify`] checks, `(n, o, k)`: ragged against every tile
/// (AMX's 16 × 16 × 32, AVX-512 BF16's 4 × 4 register tiles of 32 lanes),
/// whole tiles, a long depth and an empty one.
pub const VERIFY_SHAPES: [(usize, usize, usize); 6] =
    [(1, 1, 1), (3, 17, 33), (32, 32, 64), (37, 45, 1030), (97, 130, 95), (5, 7, 0)];

/// A product `y (n×o) = x (n×k) · w (o×k)^T` under check, for bf16 and for
/// f32 weights.
pub(crate) type Product<'a, W> = &'a dyn Fn(&[f32], &[W], (usize, usize, usize)) -> Vec<f32>;

/// The self-check a path of [`super::simd::UNVERIFIED`] passes on this CPU before
/// [`super::simd::selection`] chooses it by default: its bf16 products
/// (`xwt`) on [`VERIFY_SHAPES`], with bf16 weights and with f32
/// weights, against f64 within [`tolerance`] (the checks of `stapo
/// bench kernels`, [`super::selfcheck`], on small shapes: a few milliseconds). Ok: a summary for
/// the log; Err: the first product out of its bound.
///
/// It runs on a one-thread pool of its own: it runs while the process's path
/// is being chosen, which threads of the global pool may be waiting for.
///
/// # Errors
/// A product out of its bound (or not finite), or `path` is not a bf16
/// dot-product path this CPU supports (and, for AMX, permits).
pub fn verify(path: Path) -> Result<String, String> {
    if !(path.bf16_dot() && super::cpu::ready(path)) {
        return Err(format!("{}: no bf16 dot products to check on this CPU", path.name()));
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .map_err(|e| format!("{}: no thread for the self-check ({e})", path.name()))?;
    pool.install(|| check(&|x, w: &[bf16], s| xwt(path, x, w, s), &|x, w: &[f32], s| xwt(path, x, w, s)))
}

/// [`verify`]'s checks of a product, for bf16 weights (`bf`) and f32 weights
/// (`wide`: the same values, widened, so the reference is the same).
pub(crate) fn check(bf: Product<'_, bf16>, wide: Product<'_, f32>) -> Result<String, String> {
    let mut seed = 0x5e1f_u64;
    let mut worst = 0f64;
    for (n, o, k) in VERIFY_SHAPES {
        let x: Vec<f32> = (0..n * k).map(|_| rnd(&mut seed) as f32).collect();
        let w: Vec<bf16> = (0..o * k).map(|_| bf16::from_f64(rnd(&mut seed))).collect();
        let wf = super::cpu::widen(&w);
        let tol = tolerance(k, true);
        let refs: Vec<(Vec<f64>, Vec<f64>)> = (0..n).map(|i| reference(&x, &w, i, o, k)).collect();
        for (weights, y) in [("bf16", bf(&x, &w, (n, o, k))), ("f32", wide(&x, &wf, (n, o, k)))] {
            if y.len() != n * o {
                return Err(format!(
                    "{weights} weights, {n} x {o} x {k}: {} outputs, not {}",
                    y.len(),
                    n * o
                ));
            }
            let mut err = 0f64;
            for (i, (s, a)) in refs.iter().enumerate() {
                for j in 0..o {
                    let e = (y[i * o + j] as f64 - s[j]).abs() / a[j].max(f64::MIN_POSITIVE);
                    err = if err.is_nan() || e.is_nan() { f64::NAN } else { err.max(e) };
                }
            }
            if err.is_nan() || err > tol {
                return Err(format!(
                    "{weights} weights, {n} x {o} x {k}: relative error {err:.3e} beyond the bound {tol:.3e}"
                ));
            }
            worst = worst.max(err / tol);
        }
    }
    Ok(format!("{} products against f64, the worst at {worst:.2} of its bound", 2 * VERIFY_SHAPES.len()))
}

/// Row `i` of `x w^T` in f64, and `Σ|x_c w_c|` per output.
pub(crate) fn reference(x: &[f32], w: &[bf16], i: usize, o: usize, k: usize) -> (Vec<f64>, Vec<f64>) {
    let xr = &x[i * k..(i + 1) * k];
    (0..o)
        .map(|j| {
            let (mut s, mut a) = (0f64, 0f64);
            for (xv, wv) in xr.iter().zip(&w[j * k..(j + 1) * k]) {
                let p = *xv as f64 * wv.to_f64();
                s += p;
                a += p.abs();
            }
            (s, a)
        })
        .unzip()
}

/// Uniform in [-0.5, 0.5) from a 64-bit LCG.
pub(crate) fn rnd(seed: &mut u64) -> f64 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    ((*seed >> 33) as f64 / (1u64 << 31) as f64) - 0.5
}

/// Elements of one packed tile: 16 rows of 32 bf16.
const TILE: usize = 512;
/// Rows (of `x`) and columns (of `y`) of one C tile.
const T16: usize = 16;
/// Columns of `k` per A tile.
const K32: usize = 32;

/// `x` (n×k f32) as bf16 A tiles: row block `rb` (16 rows, `rbs` of them,
/// an even count) and k block `kb` (32 columns) at `(rb * kbs + kb) * 512`,
/// zero-padded.
fn pack_a(x: &[f32], n: usize, k: usize, rbs: usize, kbs: usize) -> Vec<bf16> {
    let mut a = vec![bf16::ZERO; rbs * kbs * TILE];
    a.par_chunks_mut(kbs * TILE).enumerate().for_each(|(rb, blk)| pack_a_block(x, n, k, rb, blk));
    a
}

/// Row block `rb` of [`pack_a`] into `blk` (its `kbs` tiles, zeroed before).
fn pack_a_block(x: &[f32], n: usize, k: usize, rb: usize, blk: &mut [bf16]) {
    for r in 0..T16 {
        let i = rb * T16 + r;
        if i >= n {
            break;
        }
        for (c, v) in x[i * k..(i + 1) * k].iter().enumerate() {
            blk[(c / K32) * TILE + r * K32 + c % K32] = bf16::from_f32(*v);
        }
    }
}

/// `w` (o×k) as bf16 B tiles in the VNNI layout: column block `cb` (16 rows
/// of `w`, `cbs` of them, an even count) and k block `kb` at
/// `(cb * kbs + kb) * 512`; within a tile, element `(r, j, p)` at
/// `r * 32 + 2 j + p` is `w[cb*16 + j][kb*32 + 2r + p]`, zero-padded.
fn pack_b<W: Weight>(w: &[W], o: usize, k: usize, cbs: usize, kbs: usize) -> Vec<bf16> {
    let mut b = vec![bf16::ZERO; cbs * kbs * TILE];
    b.par_chunks_mut(kbs * TILE).enumerate().for_each(|(cb, blk)| pack_b_block(w, o, k, cb, blk));
    b
}

/// Column block `cb` of [`pack_b`] into `blk` (its `kbs` tiles, zeroed before).
fn pack_b_block<W: Weight>(w: &[W], o: usize, k: usize, cb: usize, blk: &mut [bf16]) {
    for j in 0..T16 {
        let row = cb * T16 + j;
        if row >= o {
            break;
        }
        for (c, v) in w[row * k..(row + 1) * k].iter().enumerate() {
            let (kb, cc) = (c / K32, c % K32);
            blk[kb * TILE + (cc / 2) * K32 + 2 * j + cc % 2] = v.bf16();
        }
    }
}

/// The tile unit the AMX driver runs on: the hardware ([`amx::Hw`]) or the
/// emulation of the tests.
trait Tiles: Default {
    /// Configures the unit (all eight tiles 16 rows × 64 bytes).
    ///
    /// # Safety
    /// The unit exists (AMX permitted on this CPU).
    unsafe fn begin(&mut self);
    /// Zeroes the four C tiles.
    unsafe fn zero(&mut self);
    /// `C[2a+b] += A[a] · B[b]` for A tiles at `a0`, `a1` and B tiles at `b0`,
    /// `b1` (each 512 contiguous bf16).
    ///
    /// # Safety
    /// Each pointer addresses 512 readable bf16.
    unsafe fn dot(&mut self, a0: *const bf16, a1: *const bf16, b0: *const bf16, b1: *const bf16);
    /// Stores the four C tiles as one 32×32 row-major block.
    unsafe fn store(&mut self, c: &mut [f32; 1024]);
    /// Releases the unit.
    unsafe fn end(&mut self);
}

/// C blocks (32 columns of `y`) per rayon task.
const CBLOCKS_PER_TASK: usize = 4;

/// The blocking of an `(n, o, k)` product on the tile unit.
#[derive(Clone, Copy)]
struct Blocks {
    /// Row blocks of 16 rows of `x` (even).
    rbs: usize,
    /// Column blocks of 16 rows of `w` (even).
    cbs: usize,
    /// Blocks of 32 columns of `k`.
    kbs: usize,
    /// Tasks per pair of row blocks.
    col_tasks: usize,
}

impl Blocks {
    fn new(n: usize, o: usize, k: usize) -> Blocks {
        let cbs = o.div_ceil(T16).next_multiple_of(2);
        Blocks {
            rbs: n.div_ceil(T16).next_multiple_of(2),
            cbs,
            kbs: k.div_ceil(K32),
            col_tasks: (cbs / 2).div_ceil(CBLOCKS_PER_TASK),
        }
    }

    /// Tasks of 32 rows × up to `32 × CBLOCKS_PER_TASK` columns of `y`.
    fn tasks(&self) -> usize {
        self.rbs / 2 * self.col_tasks
    }
}

/// The AMX product over packed tiles, in tasks of 32 rows × up to
/// `32 × CBLOCKS_PER_TASK` columns of `y`.
fn amx_driver<U: Tiles, W: Weight>(x: &[f32], w: &[W], y: &mut [f32], (n, o, k): (usize, usize, usize)) {
    let bl = Blocks::new(n, o, k);
    if bl.kbs == 0 {
        // An empty sum (and no tiles to pack: chunks of zero length).
        y[..n * o].fill(0.0);
        return;
    }
    let (a, b) = rayon::join(|| pack_a(x, n, k, bl.rbs, bl.kbs), || pack_b(w, o, k, bl.cbs, bl.kbs));
    let yp = SendPtr(y.as_mut_ptr());
    (0..bl.tasks()).into_par_iter().for_each(|t| {
        let y = yp;
        // SAFETY: the caller checked that the unit exists; a and b are packed
        // for bl; y holds n × o; tasks write disjoint blocks of y.
        unsafe { amx_task::<U>(&a, &b, y.0, (n, o, k), bl, t) }
    });
}

/// [`xwt`] on the tests' emulated tile unit (plain Rust, any CPU): the AMX
/// driver's packing, blocking and copy-out, for other modules' tests.
#[cfg(test)]
pub(crate) fn xwt_emulated<W: Weight>(x: &[f32], w: &[W], (n, o, k): (usize, usize, usize)) -> Vec<f32> {
    assert!(x.len() >= n * k && w.len() >= o * k, "mm_bf16: buffers smaller than ({n}, {o}, {k})");
    let mut y = vec![0f32; n * o];
    if n > 0 && o > 0 {
        amx_driver::<tests::Emulated, W>(x, w, &mut y, (n, o, k));
    }
    y
}

/// Task `t` of [`amx_driver`]: rows `32 r2..` and the columns of its C blocks.
///
/// # Safety
/// The unit exists; `a` and `b` are packed for `bl`; `y` holds `n × o` floats
/// and no other task writes this task's block.
unsafe fn amx_task<U: Tiles>(
    a: &[bf16],
    b: &[bf16],
    y: *mut f32,
    (n, o, _): (usize, usize, usize),
    bl: Blocks,
    t: usize,
) {
    let (r2, ct) = (t / bl.col_tasks, t % bl.col_tasks);
    let kbs = bl.kbs;
    let mut unit = U::default();
    let mut c = [0f32; 1024];
    // The tile pointers address whole packed tiles (rbs, cbs even; kbs blocks
    // each); this task writes rows 32 r2.. and columns of its own blocks only.
    unit.begin();
    for c2 in ct * CBLOCKS_PER_TASK..((ct + 1) * CBLOCKS_PER_TASK).min(bl.cbs / 2) {
        unit.zero();
        let at = |blk: usize, kb: usize| (blk * kbs + kb) * TILE;
        for kb in 0..kbs {
            unit.dot(
                a.as_ptr().add(at(2 * r2, kb)),
                a.as_ptr().add(at(2 * r2 + 1, kb)),
                b.as_ptr().add(at(2 * c2, kb)),
                b.as_ptr().add(at(2 * c2 + 1, kb)),
            );
        }
        unit.store(&mut c);
        let (i0, j0) = (r2 * 2 * T16, c2 * 2 * T16);
        for r in 0..(2 * T16).min(n.saturating_sub(i0)) {
            let cols = (2 * T16).min(o - j0);
            std::ptr::copy_nonoverlapping(c[r * 32..].as_ptr(), y.add((i0 + r) * o + j0), cols);
        }
    }
    unit.end();
}

#[cfg(target_arch = "x86_64")]
mod amx {
    use std::arch::asm;

    use half::bf16;

    /// The `ldtilecfg` operand: palette 1, tiles 0..8 of 16 rows × 64 bytes.
    #[repr(C, align(64))]
    struct Config([u8; 64]);

    const CONFIG: Config = {
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut t = 0;
        while t < 8 {
            c[16 + 2 * t] = 64; // colsb[t] (u16, little-endian)
            c[48 + t] = 16; // rows[t]
            t += 1;
        }
        Config(c)
    };

    /// The AMX tile unit (`tmm0..3`: C; `tmm4, 5`: A; `tmm6, 7`: B).
    #[derive(Default)]
    pub struct Hw;

    impl super::Tiles for Hw {
        unsafe fn begin(&mut self) {
            asm!("ldtilecfg [{}]", in(reg) &CONFIG as *const Config, options(nostack, readonly));
        }

        unsafe fn zero(&mut self) {
            asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
        }

        unsafe fn dot(&mut self, a0: *const bf16, a1: *const bf16, b0: *const bf16, b1: *const bf16) {
            asm!(
                "tileloadd tmm4, [{a0} + {s}*1]",
                "tileloadd tmm5, [{a1} + {s}*1]",
                "tileloadd tmm6, [{b0} + {s}*1]",
                "tileloadd tmm7, [{b1} + {s}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) a0,
                a1 = in(reg) a1,
                b0 = in(reg) b0,
                b1 = in(reg) b1,
                s = in(reg) 64usize,
                options(nostack, readonly)
            );
        }

        unsafe fn store(&mut self, c: &mut [f32; 1024]) {
            let p = c.as_mut_ptr();
            // C[0] rows 0..16 cols 0..16, C[1] cols 16..32, C[2], C[3] rows 16..32.
            asm!(
                "tilestored [{c0} + {s}*1], tmm0",
                "tilestored [{c1} + {s}*1], tmm1",
                "tilestored [{c2} + {s}*1], tmm2",
                "tilestored [{c3} + {s}*1], tmm3",
                c0 = in(reg) p,
                c1 = in(reg) p.add(16),
                c2 = in(reg) p.add(16 * 32),
                c3 = in(reg) p.add(16 * 32 + 16),
                s = in(reg) 128usize,
                options(nostack)
            );
        }

        unsafe fn end(&mut self) {
            asm!("tilerelease", options(nostack, nomem));
        }
    }

    /// `rounds` × 4 `tdpbf16ps` on register tiles (the roofline probe; the
    /// tiles hold whatever `data` holds).
    ///
    /// # Safety
    /// AMX is permitted; `data` holds 512 bf16.
    pub unsafe fn spin(data: &[bf16; 512], rounds: u64) {
        use super::Tiles;
        let mut hw = Hw;
        hw.begin();
        hw.zero();
        let p = data.as_ptr();
        hw.dot(p, p, p, p);
        asm!(
            "2:",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "dec {n}",
            "jnz 2b",
            n = inout(reg) rounds.max(1) => _,
            options(nostack, nomem)
        );
        hw.end();
    }
}

/// FLOPs of one `tdpbf16ps` (16 × 16 outputs, 32 products each, FMA = 2).
pub const AMX_FLOPS_PER_OP: f64 = 16.0 * 16.0 * 32.0 * 2.0;
/// FLOPs of one 512-bit `vdpbf16ps` (16 lanes, 2 products each, FMA = 2).
pub const AVX512BF16_FLOPS_PER_OP: f64 = 16.0 * 2.0 * 2.0;

/// Runs `rounds` × 4 `tdpbf16ps` on this thread (roofline probe); false
/// where AMX is not available.
pub fn amx_spin(rounds: u64) -> bool {
    #[cfg(target_arch = "x86_64")]
    if super::cpu::amx_ready() {
        let data = [bf16::from_f32(1e-3); 512];
        // SAFETY: amx_ready: the CPU has AMX and the kernel permits it.
        unsafe { amx::spin(&data, rounds) };
        return true;
    }
    let _ = rounds;
    false
}

/// Runs `rounds` × 8 independent `vdpbf16ps` on this thread (roofline
/// probe); false where AVX-512 BF16 is absent.
pub fn avx512bf16_spin(rounds: u64) -> bool {
    #[cfg(target_arch = "x86_64")]
    if super::cpu::features().avx512bf16 {
        // SAFETY: the CPU has AVX-512 BF16, BW and F.
        unsafe { avx512::spin(rounds) };
        return true;
    }
    let _ = rounds;
    false
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use half::bf16;
    use rayon::prelude::*;

    use super::super::cpu::Weight;
    use super::super::SendPtr;

    /// Rows of `x` and of `w` per register tile (16 accumulators).
    const R: usize = 4;
    const C: usize = 4;
    /// Rows of `x` and of `w` per rayon task (both stay in L2).
    const BLOCK: usize = 64;

    /// `y = x w^T` with `x` rounded to bf16 and `w` as bf16, `vdpbf16ps`.
    pub fn run<W: Weight>(x: &[f32], w: &[W], y: &mut [f32], (n, o, k): (usize, usize, usize)) {
        let xb: Vec<bf16> = x[..n * k].par_iter().map(|v| bf16::from_f32(*v)).collect();
        let wb: std::borrow::Cow<'_, [bf16]> = match W::as_bf16(&w[..o * k]) {
            Some(s) => std::borrow::Cow::Borrowed(s),
            None => w[..o * k].par_iter().map(|v| v.bf16()).collect::<Vec<_>>().into(),
        };
        let yp = SendPtr(y.as_mut_ptr());
        (0..tasks(n, o)).into_par_iter().for_each(|t| {
            let y = yp;
            // SAFETY: the caller checked avx512bf16 (with avx512bw, f); the
            // task writes its own block of y only.
            unsafe { task(&xb, &wb, y.0, (n, o, k), t) }
        });
    }

    /// Tasks of [`run`]: blocks of `BLOCK × BLOCK` of `y`.
    pub(super) fn tasks(n: usize, o: usize) -> usize {
        n.div_ceil(BLOCK) * o.div_ceil(BLOCK)
    }

    /// Task `t` of [`run`] on bf16 `x` (n×k) and `w` (o×k).
    ///
    /// # Safety
    /// The CPU has AVX-512 BF16, BW and F; `x`, `w` hold `n k`, `o k` values,
    /// `y` holds `n o` floats and no other task writes this task's block.
    pub(super) unsafe fn task(
        x: &[bf16],
        w: &[bf16],
        y: *mut f32,
        (n, o, k): (usize, usize, usize),
        t: usize,
    ) {
        let ob = o.div_ceil(BLOCK);
        let (i0, j0) = ((t / ob) * BLOCK, (t % ob) * BLOCK);
        let (i1, j1) = ((i0 + BLOCK).min(n), (j0 + BLOCK).min(o));
        block(x, w, y, (o, k), (i0, i1), (j0, j1))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn block(
        x: &[bf16],
        w: &[bf16],
        y: *mut f32,
        (o, k): (usize, usize),
        (i0, i1): (usize, usize),
        (j0, j1): (usize, usize),
    ) {
        let mut j = j0;
        while j < j1 {
            let c = (j1 - j).min(C);
            let mut i = i0;
            while i < i1 {
                let r = (i1 - i).min(R);
                let t = (x.as_ptr().add(i * k), w.as_ptr().add(j * k), y.add(i * o + j), o, k);
                match (r, c) {
                    (4, 4) => tile::<4, 4>(t),
                    (4, 3) => tile::<4, 3>(t),
                    (4, 2) => tile::<4, 2>(t),
                    (4, _) => tile::<4, 1>(t),
                    (3, 4) => tile::<3, 4>(t),
                    (3, 3) => tile::<3, 3>(t),
                    (3, 2) => tile::<3, 2>(t),
                    (3, _) => tile::<3, 1>(t),
                    (2, 4) => tile::<2, 4>(t),
                    (2, 3) => tile::<2, 3>(t),
                    (2, 2) => tile::<2, 2>(t),
                    (2, _) => tile::<2, 1>(t),
                    (_, 4) => tile::<1, 4>(t),
                    (_, 3) => tile::<1, 3>(t),
                    (_, 2) => tile::<1, 2>(t),
                    _ => tile::<1, 1>(t),
                }
                i += r;
            }
            j += c;
        }
    }

    /// `rounds` × 8 independent `vdpbf16ps` (the roofline probe).
    ///
    /// # Safety
    /// The CPU has AVX-512 BF16, BW and F.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn spin(rounds: u64) {
        let a: __m512bh = std::mem::transmute(_mm512_set1_epi16(0x3a83));
        let b: __m512bh = std::mem::transmute(_mm512_set1_epi16(std::hint::black_box(0x3a83)));
        let mut acc = [_mm512_setzero_ps(); 8];
        for _ in 0..rounds {
            for s in acc.iter_mut() {
                *s = _mm512_dpbf16_ps(*s, a, b);
            }
        }
        let mut t = _mm512_setzero_ps();
        for s in acc {
            t = _mm512_add_ps(t, s);
        }
        std::hint::black_box(_mm512_reduce_add_ps(t));
    }

    /// Rows `x..x+RR·k` against weight rows `w..w+CC·k` into `y` (row stride `o`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn tile<const RR: usize, const CC: usize>(
        (x, w, y, o, k): (*const bf16, *const bf16, *mut f32, usize, usize),
    ) {
        let mut acc = [[_mm512_setzero_ps(); CC]; RR];
        let mut c = 0;
        while c < k {
            // The last step loads the tail under a mask (zeros beyond k).
            let m: __mmask32 = if k - c >= 32 { !0 } else { (1u32 << (k - c)) - 1 };
            let mut wv = [_mm512_setzero_si512(); CC];
            for (b, v) in wv.iter_mut().enumerate() {
                *v = _mm512_maskz_loadu_epi16(m, w.add(b * k + c) as *const i16);
            }
            for (a, row) in acc.iter_mut().enumerate() {
                let xv: __m512bh =
                    std::mem::transmute(_mm512_maskz_loadu_epi16(m, x.add(a * k + c) as *const i16));
                for (b, s) in row.iter_mut().enumerate() {
                    *s = _mm512_dpbf16_ps(*s, xv, std::mem::transmute::<__m512i, __m512bh>(wv[b]));
                }
            }
            c += 32;
        }
        for (a, row) in acc.iter().enumerate() {
            for (b, s) in row.iter().enumerate() {
                *y.add(a * o + b) = _mm512_reduce_add_ps(*s);
            }
        }
    }
}

/// Entry points that run whole products on the kernels' machine code in an
/// x86 emulator (`docs/bench/emu_bf16_kernels.sh`): the packing, the task
/// loops and the AMX or AVX-512 BF16 instructions of `xwt`, single-threaded
/// on caller-provided buffers, with no allocation, no system call and no
/// thread, so that each call is a leaf an emulator runs without an operating
/// system. Built only with the `emu-entry` feature, as a `cdylib`.
#[cfg(all(feature = "emu-entry", target_arch = "x86_64"))]
pub mod emu_entry {
    use half::bf16;

    use super::{amx, amx_task, avx512, pack_a_block, pack_b_block, Blocks, Weight, TILE};

    /// The arguments of an entry, by one pointer (row-major buffers).
    #[repr(C)]
    pub struct Args {
        /// `x`, n × k.
        pub x: *const f32,
        /// `w`, o × k: bf16, or f32 where `w_f32` is not 0.
        pub w: *const u8,
        /// Whether `w` holds f32.
        pub w_f32: usize,
        /// `y`, n × o, written.
        pub y: *mut f32,
        /// Rows of `x` and `y`.
        pub n: usize,
        /// Rows of `w`, columns of `y`.
        pub o: usize,
        /// Columns of `x` and `w`.
        pub k: usize,
        /// Scratch space for the packed or rounded operands.
        pub scratch: *mut bf16,
        /// Length of `scratch` in bf16: `(32 ⌈n/32⌉ + 32 ⌈o/32⌉) · 32 ⌈k/32⌉`
        /// serves both entries.
        pub scratch_len: usize,
    }

    /// `y = x w^T` on the AMX tile unit (`amx::Hw`); 0, or 1 when the
    /// scratch space is too small.
    ///
    /// # Safety
    /// The CPU has AMX (and the OS permits it); `args` and its buffers are
    /// valid for their lengths.
    #[no_mangle]
    #[inline(never)]
    pub unsafe extern "C" fn stapo_emu_amx(args: *const Args) -> usize {
        let a = &*args;
        if a.w_f32 != 0 {
            amx_xwt(a, a.w as *const f32)
        } else {
            amx_xwt(a, a.w as *const bf16)
        }
    }

    unsafe fn amx_xwt<W: Weight>(a: &Args, w: *const W) -> usize {
        let (n, o, k) = (a.n, a.o, a.k);
        let bl = Blocks::new(n, o, k);
        let (la, lb) = (bl.rbs * bl.kbs * TILE, bl.cbs * bl.kbs * TILE);
        if a.scratch_len < la + lb {
            return 1;
        }
        if n == 0 || o == 0 || k == 0 {
            std::slice::from_raw_parts_mut(a.y, n * o).fill(0.0);
            return 0;
        }
        let x = std::slice::from_raw_parts(a.x, n * k);
        let w = std::slice::from_raw_parts(w, o * k);
        let s = std::slice::from_raw_parts_mut(a.scratch, la + lb);
        s.fill(bf16::ZERO);
        let (pa, pb) = s.split_at_mut(la);
        for (rb, blk) in pa.chunks_mut(bl.kbs * TILE).enumerate() {
            pack_a_block(x, n, k, rb, blk);
        }
        for (cb, blk) in pb.chunks_mut(bl.kbs * TILE).enumerate() {
            pack_b_block(w, o, k, cb, blk);
        }
        for t in 0..bl.tasks() {
            amx_task::<amx::Hw>(pa, pb, a.y, (n, o, k), bl, t);
        }
        0
    }

    /// `y = x w^T` on AVX-512 BF16 (`vdpbf16ps`); 0, or 1 when the scratch
    /// space is too small.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and BF16; `args` and its buffers are valid
    /// for their lengths.
    #[no_mangle]
    #[inline(never)]
    pub unsafe extern "C" fn stapo_emu_avx512bf16(args: *const Args) -> usize {
        let a = &*args;
        if a.w_f32 != 0 {
            avx512_xwt(a, a.w as *const f32)
        } else {
            avx512_xwt(a, a.w as *const bf16)
        }
    }

    unsafe fn avx512_xwt<W: Weight>(a: &Args, w: *const W) -> usize {
        let (n, o, k) = (a.n, a.o, a.k);
        if a.scratch_len < (n + o) * k {
            return 1;
        }
        let x = std::slice::from_raw_parts(a.x, n * k);
        let w = std::slice::from_raw_parts(w, o * k);
        let (xb, rest) = std::slice::from_raw_parts_mut(a.scratch, (n + o) * k).split_at_mut(n * k);
        // As avx512::run rounds them, on one thread.
        for (d, v) in xb.iter_mut().zip(x) {
            *d = bf16::from_f32(*v);
        }
        let wb: &[bf16] = match W::as_bf16(w) {
            Some(s) => s,
            None => {
                for (d, v) in rest.iter_mut().zip(w) {
                    *d = v.bf16();
                }
                rest
            }
        };
        for t in 0..avx512::tasks(n, o) {
            avx512::task(xb, wb, a.y, (n, o, k), t);
        }
        0
    }
}

#[cfg(test)]
mod tests {
    use super::super::cpu::widen;
    use super::*;

    /// `x w^T` as the bf16 dot-product paths compute it: `x` and `w` rounded
    /// to bf16, products summed in f32 (plus `shift` columns of `w`, and
    /// only the first `depth(k)` terms, to make it wrong).
    fn product(
        x: &[f32],
        w: &[f32],
        (n, o, k): (usize, usize, usize),
        shift: usize,
        depth: fn(usize) -> usize,
    ) -> Vec<f32> {
        let r = |v: f32| bf16::from_f32(v).to_f32();
        (0..n * o)
            .map(|ij| {
                let (i, j) = (ij / o, (ij % o + shift) % o);
                (0..depth(k)).map(|c| r(x[i * k + c]) * r(w[j * k + c])).sum()
            })
            .collect()
    }

    /// The self-check passes a right product and names the first product
    /// a wrong one gets wrong: a dropped tail of the depth, a shifted
    /// column, a NaN, a wrong output count; only for f32 weights when only
    /// those are wrong. On a path this CPU lacks it refuses to run.
    #[test]
    fn the_self_check_passes_a_right_product_and_fails_wrong_ones() {
        let all = |k: usize| k;
        let right =
            super::check(&|x, w, s| product(x, &widen(w), s, 0, all), &|x, w, s| product(x, w, s, 0, all));
        let summary = right.unwrap();
        assert!(summary.starts_with("12 products against f64"), "{summary}");

        let tail = |k: usize| k / 32 * 32;
        let e =
            super::check(&|x, w, s| product(x, &widen(w), s, 0, tail), &|x, w, s| product(x, w, s, 0, tail))
                .unwrap_err();
        assert!(e.starts_with("bf16 weights, 1 x 1 x 1: relative error 1.000e0"), "{e}");

        let e =
            super::check(&|x, w, s| product(x, &widen(w), s, 0, all), &|x, w, s| product(x, w, s, 1, all))
                .unwrap_err();
        assert!(e.starts_with("f32 weights, 3 x 17 x 33"), "{e}");

        let nan = |x: &[f32], w: &[bf16], s: (usize, usize, usize)| {
            let mut y = product(x, &widen(w), s, 0, all);
            if s == (32, 32, 64) {
                y[5] = f32::NAN;
            }
            y
        };
        let e = super::check(&nan, &|x, w, s| product(x, w, s, 0, all)).unwrap_err();
        assert!(e.starts_with("bf16 weights, 32 x 32 x 64: relative error NaN"), "{e}");

        let short = super::check(&|_, _, _| Vec::new(), &|x, w, s| product(x, w, s, 0, all)).unwrap_err();
        assert_eq!(short, "bf16 weights, 1 x 1 x 1: 0 outputs, not 1");

        if !super::super::cpu::features().avx512bf16 {
            let e = super::verify(Path::Avx512Bf16).unwrap_err();
            assert!(e.contains("no bf16 dot products to check on this CPU"), "{e}");
        }
        assert!(super::verify(Path::Avx2).is_err());
    }

    /// The AMX tile unit in plain Rust, per the SDM's pseudo-code of
    /// `TDPBF16PS` (f32 products of bf16 pairs, added to C in f32).
    pub(super) struct Emulated {
        c: [[f32; 256]; 4],
        begun: bool,
    }

    impl Default for Emulated {
        fn default() -> Self {
            Emulated { c: [[0.0; 256]; 4], begun: false }
        }
    }

    impl Tiles for Emulated {
        unsafe fn begin(&mut self) {
            self.begun = true;
        }
        unsafe fn zero(&mut self) {
            self.c = [[0.0; 256]; 4];
        }
        unsafe fn dot(&mut self, a0: *const bf16, a1: *const bf16, b0: *const bf16, b1: *const bf16) {
            assert!(self.begun, "dot before begin");
            for (t, (a, b)) in [(a0, b0), (a0, b1), (a1, b0), (a1, b1)].into_iter().enumerate() {
                let (a, b) = (std::slice::from_raw_parts(a, TILE), std::slice::from_raw_parts(b, TILE));
                for m in 0..16 {
                    for nn in 0..16 {
                        let mut s = self.c[t][m * 16 + nn];
                        for r in 0..16 {
                            s += a[m * 32 + 2 * r].to_f32() * b[r * 32 + 2 * nn].to_f32();
                            s += a[m * 32 + 2 * r + 1].to_f32() * b[r * 32 + 2 * nn + 1].to_f32();
                        }
                        self.c[t][m * 16 + nn] = s;
                    }
                }
            }
        }
        unsafe fn store(&mut self, c: &mut [f32; 1024]) {
            for (t, tile) in self.c.iter().enumerate() {
                let (r0, c0) = ((t / 2) * 16, (t % 2) * 16);
                for m in 0..16 {
                    c[(r0 + m) * 32 + c0..(r0 + m) * 32 + c0 + 16]
                        .copy_from_slice(&tile[m * 16..m * 16 + 16]);
                }
            }
        }
        unsafe fn end(&mut self) {
            self.begun = false;
        }
    }

    /// Worst `|y - x w^T| / Σ|x_c w_c|` against f64 over every output.
    fn worst<W: Weight>(x: &[f32], w: &[W], y: &[f32], (n, o, k): (usize, usize, usize)) -> f64 {
        let mut e = 0f64;
        for i in 0..n {
            for j in 0..o {
                let (mut s, mut a) = (0f64, 0f64);
                for c in 0..k {
                    let p = x[i * k + c] as f64 * w[j * k + c].f32() as f64;
                    s += p;
                    a += p.abs();
                }
                e = e.max((y[i * o + j] as f64 - s).abs() / a.max(f64::MIN_POSITIVE));
            }
        }
        e
    }

    /// The AMX driver (packing, VNNI layout, padding of every ragged edge,
    /// the copy-out) on the emulated tile unit, bf16 and f32 weights, against
    /// f64 within [`tolerance`]; and the hardware paths this CPU has.
    #[test]
    fn bf16_amx_driver_emulated_matches_f64() {
        let mut seed = 11u64;
        for &(n, o, k) in
            &[(1, 1, 1), (16, 16, 32), (17, 33, 33), (5, 130, 64), (40, 70, 100), (33, 31, 95), (3, 5, 0)]
        {
            let x: Vec<f32> = (0..n * k).map(|_| rnd(&mut seed) as f32).collect();
            let w: Vec<bf16> = (0..o * k).map(|_| bf16::from_f64(rnd(&mut seed))).collect();
            let wf: Vec<f32> = (0..o * k).map(|_| rnd(&mut seed) as f32).collect();
            let mut y = vec![f32::NAN; n * o];
            amx_driver::<Emulated, bf16>(&x, &w, &mut y, (n, o, k));
            let e = worst(&x, &w, &y, (n, o, k));
            assert!(e <= tolerance(k, true), "emulated amx ({n},{o},{k}): {e}");
            // f32 weights round to bf16 too: against the rounded weights.
            amx_driver::<Emulated, f32>(&x, &wf, &mut y, (n, o, k));
            let wr: Vec<bf16> = wf.iter().map(|v| bf16::from_f32(*v)).collect();
            let e = worst(&x, &wr, &y, (n, o, k));
            assert!(e <= tolerance(k, true), "emulated amx, f32 w ({n},{o},{k}): {e}");
            for p in crate::model::fused::simd::supported_paths() {
                if matches!(p, Path::Amx | Path::Avx512Bf16) {
                    let y = xwt(p, &x, &w, (n, o, k));
                    let e = worst(&x, &w, &y, (n, o, k));
                    assert!(e <= tolerance(k, true), "{} ({n},{o},{k}): {e}", p.name());
                }
            }
        }
    }

    /// The bound covers the worst rounding of `x`: just past `1 + 2^-8`, half
    /// an ulp of bf16 (relative error just under `2^-8`, twice what a bound of
    /// `2^-9` allowed; a single product shows it whole). Found by running the
    /// kernels' machine code in an emulator (docs/bench/emu_bf16_kernels.sh).
    #[test]
    fn bf16_bound_covers_half_an_ulp() {
        for x in [1.0 + 2f32.powi(-8) + 2f32.powi(-20), 1.0 + 2f32.powi(-8) - 2f32.powi(-20)] {
            let w = [bf16::ONE];
            let mut y = [f32::NAN];
            amx_driver::<Emulated, bf16>(&[x], &w, &mut y, (1, 1, 1));
            let e = worst(&[x], &w, &y, (1, 1, 1));
            assert!(e > 2f64.powi(-9) && e <= tolerance(1, true), "{x}: {e}");
        }
    }

    /// Rounding `x` is what the bound pays for: a bf16-exact `x` makes the
    /// emulated product agree with f64 to the f32 accumulation bound alone.
    #[test]
    fn bf16_amx_emulated_exact_inputs() {
        let mut seed = 5u64;
        let (n, o, k) = (20, 18, 70);
        let x: Vec<f32> = (0..n * k).map(|_| bf16::from_f64(rnd(&mut seed)).to_f32()).collect();
        let w: Vec<bf16> = (0..o * k).map(|_| bf16::from_f64(rnd(&mut seed))).collect();
        let mut y = vec![0f32; n * o];
        amx_driver::<Emulated, bf16>(&x, &w, &mut y, (n, o, k));
        let e = worst(&x, &w, &y, (n, o, k));
        assert!(e <= tolerance(k, false), "{e}");
    }
}
