//! Guards that keep a run from losing work or accepting nonsense without a word: the
//! options they take, in one place, and the checks themselves, one file per concern.
//!
//! - [`GuardConfig`] (`guard: #{...}` in a run config): how many steps in a row may be
//!   skipped for a non-finite loss, gradient norm or update before the run stops, and
//!   the divergence checks with what a diverged step does. The
//!   command-line switches of the same family are `--force` (`stapo init` / `stapo
//!   update` may replace a folder they did not create) and `--allow-unused` (a model
//!   folder's unused tensors are a warning, not an error; [`set_allow_unused_tensors`]).
//! - [`finite`]: a checkpoint's tensors verified finite before it becomes `latest`, and
//!   the streak of skipped steps.
//! - [`folder`]: folders stapo writes into: the run-folder marker, the check that an
//!   output folder is stapo's to replace, the removal of leftover temporary checkpoint
//!   folders, and the advisory lock of a run folder ([`folder::RunLock`]).
//! - [`divergence`]: finite but no longer healthy (entropy near uniform, jumps from the
//!   recent median, the weights' norm exploding, gradients that stopped).
//! - [`signal`]: SIGTERM, SIGUSR1 and SIGINT stop a run after a checkpoint.
//!
//! PyTorch's `GradScaler` and DeepSpeed's `skipped_steps` skip a step on a non-finite
//! gradient the same way; verl and TRL stop on a NaN loss. Here both: skip and count,
//! stop after `max_nonfinite_steps` in a row.

pub mod divergence;
pub mod finite;
pub mod folder;
pub mod signal;

use std::sync::atomic::{AtomicBool, Ordering};

use serde::{Deserialize, Serialize};

pub use divergence::{DivergenceWatch, OnDivergence};
pub use finite::{check_folder_finite, NonFiniteStreak};
pub use folder::{check_output_folder, RunLock};

/// The guards' options of a run (`guard: #{ max_nonfinite_steps: 3 }` in a `train`
/// config map, `--set guard.max_nonfinite_steps=5` on the command line).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GuardConfig {
    /// Steps in a row that skipped an optimizer step because the loss, the gradient norm
    /// or the updated weights were not finite, before the run stops with an error naming
    /// the step and the quantity (0: never stop; every such step is still skipped).
    pub max_nonfinite_steps: usize,
    /// What a diverged step does: `warn` (default), `stop` or `rollback` (see
    /// [`divergence`]).
    pub on_divergence: OnDivergence,
    /// The learning rate is multiplied by this at each rollback (in (0, 1]).
    pub rollback_lr_scale: f64,
    /// Rollbacks allowed in one run; one more divergence then stops it.
    pub max_rollbacks: usize,
    /// Mean token entropy, as a share of `ln(vocab)`, that counts as divergence when the
    /// recent steps were below it (0: off).
    pub max_entropy_ratio: f64,
    /// A rise of the mean entropy above its recent median by more than this times
    /// `ln(vocab)` counts as divergence (0: off).
    pub entropy_jump: f64,
    /// A fall of the mean reward below its recent median by more than this counts as
    /// divergence (0: off).
    pub reward_drop: f64,
    /// The trainable weights' norm growing by more than this factor in one update counts
    /// as divergence (0: off).
    pub weight_norm_growth: f64,
    /// Steps in a row with a zero gradient norm although advantages are not zero, that
    /// count as divergence (0: off).
    pub max_zero_grad_steps: usize,
    /// Steps whose median the jumps are measured from.
    pub window: usize,
}

impl Default for GuardConfig {
    fn default() -> Self {
        Self {
            max_nonfinite_steps: 3,
            on_divergence: OnDivergence::Warn,
            rollback_lr_scale: 0.5,
            max_rollbacks: 3,
            max_entropy_ratio: 0.9,
            entropy_jump: 0.25,
            reward_drop: 0.5,
            weight_norm_growth: 1.5,
            max_zero_grad_steps: 3,
            window: 8,
        }
    }
}

impl GuardConfig {
    /// Checks the divergence limits; an error names the field.
    pub fn validate(&self) -> crate::Result<()> {
        let bad = |field: &str, msg: String| crate::Error::Config {
            file: "run config".into(),
            field: format!("guard.{field}"),
            msg,
        };
        if !(self.rollback_lr_scale > 0.0 && self.rollback_lr_scale <= 1.0) {
            return Err(bad(
                "rollback_lr_scale",
                format!("must be in (0, 1], found {}", self.rollback_lr_scale),
            ));
        }
        for (field, v) in [
            ("max_entropy_ratio", self.max_entropy_ratio),
            ("entropy_jump", self.entropy_jump),
            ("reward_drop", self.reward_drop),
            ("weight_norm_growth", self.weight_norm_growth),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(bad(field, format!("must be a number >= 0 (0: off), found {v}")));
            }
        }
        if self.weight_norm_growth > 0.0 && self.weight_norm_growth <= 1.0 {
            return Err(bad(
                "weight_norm_growth",
                format!("must be above 1 (a factor of growth) or 0 (off), found {}", self.weight_norm_growth),
            ));
        }
        Ok(())
    }
}

/// `--allow-unused`: whether model folders may hold tensors the model does not use
/// (reported as a warning instead of an error). A process setting, as the CLI flag is.
static ALLOW_UNUSED: AtomicBool = AtomicBool::new(false);

/// Sets what [`allow_unused_tensors`] returns (the CLI's `--allow-unused`).
pub fn set_allow_unused_tensors(allow: bool) {
    ALLOW_UNUSED.store(allow, Ordering::Relaxed);
}

/// Whether a model folder's unused tensors are a warning rather than an error.
pub fn allow_unused_tensors() -> bool {
    ALLOW_UNUSED.load(Ordering::Relaxed)
}

/// Warnings the library raised where it has no caller to return them to (a model folder
/// loaded with `--allow-unused`), until the caller takes them.
static NOTES: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Queues a warning for [`take_notes`] (the library prints nothing).
pub fn note(msg: String) {
    if let Ok(mut n) = NOTES.lock() {
        n.push(msg);
    }
}

/// The warnings queued since the last call, oldest first.
pub fn take_notes() -> Vec<String> {
    NOTES.lock().map(|mut n| std::mem::take(&mut *n)).unwrap_or_default()
}
