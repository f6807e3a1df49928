//! The project's own CUDA kernels ([`super::cuda`], `model/cuda/*.cu`) as
//! candle custom ops: RMSNorm (alone and after the residual add), SwiGLU,
//! per-head RMSNorm + rotary embedding (for the queries, and for the keys
//! fused with the write of keys and values into the paged cache), the
//! log-softmax statistics of the update (forward and backward) and
//! on-device sampling. Each is compiled at run time by NVRTC (once per
//! process), as [`super::paged_cuda`] is, and each is checked on the CPU
//! against the CPU path by the `cuda-cpu` harness (docs/cuda.md).
//!
//! The inference ops (norms, SwiGLU, rope, the cache write, sampling) serve
//! tensors that carry no gradient ([`serves`]); a training forward keeps the
//! composed ops, whose backward candle derives. The log-softmax statistics
//! have their own backward kernel and serve the update too.

use std::ops::Deref;
use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda::cudarc::nvrtc;
use candle_core::cuda::{CudaDType, CudaDevice, CudaStorage, CudaStorageSlice, WrapErr};
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, InplaceOp1, Layout, Shape, Storage, Tensor,
};
use half::bf16;

use super::cuda as src;
pub use super::cuda::SampleParams;
use crate::{Error, Result};

/// One kernel source ([`src::Source`]): its module in candle's device and
/// its PTX, compiled once per process by NVRTC with [`src::NVRTC_OPTIONS`]
/// (no GPU needed to compile; `.ci/cuda-check --check` compiles the same
/// text with the same options and runs ptxas over it).
pub struct Module {
    source: &'static src::Source,
    ptx: OnceLock<std::result::Result<String, String>>,
}

impl Module {
    const fn new(source: &'static src::Source) -> Self {
        Self { source, ptx: OnceLock::new() }
    }

    /// The module's name in candle's device.
    pub fn name(&self) -> &'static str {
        self.source.module
    }

    /// The PTX of the source.
    pub fn ptx(&self) -> Result<&str> {
        self.ptx
            .get_or_init(|| {
                let opts = nvrtc::CompileOptions {
                    options: src::NVRTC_OPTIONS.iter().map(|o| o.to_string()).collect(),
                    ..Default::default()
                };
                nvrtc::compile_ptx_with_opts(self.source.text, opts)
                    .map(|p| p.to_src())
                    .map_err(|e| format!("NVRTC could not compile it: {e:?}"))
            })
            .as_ref()
            .map(|s| s.as_str())
            .map_err(|e| Error::invalid(format!("CUDA kernel module {}: {e}", self.source.module)))
    }

    /// The PTX, as a candle error.
    fn ptx_or_bail(&self) -> candle_core::Result<&str> {
        self.ptx().map_err(|e| candle_core::Error::Msg(e.to_string()))
    }
}

/// Paged attention (`paged_attention.cu`, launched by [`super::paged_cuda`]).
pub static PAGED_ATTENTION: Module = Module::new(&src::PAGED_ATTENTION_SOURCE);
/// RMSNorm (`rms_norm.cu`).
pub static RMS_NORM: Module = Module::new(&src::RMS_NORM_SOURCE);
/// SwiGLU (`swiglu.cu`).
pub static SWIGLU: Module = Module::new(&src::SWIGLU_SOURCE);
/// Norm + rope and the cache write (`norm_rope.cu`).
pub static NORM_ROPE: Module = Module::new(&src::NORM_ROPE_SOURCE);
/// Log-softmax statistics (`logp_entropy.cu`).
pub static LOGP_ENTROPY: Module = Module::new(&src::LOGP_ENTROPY_SOURCE);
/// Sampling (`sample.cu`).
pub static SAMPLE: Module = Module::new(&src::SAMPLE_SOURCE);

/// Every module of this file (the NVRTC test checks each of its kernels).
pub const MODULES: [&Module; 6] = [&PAGED_ATTENTION, &RMS_NORM, &SWIGLU, &NORM_ROPE, &LOGP_ENTROPY, &SAMPLE];

/// True when the inference kernels serve `t`: a CUDA tensor in f32 or bf16
/// that carries no gradient, and `--kernels fused` (the default).
pub fn serves(t: &Tensor) -> bool {
    t.device().is_cuda()
        && matches!(t.dtype(), DType::F32 | DType::BF16)
        && !t.track_op()
        && super::fused::Kernels::current() == super::fused::Kernels::Fused
}

/// The contiguous part of `s` that `l` describes.
pub(super) fn view<'s, T>(
    s: &'s CudaSlice<T>,
    l: &Layout,
    what: &str,
) -> candle_core::Result<CudaView<'s, T>> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(s.slice(a..b)),
        None => candle_core::bail!("CUDA kernel: {what} is not contiguous"),
    }
}

/// The CUDA storage of `t` (an input the op holds rather than takes).
fn cuda_of<'t>(
    t: &'t Tensor,
    what: &str,
) -> candle_core::Result<(impl Deref<Target = Storage> + 't, &'t Layout)> {
    let (s, l) = t.storage_and_layout();
    if !matches!(&*s, Storage::Cuda(_)) {
        candle_core::bail!("CUDA kernel: {what} is not on the GPU");
    }
    Ok((s, l))
}

