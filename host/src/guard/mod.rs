//! Guards that keep a run from losing work or accepting nonsense without a word:
//! the options they take, in one place, and the checks themselves, one
//! file per concern.
//!
//! - [`GuardConfig`] (`guard: #{...}` in a run config): how many steps in a row may be
//!   skipped for a non-finite loss, gradient norm or update before the run stops. The
//!   command-line switches of the same family are `--force` (`stapo init` / `stapo
//!   update` may replace a folder they did not create) and `--allow-unused` (a model
//!   folder's unused tensors are a warning, not an error; [`set_allow_unused_tensors`]).
//! - [`finite`]: a checkpoint's tensors verified finite before it becomes `latest`, and
//!   the streak of skipped steps.
//! - [`folder`]: folders stapo writes into: the run-folder marker, the check that an
//!   output folder is stapo's to replace, the removal of leftover temporary checkpoint
//!   folders, and the advisory lock of a run folder ([`folder::RunLock`]).
//!
//! PyTorch's `GradScaler` and DeepSpeed's `skipped_steps` skip a step on a non-finite
//! gradient the same way; verl and TRL stop on a NaN loss. Here both: skip and count,
//! stop after `max_nonfinite_steps` in a row.

pub mod finite;
pub mod folder;

use std::sync::atomic::{AtomicBool, Ordering};

use serde::{Deserialize, Serialize};

pub use finite::{check_folder_finite, NonFiniteStreak};
pub use folder::{check_output_folder, RunLock};

/// The guards' options of a run (`guard: #{ max_nonfinite_steps: 3 }` in a `train`
/// config map, `--set guard.max_nonfinite_steps=5` on the command line).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GuardConfig {
    /// Steps in a row that skipped an optimizer step because the loss, the gradient norm
    /// or the updated weights were not finite, before the run stops with an error naming
    /// the step and the quantity (0: never stop; every such step is still skipped).
    pub max_nonfinite_steps: usize,
}

impl Default for GuardConfig {
    fn default() -> Self {
        Self { max_nonfinite_steps: 3 }
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
