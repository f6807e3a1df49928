//! stapo: reinforcement-learning fine-tuning of Qwen3 models with STAPO and the
//! GRPO family, driven by Rhai scripts.
//!
//! Dependencies point one way: `model` ← `rollout` ← `algo`/`train` ← `script`.

pub mod error;
pub mod data;
pub mod model;

pub use error::{Error, Result};
