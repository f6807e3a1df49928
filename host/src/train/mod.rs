//! Training: the optimizer, the update step, supervised fine-tuning,
//! checkpoints and metrics.

pub mod config;
pub mod optim;
pub mod plot;
pub mod sft;
pub mod spurious;
pub mod tensorboard;
pub mod trainer;
pub mod update;

pub use config::{
    AsyncConfig, CheckpointConfig, DataConfig, EvalConfig, LoggingConfig, ModelConfig, RolesConfig,
    RolloutConfig, RunConfig,
};
pub use optim::{
    is_norm_or_bias, AdamW, AdamWConfig, LrSchedule, Optimizer, ShardMode, ShardedAdamW, StepReport,
};
pub use sft::{pretrain_tiny, sft_loss, sft_step, SftMetrics, TinyConfig, TinyReport};
pub use trainer::{AsyncFigures, ResumeOptions, RolloutFigures, StepMetrics, StepPlan, Trainer};
pub use update::{
    token_analysis, update, ActorConfig, AppliedThresholds, OldLogp, Sequence, TokenAnalysis, UpdateConfig,
    UpdateMetrics, UpdateOptions, UpdateOutcome, UpdateRecord,
};