/// The contiguous data of a guard from [`cuda_of`], as `T`.
fn guard_view<'g, T: CudaDType, G: Deref<Target = Storage>>(
    g: &'g (G, &Layout),
    what: &str,
) -> candle_core::Result<CudaView<'g, T>> {
    view(as_cuda(&g.0).as_cuda_slice::<T>()?, g.1, what)
}

/// The `CudaStorage` inside a storage guard known to hold one.
fn as_cuda(s: &Storage) -> &CudaStorage {
    match s {
        Storage::Cuda(c) => c,
        _ => unreachable!("checked by cuda_of"),
    }
}

/// The `cpu_fwd` of a custom op of `$n` inputs that runs only on CUDA: an error.
macro_rules! cuda_only {
    (1) => {
        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
            candle_core::bail!("{}: a CUDA kernel called on the CPU (the CPU has model::fused)", self.name())
        }
    };
    (2) => {
        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> candle_core::Result<(CpuStorage, Shape)> {
            candle_core::bail!("{}: a CUDA kernel called on the CPU (the CPU has model::fused)", self.name())
        }
    };
    (3) => {
        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> candle_core::Result<(CpuStorage, Shape)> {
            candle_core::bail!("{}: a CUDA kernel called on the CPU (the CPU has model::fused)", self.name())
        }
    };
}

fn cfg(grid: (u32, u32, u32), threads: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: grid, block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

/// Launches kernel `$kernel` of `$module` on `$dev` with the arguments given.
macro_rules! launch {
    ($module:expr, $dev:expr, $kernel:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        let func = $dev.get_or_load_custom_func($kernel, $module.name(), $module.ptx_or_bail()?)?;
        let mut b = func.builder();
        $(
            // A binding, so that a temporary argument lives until the launch.
            let a = $arg;
            b.arg(a);
        )+
        // SAFETY: the arguments follow the kernel's signature (model/cuda/*.cu) and the
        // buffers hold what the launch geometry reads and writes (checked by the callers).
        unsafe { b.launch($cfg) }.w()?;
    }};
}

// ---------------------------------------------------------------- RMSNorm

struct RmsNorm {
    eps: f32,
}

impl RmsNorm {
    fn run<T: DeviceRepr + candle_core::WithDType>(
        &self,
        kernel: &str,
        (x, lx): (&CudaSlice<T>, &Layout),
        (w, lw): (&CudaSlice<T>, &Layout),
        dev: &CudaDevice,
    ) -> candle_core::Result<CudaSlice<T>> {
        let n = lw.shape().elem_count();
        let len = lx.shape().elem_count();
        if n == 0 || len % n != 0 {
            candle_core::bail!("rms_norm (CUDA): x of {:?} against a weight of {n}", lx.dims());
        }
        let (x, w) = (view(x, lx, "x")?, view(w, lw, "the weight")?);
        // SAFETY: every element is written (a block per row, every column).
        let y = unsafe { dev.alloc::<T>(len)? };
        launch!(
            RMS_NORM,
            dev,
            kernel,
            cfg(((len / n) as u32, 1, 1), src::ROW_THREADS),
            &x,
            &w,
            &y,
            &(n as i32),
            &self.eps
        );
        Ok(y)
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "cuda-rms-norm"
    }

    cuda_only!(2);

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        w: &CudaStorage,
        lw: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = x.device();
        let slice = match (&x.slice, &w.slice) {
            (CudaStorageSlice::F32(x), CudaStorageSlice::F32(w)) => {
                CudaStorageSlice::F32(self.run("rms_norm_f32", (x, lx), (w, lw), dev)?)
            }
            (CudaStorageSlice::BF16(x), CudaStorageSlice::BF16(w)) => {
                CudaStorageSlice::BF16(self.run::<bf16>("rms_norm_bf16", (x, lx), (w, lw), dev)?)
            }
            _ => candle_core::bail!(
                "rms_norm (CUDA): no kernel for {:?} with a {:?} weight",
                x.dtype(),
                w.dtype()
            ),
        };
        Ok((CudaStorage { slice, device: dev.clone() }, lx.shape().clone()))
    }
}

/// RMSNorm over the last dimension of `x` with weight `w` (same dtype).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op2_no_bwd(&w.contiguous()?, &RmsNorm { eps: eps as f32 })?)
}

struct AddRmsNorm {
    eps: f32,
}

