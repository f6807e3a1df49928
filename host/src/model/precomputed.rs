//! The output of a custom op computed before the op runs, handed to candle
//! on whichever device it lives on.
//!
//! The recomputing ops ([`super::recompute`], the tiled head of
//! [`super::head`]) run their forward as ordinary candle ops without a graph
//! and wrap the result in a custom op whose backward reruns the work with a
//! graph. candle gives a custom op's forward the inputs' storages of one
//! backend (`cpu_fwd`, `cuda_fwd`, `metal_fwd`); [`Held`] answers each with a
//! copy of the precomputed tensor's storage through the backend traits
//! (`alloc_uninit`, `copy_strided_src`), so the same op serves every device
//! candle was built for. Without the `cuda` feature candle's `CudaStorage` is
//! a stub whose methods fail, so this compiles either way.

use std::sync::Mutex;

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CudaStorage, MetalStorage, Shape, Storage, Tensor};

use super::fused::par_copy;

/// A precomputed op output, taken by the op's forward (once).
pub(super) struct Held {
    y: Mutex<Option<Tensor>>,
    what: &'static str,
}

impl Held {
    /// Holds `y` for the forward of the op named `what`.
    pub(super) fn new(y: Tensor, what: &'static str) -> Self {
        Self { y: Mutex::new(Some(y)), what }
    }

    fn err(&self, e: impl std::fmt::Display) -> candle_core::Error {
        candle_core::Error::Msg(format!("{}: {e}", self.what))
    }

    /// The output, taken (once).
    fn take(&self) -> candle_core::Result<Tensor> {
        self.y.lock().map_err(|e| self.err(e))?.take().ok_or_else(|| self.err("forward ran twice"))
    }

    /// A fresh storage of the backend `pick` selects holding the output, and its shape.
    fn out<S>(&self, pick: impl Fn(&Storage) -> Option<&S>) -> candle_core::Result<(S, Shape)>
    where
        S: BackendStorage,
        S::Device: BackendDevice<Storage = S>,
    {
        let y = self.take()?;
        let (storage, layout) = y.storage_and_layout();
        let src = pick(&storage).ok_or_else(|| self.err("output on another device than the inputs"))?;
        // SAFETY: every element of `dst` is written by the strided copy below.
        let mut dst = unsafe { src.device().alloc_uninit(layout.shape(), src.dtype())? };
        src.copy_strided_src(&mut dst, 0, layout)?;
        Ok((dst, layout.shape().clone()))
    }

    /// The output for `cpu_fwd`: a contiguous f32 or f64 output copied in
    /// parallel, any other through the backend's strided copy.
    pub(super) fn cpu(&self) -> candle_core::Result<(CpuStorage, Shape)> {
        let y = self.take()?;
        let (storage, layout) = y.storage_and_layout();
        let copied = match (&*storage, layout.contiguous_offsets()) {
            (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => Some(CpuStorage::F32(par_copy(&v[a..b]))),
            (Storage::Cpu(CpuStorage::F64(v)), Some((a, b))) => Some(CpuStorage::F64(par_copy(&v[a..b]))),
            _ => None,
        };
        if let Some(c) = copied {
            return Ok((c, layout.shape().clone()));
        }
        drop(storage);
        *self.y.lock().map_err(|e| self.err(e))? = Some(y);
        self.out(|s| match s {
            Storage::Cpu(s) => Some(s),
            _ => None,
        })
    }

    /// The output for `cuda_fwd`.
    pub(super) fn cuda(&self) -> candle_core::Result<(CudaStorage, Shape)> {
        self.out(|s| match s {
            Storage::Cuda(s) => Some(s),
            _ => None,
        })
    }

    /// The output for `metal_fwd`.
    pub(super) fn metal(&self) -> candle_core::Result<(MetalStorage, Shape)> {
        self.out(|s| match s {
            Storage::Metal(s) => Some(s),
            _ => None,
        })
    }
}

/// A scalar zero in the dtype and on the device of `s` (the [`super::recompute`]
/// weight tokens).
pub(super) fn zero_like<S>(s: &S) -> candle_core::Result<(S, Shape)>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    let shape = Shape::from(());
    Ok((s.device().zeros_impl(&shape, s.dtype())?, shape))
}
