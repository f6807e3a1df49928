//! stapo: reinforcement-learning fine-tuning of Qwen3 models with STAPO and the
//! GRPO family, driven by Rhai scripts.
//!
//! Dependencies point one way: `model` ← `rollout` ← `algo`/`train` ← `script`;
//! `reward` and `data` stand alone.

pub mod algo;
pub mod data;
pub mod dist;
pub mod error;
pub mod eval;
pub mod model;
pub mod repl;
pub mod reward;
pub mod rollout;
pub mod script;
pub mod train;
pub mod util;

pub use error::{Error, Result};
