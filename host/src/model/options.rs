//! How the model computes, as options rather than environment variables:
//! which kernels serve CPU tensors ([`Kernels`]) and when decoder layers are
//! recomputed in the backward pass ([`Recompute`]).
//!
//! The library reads no environment variable for these. The CLI reads
//! `STAPO_NO_FUSED` and `STAPO_RECOMPUTE` once, at start-up
//! (`commands::model_options_from_env`), and sets the process default with
//! [`ModelOptions::set_process_default`]; every model built afterwards starts
//! from it. A caller or a test switches one thread's kernels with
//! [`Kernels::scope`], and a model's recomputation with
//! [`super::Qwen3::set_recompute`], without touching the process.

use std::sync::atomic::{AtomicU8, Ordering};

use super::fused::Kernels;
use super::recompute::Recompute;

/// The process default of [`ModelOptions::recompute`], as a byte (that of
/// [`Kernels`] lives beside the kernels, in `fused/kernels.rs`).
static DEFAULT_RECOMPUTE: AtomicU8 = AtomicU8::new(2);

/// The options a model computes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ModelOptions {
    /// Fused CPU kernels or composed ops.
    pub kernels: Kernels,
    /// When decoder layers are recomputed in the backward pass (the initial
    /// setting of every model built; [`super::Qwen3::set_recompute`] changes one).
    pub recompute: Recompute,
}

impl ModelOptions {
    /// The process default: what [`ModelOptions::set_process_default`] last
    /// set, else [`ModelOptions::default`] (fused kernels, `Recompute::Auto`).
    pub fn process_default() -> Self {
        Self {
            kernels: Kernels::process_default(),
            recompute: Recompute::from_u8(DEFAULT_RECOMPUTE.load(Ordering::Relaxed)),
        }
    }

    /// Sets the process default (the CLI does, once, from the environment).
    pub fn set_process_default(self) {
        self.kernels.set_process_default();
        DEFAULT_RECOMPUTE.store(self.recompute.to_u8(), Ordering::Relaxed);
    }
}