impl AddRmsNorm {
    fn run<T: DeviceRepr + candle_core::WithDType>(
        &self,
        kernel: &str,
        (x, lx): (&CudaSlice<T>, &Layout),
        (r, lr): (&CudaSlice<T>, &Layout),
        (w, lw): (&CudaSlice<T>, &Layout),
        dev: &CudaDevice,
    ) -> candle_core::Result<CudaSlice<T>> {
        let n = lw.shape().elem_count();
        let len = lx.shape().elem_count();
        if n == 0 || len % n != 0 || lr.shape() != lx.shape() {
            candle_core::bail!("add_rms_norm (CUDA): x {:?}, r {:?}, weight of {n}", lx.dims(), lr.dims());
        }
        let (x, r, w) = (view(x, lx, "x")?, view(r, lr, "the residual")?, view(w, lw, "the weight")?);
        // SAFETY: both halves are written whole (a block per row).
        let out = unsafe { dev.alloc::<T>(2 * len)? };
        let (h, y) = (out.slice(0..len), out.slice(len..2 * len));
        launch!(
            RMS_NORM,
            dev,
            kernel,
            cfg(((len / n) as u32, 1, 1), src::ROW_THREADS),
            &x,
            &r,
            &w,
            &h,
            &y,
            &(n as i32),
            &self.eps
        );
        Ok(out)
    }
}

impl CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "cuda-add-rms-norm"
    }

    cuda_only!(3);

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        r: &CudaStorage,
        lr: &Layout,
        w: &CudaStorage,
        lw: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = x.device();
        let slice = match (&x.slice, &r.slice, &w.slice) {
            (CudaStorageSlice::F32(x), CudaStorageSlice::F32(r), CudaStorageSlice::F32(w)) => {
                CudaStorageSlice::F32(self.run("add_rms_norm_f32", (x, lx), (r, lr), (w, lw), dev)?)
            }
            (CudaStorageSlice::BF16(x), CudaStorageSlice::BF16(r), CudaStorageSlice::BF16(w)) => {
                CudaStorageSlice::BF16(self.run::<bf16>(
                    "add_rms_norm_bf16",
                    (x, lx),
                    (r, lr),
                    (w, lw),
                    dev,
                )?)
            }
            _ => candle_core::bail!("add_rms_norm (CUDA): no kernel for {:?}", x.dtype()),
        };
        Ok((CudaStorage { slice, device: dev.clone() }, Shape::from((2, lx.shape().elem_count()))))
    }
}

/// `(h, y)` with `h = x + r` (the new residual stream) and `y` the RMSNorm of
/// `h` with weight `w`, in one kernel; both shaped like `x`.
pub fn add_rms_norm(x: &Tensor, r: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let out = x.contiguous()?.apply_op3_no_bwd(
        &r.contiguous()?,
        &w.contiguous()?,
        &AddRmsNorm { eps: eps as f32 },
    )?;
    Ok((out.get(0)?.reshape(x.shape())?, out.get(1)?.reshape(x.shape())?))
}

// ---------------------------------------------------------------- SwiGLU

struct Swiglu;

impl Swiglu {
    /// `n` outputs in rows of `cols`; row `r` of the gate and of up at
    /// `r * stride` of `g` and `u` (see `swiglu.cu`).
    fn launch<T: DeviceRepr + candle_core::WithDType>(
        kernel: &str,
        (g, u): (&CudaView<'_, T>, &CudaView<'_, T>),
        (n, cols, stride): (usize, usize, usize),
        dev: &CudaDevice,
    ) -> candle_core::Result<CudaSlice<T>> {
        // SAFETY: the grid-stride loop writes every element.
        let out = unsafe { dev.alloc::<T>(n)? };
        launch!(
            SWIGLU,
            dev,
            kernel,
            cfg(src::swiglu_grid(n), src::SWIGLU_THREADS),
            g,
            u,
            &out,
            &(n as u64),
            &(cols.max(1) as u64),
            &(stride.max(1) as u64)
        );
        Ok(out)
    }

    fn run<T: DeviceRepr + candle_core::WithDType>(
        kernel: &str,
        (g, lg): (&CudaSlice<T>, &Layout),
        (u, lu): (&CudaSlice<T>, &Layout),
        dev: &CudaDevice,
    ) -> candle_core::Result<CudaSlice<T>> {
        if lg.shape() != lu.shape() {
            candle_core::bail!("swiglu (CUDA): gate {:?} against up {:?}", lg.dims(), lu.dims());
        }
        let n = lg.shape().elem_count();
        let (g, u) = (view(g, lg, "the gate")?, view(u, lu, "up")?);
        Self::launch(kernel, (&g, &u), (n, n, n), dev)
    }
}

impl CustomOp2 for Swiglu {
    fn name(&self) -> &'static str {
        "cuda-swiglu"
    }

    cuda_only!(2);

    fn cuda_fwd(
        &self,
        g: &CudaStorage,
        lg: &Layout,
        u: &CudaStorage,
        lu: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = g.device();
        let slice = match (&g.slice, &u.slice) {
            (CudaStorageSlice::F32(g), CudaStorageSlice::F32(u)) => {
                CudaStorageSlice::F32(Self::run("swiglu_f32", (g, lg), (u, lu), dev)?)
            }
            (CudaStorageSlice::BF16(g), CudaStorageSlice::BF16(u)) => {
                CudaStorageSlice::BF16(Self::run::<bf16>("swiglu_bf16", (g, lg), (u, lu), dev)?)
            }
            _ => candle_core::bail!("swiglu (CUDA): no kernel for {:?}", g.dtype()),
        };
        Ok((CudaStorage { slice, device: dev.clone() }, lg.shape().clone()))
    }
}

