//! Training: the optimizer, the update step, checkpoints and metrics.

pub mod optim;
pub mod step;

pub use optim::{bench_adamw, is_norm_or_bias, AdamW, AdamWConfig, LrSchedule, StepReport};
pub use step::{update, OldLogp, Sequence, UpdateConfig, UpdateMetrics};
