//! stapo: reinforcement-learning fine-tuning of Qwen3 models with STAPO and the
//! GRPO family, driven by Rhai scripts.
//!
//! Dependencies point one way, from the top of this list to the bottom:
//! `repl` → `script` → `train` → `eval` → `rollout` → `model`, with `algo`,
//! `reward`, `data` and `dist` standing alone (using nothing of the crate but
//! [`files`], [`seed`], [`overlay`] and [`error`]). Only `script` imports rhai. The run's one
//! configuration tree is [`train::RunConfig`] (`train/config.rs`).
//! docs/architecture.md follows one training step through these folders;
//! the design notes (the algorithm, the scripts, the scale the paper works at)
//! are in DESIGN.md at the repository root.

#![deny(missing_docs)]

pub mod algo;
pub mod data;
pub mod dist;
pub mod error;
pub mod eval;
pub mod files;
pub mod guard;
pub mod model;
pub mod overlay;
pub mod repl;
pub mod reward;
pub mod rollout;
pub mod script;
pub mod seed;
pub mod train;

pub use error::{Error, Result};