/// `silu(gate) * up` in one kernel.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Ok(gate.contiguous()?.apply_op2_no_bwd(&up.contiguous()?, &Swiglu)?)
}

/// SwiGLU over the rows of one product over `[Wgate; Wup]`: each row holds
/// the gate's `cols` values, then up's.
struct SwigluRows {
    cols: usize,
}

impl SwigluRows {
    fn run<T: DeviceRepr + candle_core::WithDType>(
        &self,
        kernel: &str,
        (x, lx): (&CudaSlice<T>, &Layout),
        dev: &CudaDevice,
    ) -> candle_core::Result<CudaSlice<T>> {
        let c = self.cols;
        if c == 0 || *lx.dims().last().unwrap_or(&0) != 2 * c {
            candle_core::bail!("swiglu (CUDA): rows of {:?} are not gate and up of {c}", lx.dims());
        }
        let x = view(x, lx, "the gate/up rows")?;
        let n = lx.shape().elem_count() / 2;
        // Up starts `cols` after the gate in every row.
        let Some(up) = x.try_slice(c..) else {
            candle_core::bail!("swiglu (CUDA): no rows in {:?}", lx.dims())
        };
        Swiglu::launch(kernel, (&x, &up), (n, c, 2 * c), dev)
    }
}

impl CustomOp1 for SwigluRows {
    fn name(&self) -> &'static str {
        "cuda-swiglu-rows"
    }

    cuda_only!(1);

    fn cuda_fwd(&self, x: &CudaStorage, lx: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = x.device();
        let slice = match &x.slice {
            CudaStorageSlice::F32(x) => CudaStorageSlice::F32(self.run("swiglu_f32", (x, lx), dev)?),
            CudaStorageSlice::BF16(x) => {
                CudaStorageSlice::BF16(self.run::<bf16>("swiglu_bf16", (x, lx), dev)?)
            }
            _ => candle_core::bail!("swiglu (CUDA): no kernel for {:?}", x.dtype()),
        };
        let mut dims = lx.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = self.cols;
        }
        Ok((CudaStorage { slice, device: dev.clone() }, Shape::from(dims)))
    }
}

/// `silu(gate) * up` of `gate_up` `(.., 2 * cols)`, whose rows hold the gate
/// then up (one product over `[Wgate; Wup]`), in one kernel; `(.., cols)`.
pub fn swiglu_rows(gate_up: &Tensor, cols: usize) -> Result<Tensor> {
    Ok(gate_up.contiguous()?.apply_op1_no_bwd(&SwigluRows { cols })?)
}

// ---------------------------------------------------------------- norm + rope

/// `cos`/`sin` `(B, 1, L, D/2)` as contiguous `(B * L, D/2)` tensors in `dtype`.
fn rotary_rows(cos: &Tensor, sin: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
    let (b, _, l, half) = cos.dims4()?;
    let rows =
        |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(dtype)?.reshape((b * l, half))?.contiguous()?) };
    Ok((rows(cos)?, rows(sin)?))
}

struct NormRope {
    sin: Tensor,
    dims: (usize, usize, usize, usize),
    /// Where token 0's heads start in `x`, and the distance between tokens.
    x_off: usize,
    xs: usize,
    eps: f32,
}

impl NormRope {
    fn run<T: DeviceRepr + CudaDType>(
        &self,
        kernel: &str,
        (x, lx): (&CudaSlice<T>, &Layout),
        (w, lw): (&CudaSlice<T>, &Layout),
        (c, lc): (&CudaSlice<T>, &Layout),
        dev: &CudaDevice,
    ) -> candle_core::Result<CudaSlice<T>> {
        let (b, l, h, d) = self.dims;
        let (sin_s, sin_l) = cuda_of(&self.sin, "sin")?;
        let sin = view(as_cuda(&sin_s).as_cuda_slice::<T>()?, sin_l, "sin")?;
        let (x, w, c) = (view(x, lx, "x")?, view(w, lw, "the weight")?, view(c, lc, "cos")?);
        let n = b * l;
        if n > 0 && self.x_off + (n - 1) * self.xs + h * d > x.len() {
            candle_core::bail!("norm_rope (CUDA): {n} tokens of {h} heads past the {} values of x", x.len());
        }
        let x = x.slice(self.x_off..);
        // SAFETY: a block per (token, head) writes the head's D outputs.
        let out = unsafe { dev.alloc::<T>(b * l * h * d)? };
        launch!(
            NORM_ROPE,
            dev,
            kernel,
            LaunchConfig {
                grid_dim: ((b * l) as u32, h as u32, 1),
                block_dim: (src::NORM_ROPE_THREADS, 1, 1),
                shared_mem_bytes: 0
            },
            &x,
            &w,
            &c,
            &sin,
            &out,
            &(l as i32),
            &(h as i32),
            &(d as i32),
            &(self.xs as u64),
            &self.eps
        );
        Ok(out)
    }
}

