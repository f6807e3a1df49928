//! Training: the optimizer, the update step, checkpoints and metrics.

pub mod optim;

pub use optim::{bench_adamw, is_norm_or_bias, AdamW, AdamWConfig, LrSchedule, StepReport};
