//! The optimizer's per-parameter state ([`ParamState`]) and the scalars of one
//! update ([`Hyper`]): the types the AdamW driver (`adamw.rs`) and its kernels
//! (`kernels.rs`) share, so that neither file imports the other's internals.

use candle_core::Var;

use super::config::AdamWConfig;

/// One parameter and its optimizer state.
pub(super) struct ParamState {
    pub(super) name: String,
    pub(super) var: Var,
    /// f32 master weights of a parameter that is not f32 (mixed precision): the update
    /// runs on them and `var` is their rounding, written after every step. `None` for f32.
    pub(super) master: Option<Var>,
    /// First moment (`exp_avg` in PyTorch), f32, same shape, own storage.
    pub(super) m: Var,
    /// Second moment (`exp_avg_sq`), f32, same shape, own storage.
    pub(super) v: Var,
    /// Steps in which this parameter had a gradient (PyTorch's `state['step']`).
    pub(super) steps: u64,
    /// Whether weight decay applies.
    pub(super) decay: bool,
}

impl ParamState {
    /// What the update writes: the f32 master weights when there are, else the parameter.
    pub(super) fn trained(&self) -> &Var {
        self.master.as_ref().unwrap_or(&self.var)
    }

    /// After an update of the master weights, rounds them into the parameter the model
    /// reads (in place: the model's tensors share `var`'s storage).
    pub(super) fn write_back(&self) -> crate::Result<()> {
        if let Some(w) = &self.master {
            self.var.set(&w.to_dtype(self.var.dtype())?)?;
        }
        Ok(())
    }
}

/// Per-parameter scalars of one fused update, in f32 as the kernel uses them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Hyper {
    pub(super) b1: f32,
    pub(super) b2: f32,
    pub(super) one_minus_b1: f32,
    pub(super) one_minus_b2: f32,
    /// `lr / (1 - b1^t)`.
    pub(super) step_size: f32,
    /// `1 / sqrt(1 - b2^t)`.
    pub(super) inv_sqrt_bc2: f32,
    pub(super) eps: f32,
    /// `1 - lr * wd`, or 1 without decay.
    pub(super) decay: f32,
    /// Gradient clipping factor.
    pub(super) clip: f32,
}

/// The kernel's scalars for a parameter at its `t`-th step.
pub(super) fn hyper(cfg: &AdamWConfig, lr: f64, t: u64, decay: bool, clip: f64) -> Hyper {
    let t = t as f64;
    let bc1 = 1.0 - cfg.beta1.powf(t);
    let bc2 = 1.0 - cfg.beta2.powf(t);
    Hyper {
        b1: cfg.beta1 as f32,
        b2: cfg.beta2 as f32,
        one_minus_b1: (1.0 - cfg.beta1) as f32,
        one_minus_b2: (1.0 - cfg.beta2) as f32,
        step_size: (lr / bc1) as f32,
        inv_sqrt_bc2: (1.0 / bc2.sqrt()) as f32,
        eps: cfg.eps as f32,
        decay: if decay { (1.0 - lr * cfg.weight_decay) as f32 } else { 1.0 },
        clip: clip as f32,
    }
}