impl CustomOp3 for NormRope {
    fn name(&self) -> &'static str {
        "cuda-norm-rope"
    }

    cuda_only!(3);

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        w: &CudaStorage,
        lw: &Layout,
        c: &CudaStorage,
        lc: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = x.device();
        let slice = match (&x.slice, &w.slice, &c.slice) {
            (CudaStorageSlice::F32(x), CudaStorageSlice::F32(w), CudaStorageSlice::F32(c)) => {
                CudaStorageSlice::F32(self.run("norm_rope_f32", (x, lx), (w, lw), (c, lc), dev)?)
            }
            (CudaStorageSlice::BF16(x), CudaStorageSlice::BF16(w), CudaStorageSlice::BF16(c)) => {
                CudaStorageSlice::BF16(self.run::<bf16>("norm_rope_bf16", (x, lx), (w, lw), (c, lc), dev)?)
            }
            _ => candle_core::bail!("norm_rope (CUDA): no kernel for {:?}", x.dtype()),
        };
        let (b, l, h, d) = self.dims;
        Ok((CudaStorage { slice, device: dev.clone() }, Shape::from((b, h, l, d))))
    }
}

/// The dims `(B, L, H, D)` of a projection `x` `(B, L, H * D)` split into
/// `n_heads` heads with a norm weight `w` of `D`, checked against the kernel.
fn head_dims(x: &Tensor, n_heads: usize, w: &Tensor) -> Result<(usize, usize, usize, usize)> {
    let (b, l, hd) = x.dims3()?;
    let d = hd / n_heads.max(1);
    if n_heads * d != hd || w.elem_count() != d || !d.is_multiple_of(2) || d > src::NORM_ROPE_MAX_HEAD_DIM {
        return Err(Error::invalid(format!(
            "norm_rope (CUDA): x of shape {:?} in {n_heads} heads with a weight of {}",
            x.dims(),
            w.elem_count()
        )));
    }
    Ok((b, l, n_heads, d))
}

/// Per-head RMSNorm then rotary embedding, `(B, L, H * D)` to `(B, H, L, D)`,
/// in one kernel (see [`super::ops::norm_rope`]).
pub fn norm_rope(
    x: &Tensor,
    n_heads: usize,
    w: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    let dims = head_dims(x, n_heads, w)?;
    let (c, s) = rotary_rows(cos, sin, x.dtype())?;
    let op = NormRope { sin: s, dims, x_off: 0, xs: dims.2 * dims.3, eps: eps as f32 };
    Ok(x.contiguous()?.apply_op3_no_bwd(&w.to_dtype(x.dtype())?.contiguous()?, &c, &op)?)
}

/// [`norm_rope`] of the `n_heads` heads that start at column `col` of the
/// rows of `qkv` `(B, L, S)` (the output of one product over
/// `[Wq; Wk; Wv]`), read in place: `(B, H, L, D)`, in one kernel.
pub fn norm_rope_rows(
    qkv: &Tensor,
    col: usize,
    n_heads: usize,
    w: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    eps: f64,
) -> Result<Tensor> {
    let (b, l, s) = qkv.dims3()?;
    let d = w.elem_count();
    let dims = head_dims(&qkv.narrow(2, col, n_heads * d)?, n_heads, w)?;
    let (c, sn) = rotary_rows(cos, sin, qkv.dtype())?;
    let op = NormRope { sin: sn, dims: (b, l, dims.2, dims.3), x_off: col, xs: s, eps: eps as f32 };
    Ok(qkv.contiguous()?.apply_op3_no_bwd(&w.to_dtype(qkv.dtype())?.contiguous()?, &c, &op)?)
}

/// The keys' norm + rope fused with the write of keys and values into their
/// cache slots: an in-place op on the key pool that writes the value pool
/// too (through its device pointer: candle runs every op of a device on one
/// stream, so nothing else touches the pools during the call).
struct WriteKv<'a> {
    k: &'a Tensor,
    v: &'a Tensor,
    w: &'a Tensor,
    cos: &'a Tensor,
    sin: &'a Tensor,
    slots: &'a Tensor,
    pool_v: &'a Tensor,
    heads: usize,
    d: usize,
    /// Where token 0's keys and values start in `k` and `v`, and the
    /// distance between tokens.
    k_off: usize,
    v_off: usize,
    stride: usize,
    eps: f32,
}

