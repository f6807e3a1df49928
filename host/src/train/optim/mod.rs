//! The optimizer: AdamW with decoupled weight decay, global-norm gradient
//! clipping and learning-rate schedules.
//!
//! AdamW is Loshchilov & Hutter, "Decoupled Weight Decay Regularization"
//! (ICLR 2019, arXiv:1711.05101), in the form PyTorch's `torch.optim.AdamW`
//! implements it (`torch/optim/adamw.py`, `_single_tensor_adamw`), step for step:
//!
//! ```text
//! p  <- p * (1 - lr * wd)                      // decoupled decay, before the Adam update
//! m  <- b1 * m + (1 - b1) * g
//! v  <- b2 * v + (1 - b2) * g^2
//! p  <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//! ```
//!
//! which is `p -= lr * m_hat / (sqrt(v_hat) + eps)` with `m_hat = m / (1 - b1^t)`,
//! `v_hat = v / (1 - b2^t)`. As in PyTorch, `t` counts per parameter the steps in
//! which that parameter had a gradient, and a parameter without a gradient is
//! left alone (no decay either). Clipping follows `torch.nn.utils.clip_grad_norm_`:
//! `coef = min(1, max_norm / (total_norm + 1e-6))`.
//!
//! Why not `candle_nn::AdamW`: it runs op by op, allocating about ten whole-tensor
//! temporaries per parameter per step (45 s per step over 0.6B parameters on a
//! 2-core CPU). Here, on the CPU, each parameter is updated by one fused pass
//! that reads `p, g, m, v` and writes `p, m, v` in place, parallel over chunks
//! with rayon, with no temporaries; gradient clipping is folded into that pass
//! as a scalar, so the gradients are never rewritten. Peak memory is params +
//! grads + m + v. Other devices (CUDA, Metal) take a device-generic path made of
//! candle ops, which is correct but allocates temporaries.
//!
//! # How the in-place update is sound
//! candle keeps a tensor's storage behind a `RwLock` and gives mutable access only
//! through its in-place custom ops. The fused update is
//! `p.inplace_op2(g, op)`: candle write-locks `p`'s storage, read-locks `g`'s
//! (refusing the call if `g` shares `p`'s storage), and hands the op
//! `&mut CpuStorage` for `p` and `&CpuStorage` for `g`. Inside, the op runs
//! `m.inplace_op1(..)` and, inside that, `v.inplace_op1(..)`, each of which
//! write-locks one more storage and yields its `&mut CpuStorage`. So the kernel
//! receives four slices whose exclusivity is guaranteed by candle's locks and by
//! the borrow checker: no `unsafe`, no raw pointers. The ops carry their closures
//! in a `RefCell<Option<_>>` because candle calls `cpu_fwd(&self, ..)`.
//! `m` and `v` are storages this optimizer allocates itself (loading state copies
//! into them), so they never alias `p`, `g` or each other. Locks are always taken
//! in the order (p, g) -> m -> v; the only way to deadlock would be for another
//! thread to hold a moment tensor returned by [`AdamW::state_tensors`] locked
//! while it waits on a parameter, during a step.
//!
//! # Precision
//! Moments are always f32. A parameter that is not f32 (a `--dtype bfloat16` model)
//! trains in mixed precision, as PyTorch's autocast with f32 master weights, DeepSpeed
//! and verl's FSDP do: the optimizer keeps f32 master weights of it, the step updates
//! those (the gradient widened to f32), and the parameter the forward and backward
//! read is their rounding, written in place after every step. So an update smaller
//! than half a bf16 ulp (at lr 1e-6 a weight of 0.02 moves 1/120 of its ulp a step) accumulates in
//! the master weights instead of being lost. They cost 4 bytes per parameter and are
//! saved as `{name}.master` in the optimizer state; the model files hold the rounding.
//!
//! # Sharding
//! [`ShardedAdamW`] is the same update with its state split over the ranks of a
//! data-parallel run (ZeRO-1/2, [`ShardMode`]): see `sharded.rs`, and
//! `shard_files.rs` for its checkpoints (one file per rank and an index of ranges).

mod adamw;
mod config;
mod kernels;
pub mod memory;
mod schedule;
mod shard_files;
mod sharded;
#[cfg(test)]
mod sharded_tests;
mod state;

pub use adamw::{AdamW, StepReport};
pub use config::{is_norm_or_bias, AdamWConfig, ShardMode};
pub use schedule::LrSchedule;
pub use shard_files::{shard_file_name, FlatState, ShardIndex, INDEX_FILE, PLAIN_FILE};
pub use sharded::{FlatLayout, ShardedAdamW};

use candle_core::backprop::GradStore;
use candle_core::Var;

use crate::dist::{self, Comm};
use crate::Result;

/// What the update driver needs of an optimizer: its parameters, and one step
/// from this rank's accumulated gradients (summed over the ranks the way the
/// optimizer needs them: all-reduced for [`AdamW`], reduce-scattered for
/// [`ShardedAdamW`] in ZeRO-2).
pub trait Optimizer {
    /// The trainable parameters, in the optimizer's order.
    fn trainable(&self) -> Vec<Var>;
    /// Sums `grads` over `comm`'s ranks and takes one step at learning rate `lr`.
    /// Every rank calls it with the same `lr`; `grads` may be consumed.
    fn step_on(&mut self, comm: &dyn Comm, grads: &mut GradStore, lr: f64) -> Result<StepReport>;
    /// Bytes of optimizer state (moments, master weights) this rank holds.
    fn state_bytes(&self) -> usize;
}

impl Optimizer for AdamW {
    fn trainable(&self) -> Vec<Var> {
        self.params().map(|(_, v)| v.clone()).collect()
    }
    fn step_on(&mut self, comm: &dyn Comm, grads: &mut GradStore, lr: f64) -> Result<StepReport> {
        if comm.size() > 1 {
            let vars = self.trainable();
            let refs: Vec<&Var> = vars.iter().collect();
            dist::all_reduce_grads(comm, &refs, grads)?;
        }
        self.step(grads, lr)
    }
    fn state_bytes(&self) -> usize {
        // exp_avg and exp_avg_sq, f32, for every element; f32 master weights of the others.
        8 * self.n_elements() + 4 * self.n_master_elements()
    }
}