impl WriteKv<'_> {
    fn run<T: CudaDType + DeviceRepr, P: CudaDType + DeviceRepr>(
        &self,
        kernel: &str,
        pk: &mut CudaSlice<P>,
        lk: &Layout,
        dev: &CudaDevice,
    ) -> candle_core::Result<()> {
        let Some((a, b)) = lk.contiguous_offsets() else {
            candle_core::bail!("cache write (CUDA): the key pool is not contiguous")
        };
        let tokens = self.slots.elem_count();
        let guards =
            [self.k, self.v, self.w, self.cos, self.sin].map(|t| cuda_of(t, "an input of the cache write"));
        let [k, v, w, c, s] = guards;
        let (k, v, w, c, s) = (k?, v?, w?, c?, s?);
        let (kv, vv, wv) = (
            guard_view::<T, _>(&k, "k")?,
            guard_view::<T, _>(&v, "v")?,
            guard_view::<T, _>(&w, "the k norm")?,
        );
        let row = self.heads * self.d;
        let past = |off: usize, len: usize| tokens > 0 && off + (tokens - 1) * self.stride + row > len;
        if past(self.k_off, kv.len()) || past(self.v_off, vv.len()) {
            candle_core::bail!("cache write (CUDA): {tokens} tokens of keys or values past their rows");
        }
        let (kv, vv) = (kv.slice(self.k_off..), vv.slice(self.v_off..));
        let (cv, sv) = (guard_view::<T, _>(&c, "cos")?, guard_view::<T, _>(&s, "sin")?);
        let (slot_s, slot_l) = cuda_of(self.slots, "the slots")?;
        let slots = view(as_cuda(&slot_s).as_cuda_slice::<u32>()?, slot_l, "the slots")?;
        let (pv_s, pv_l) = cuda_of(self.pool_v, "the value pool")?;
        let pv = view(as_cuda(&pv_s).as_cuda_slice::<P>()?, pv_l, "the value pool")?;
        let mut pk = pk.slice_mut(a..b);
        launch!(
            NORM_ROPE,
            dev,
            kernel,
            LaunchConfig {
                grid_dim: (tokens as u32, self.heads as u32, 1),
                block_dim: (src::NORM_ROPE_THREADS, 1, 1),
                shared_mem_bytes: 0
            },
            &kv,
            &vv,
            &wv,
            &cv,
            &sv,
            &slots,
            &mut pk,
            &pv,
            &(self.heads as i32),
            &(self.d as i32),
            &(self.stride as u64),
            &self.eps
        );
        Ok(())
    }
}

impl InplaceOp1 for WriteKv<'_> {
    fn name(&self) -> &'static str {
        "cuda-norm-rope-write-kv"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("cache write (CUDA): called on the CPU")
    }

    fn cuda_fwd(&self, pool: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        let dev = pool.device().clone();
        match (self.k.dtype(), &mut pool.slice) {
            (DType::F32, CudaStorageSlice::F32(p)) => {
                self.run::<f32, f32>("norm_rope_write_kv_f32", p, l, &dev)
            }
            (DType::F32, CudaStorageSlice::BF16(p)) => {
                self.run::<f32, bf16>("norm_rope_write_kv_f32_bf16pool", p, l, &dev)
            }
            (DType::BF16, CudaStorageSlice::BF16(p)) => {
                self.run::<bf16, bf16>("norm_rope_write_kv_bf16", p, l, &dev)
            }
            (k, _) => candle_core::bail!("cache write (CUDA): no kernel for {k:?} keys into this pool"),
        }
    }
}

/// Writes the keys `k` (per-head RMSNorm with weight `w`, then rotary
/// embedding by `cos`/`sin` `(1, 1, T, D/2)`) and the values `v`, both
/// `(1, T, Hkv * D)` as the projections leave them, into slots `slots` `(T)`
/// of the pools `(slots, Hkv, D)`, in one kernel.
#[allow(clippy::too_many_arguments)]
pub fn norm_rope_write_kv(
    k: &Tensor,
    v: &Tensor,
    (n_heads, w, eps): (usize, &Tensor, f64),
    (cos, sin): (&Tensor, &Tensor),
    slots: &Tensor,
    (pool_k, pool_v): (&Tensor, &Tensor),
) -> Result<()> {
    let (_, _, h, d) = head_dims(k, n_heads, w)?;
    let tokens = slots.elem_count();
    if k.dim(1)? != tokens
        || v.dims() != k.dims()
        || pool_k.dims() != pool_v.dims()
        || pool_k.dims()[1..] != [h, d]
    {
        return Err(Error::invalid(format!(
            "cache write (CUDA): k {:?}, v {:?} for {tokens} slots into pools {:?}",
            k.dims(),
            v.dims(),
            pool_k.dims()
        )));
    }
    let (c, s) = rotary_rows(cos, sin, k.dtype())?;
    let (k, v) = (k.contiguous()?, v.contiguous()?);
    let w = w.to_dtype(k.dtype())?.contiguous()?;
    let op = WriteKv {
        k: &k,
        v: &v,
        w: &w,
        cos: &c,
        sin: &s,
        slots,
        pool_v,
        heads: h,
        d,
        k_off: 0,
        v_off: 0,
        stride: h * d,
        eps: eps as f32,
    };
    Ok(pool_k.inplace_op1(&op)?)
}

/// [`norm_rope_write_kv`] of keys and values read in place from the rows of
/// `qkv` `(1, T, S)` (the output of one product over `[Wq; Wk; Wv]`): the
/// keys' `n_heads` heads start at column `cols.0`, the values' at `cols.1`.
pub fn norm_rope_write_kv_rows(
    qkv: &Tensor,
    cols: (usize, usize),
    (n_heads, w, eps): (usize, &Tensor, f64),
    (cos, sin): (&Tensor, &Tensor),
    slots: &Tensor,
    (pool_k, pool_v): (&Tensor, &Tensor),
) -> Result<()> {
    let (_, t, s) = qkv.dims3()?;
    let d = w.elem_count();
    let (_, _, h, d) = head_dims(&qkv.narrow(2, cols.0, n_heads * d)?, n_heads, w)?;
    let tokens = slots.elem_count();
    if qkv.elem_count() != tokens * s
        || t != tokens
        || cols.1 + h * d > s
        || pool_k.dims() != pool_v.dims()
        || pool_k.dims()[1..] != [h, d]
    {
        return Err(Error::invalid(format!(
            "cache write (CUDA): q/k/v rows {:?} (keys at {}, values at {}) for {tokens} slots into pools {:?}",
            qkv.dims(),
            cols.0,
            cols.1,
            pool_k.dims()
        )));
    }
    let (c, sn) = rotary_rows(cos, sin, qkv.dtype())?;
    let x = qkv.contiguous()?;
    let w = w.to_dtype(x.dtype())?.contiguous()?;
    let op = WriteKv {
        k: &x,
        v: &x,
        w: &w,
        cos: &c,
        sin: &sn,
        slots,
        pool_v,
        heads: h,
        d,
        k_off: cols.0,
        v_off: cols.1,
        stride: s,
        eps: eps as f32,
    };
    Ok(pool_k.inplace_op1(&op)?)
}

// ---------------------------------------------------------------- log-softmax statistics

/// Columns per tile of the log-softmax statistics: the whole row is one tile
/// here (the tiles exist for callers that hold one tile of logits at a time).
struct LogpEntropy {
    targets: Tensor,
}

impl LogpEntropy {
    fn fwd<T: DeviceRepr + candle_core::WithDType>(
        &self,
        (kernel, x, lx): (&str, &CudaSlice<T>, &Layout),
        dev: &CudaDevice,
    ) -> candle_core::Result<(CudaSlice<f32>, usize)> {
        let vocab = *lx.dims().last().unwrap_or(&1);
        let rows = lx.shape().elem_count() / vocab.max(1);
        if self.targets.elem_count() != rows {
            candle_core::bail!(
                "logprob_entropy (CUDA): {} targets for {rows} rows",
                self.targets.elem_count()
            );
        }
        let x = view(x, lx, "the logits")?;
        let (t_s, t_l) = cuda_of(&self.targets, "the targets")?;
        let targets = view(as_cuda(&t_s).as_cuda_slice::<u32>()?, t_l, "the targets")?;
        let init: Vec<f64> = (0..rows).flat_map(|_| [f64::NEG_INFINITY, 0.0, 0.0, 0.0]).collect();
        let state = dev.clone_htod(&init)?;
        launch!(
            LOGP_ENTROPY,
            dev,
            kernel,
            cfg((rows as u32, 1, 1), src::ROW_THREADS),
            &x,
            &(vocab as u64),
            &0i32,
            &(vocab as i32),
            &targets,
            &state
        );
        // SAFETY: one thread per row writes its three values.
        let out = unsafe { dev.alloc::<f32>(3 * rows)? };
        launch!(
            LOGP_ENTROPY,
            dev,
            "logp_entropy_finish",
            cfg((rows.div_ceil(src::FINISH_THREADS as usize) as u32, 1, 1), src::FINISH_THREADS),
            &state,
            &out,
            &(rows as i32)
        );
        Ok((out, rows))
    }
}

impl CustomOp1 for LogpEntropy {
    fn name(&self) -> &'static str {
        "cuda-logp-entropy"
    }

    cuda_only!(1);

    fn cuda_fwd(&self, x: &CudaStorage, lx: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = x.device();
        let (out, rows) = match &x.slice {
            CudaStorageSlice::F32(s) => self.fwd(("logp_entropy_tile_f32", s, lx), dev)?,
            CudaStorageSlice::BF16(s) => self.fwd(("logp_entropy_tile_bf16", s, lx), dev)?,
            _ => candle_core::bail!("logprob_entropy (CUDA): no kernel for {:?}", x.dtype()),
        };
        Ok((CudaStorage { slice: CudaStorageSlice::F32(out), device: dev.clone() }, Shape::from((rows, 3))))
    }

    fn bwd(&self, x: &Tensor, res: &Tensor, dres: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let op = LogpEntropyBwd { targets: self.targets.clone() };
        Ok(Some(x.apply_op3_no_bwd(res, &dres.to_dtype(DType::F32)?.contiguous()?, &op)?))
    }
}

/// Backward of [`LogpEntropy`] over `(x, res, dres)`.
struct LogpEntropyBwd {
    targets: Tensor,
}

impl LogpEntropyBwd {
    fn run<T: DeviceRepr + candle_core::WithDType>(
        &self,
        kernel: &str,
        (x, lx): (&CudaSlice<T>, &Layout),
        (res, lres): (&CudaSlice<f32>, &Layout),
        (dres, ldres): (&CudaSlice<f32>, &Layout),
        dev: &CudaDevice,
    ) -> candle_core::Result<CudaSlice<T>> {
        let vocab = *lx.dims().last().unwrap_or(&1);
        let len = lx.shape().elem_count();
        let rows = len / vocab.max(1);
        let (x, res, dres) = (
            view(x, lx, "the logits")?,
            view(res, lres, "the statistics")?,
            view(dres, ldres, "their gradient")?,
        );
        let (t_s, t_l) = cuda_of(&self.targets, "the targets")?;
        let targets = view(as_cuda(&t_s).as_cuda_slice::<u32>()?, t_l, "the targets")?;
        // SAFETY: every column of every row is written.
        let dx = unsafe { dev.alloc::<T>(len)? };
        launch!(
            LOGP_ENTROPY,
            dev,
            kernel,
            cfg((rows as u32, 1, 1), src::ROW_THREADS),
            &x,
            &(vocab as u64),
            &0i32,
            &(vocab as i32),
            &targets,
            &res,
            &dres,
            &dx,
            &(vocab as u64)
        );
        Ok(dx)
    }
}

impl CustomOp3 for LogpEntropyBwd {
    fn name(&self) -> &'static str {
        "cuda-logp-entropy-bwd"
    }

    cuda_only!(3);

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        res: &CudaStorage,
        lres: &Layout,
        dres: &CudaStorage,
        ldres: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = x.device();
        let (res, dres) = (res.as_cuda_slice::<f32>()?, dres.as_cuda_slice::<f32>()?);
        let slice = match &x.slice {
            CudaStorageSlice::F32(s) => CudaStorageSlice::F32(self.run(
                "logp_entropy_bwd_tile_f32",
                (s, lx),
                (res, lres),
                (dres, ldres),
                dev,
            )?),
            CudaStorageSlice::BF16(s) => CudaStorageSlice::BF16(self.run::<bf16>(
                "logp_entropy_bwd_tile_bf16",
                (s, lx),
                (res, lres),
                (dres, ldres),
                dev,
            )?),
            _ => candle_core::bail!("logprob_entropy backward (CUDA): no kernel for {:?}", x.dtype()),
        };
        Ok((CudaStorage { slice, device: dev.clone() }, lx.shape().clone()))
    }
}

/// Log-prob of `targets` and entropy from logits `(.., V)` (f32 or bf16, on
/// CUDA), forward and backward in the kernels of `logp_entropy.cu`; both
/// shaped like `targets`, in f32.
pub fn logprob_entropy(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let x = logits.contiguous()?;
    let t = targets.flatten_all()?.to_dtype(DType::U32)?.contiguous()?.detach();
    let out = x.apply_op1(LogpEntropy { targets: t })?;
    let logp = out.narrow(1, 0, 1)?.reshape(targets.shape())?;
    let entropy = out.narrow(1, 1, 1)?.reshape(targets.shape())?;
    Ok((logp, entropy))
}

// ---------------------------------------------------------------- sampling

struct Sample {
    params: SampleParams,
}

impl CustomOp2 for Sample {
    fn name(&self) -> &'static str {
        "cuda-sample"
    }

    cuda_only!(2);

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        lx: &Layout,
        u: &CudaStorage,
        lu: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = x.device();
        let (rows, vocab) = lx.shape().dims2()?;
        if lu.shape().elem_count() != rows {
            candle_core::bail!("sample (CUDA): {} uniform numbers for {rows} rows", lu.shape().elem_count());
        }
        let x = view(x.as_cuda_slice::<f32>()?, lx, "the logits")?;
        let u = view(u.as_cuda_slice::<f64>()?, lu, "the uniform numbers")?;
        // SAFETY: thread 0 of each row's block writes its four values.
        let out = unsafe { dev.alloc::<f32>(4 * rows)? };
        let p = self.params;
        launch!(
            SAMPLE,
            dev,
            "sample_rows",
            cfg((rows as u32, 1, 1), src::ROW_THREADS),
            &x,
            &(vocab as i32),
            &u,
            &p.inv_t,
            &(p.top_k as i32),
            &p.top_p,
            &p.min_p,
            &out
        );
        Ok((CudaStorage { slice: CudaStorageSlice::F32(out), device: dev.clone() }, Shape::from((rows, 4))))
    }
}

/// One draw per row of `logits` `(B, V)` (f32, on CUDA) with each row's
/// uniform number: per row `[logprob, logprob_raw, entropy, id]`, the id -1
/// where the row has NaN or no finite maximum. Only these `4 B` numbers
/// leave the device.
pub fn sample(logits: &Tensor, uniforms: &[f64], params: SampleParams) -> Result<Vec<[f32; 4]>> {
    let u = Tensor::from_slice(uniforms, uniforms.len(), logits.device())?;
    let out = logits.to_dtype(DType::F32)?.contiguous()?.apply_op2_no_bwd(&u, &Sample { params })?;
    super::budget::host_copy(); // the four numbers of every row, one copy
    Ok(out.to_vec2::<f32>()?.into_iter().map(|r| [r[0], r[1], r[2], r[3]]).collect())
}

#[cfg(test)]
mod tests {
    /// NVRTC compiles every kernel source without a GPU: a syntax or type
    /// error fails here, not on a lent device.
    #[test]
    fn every_kernel_compiles() {
        for module in super::MODULES {
            let ptx = module.ptx().unwrap_or_else(|e| panic!("{}: {e}", module.name()));
            for name in module.source.kernels.iter().map(|k| k.name) {
                assert!(
                    ptx.contains(&format!(".entry {name}(")),
                    "{name} missing from the PTX of {}",
                    module.name()
                );
            }
        }
    }
}
