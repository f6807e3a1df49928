//! Script-visible types and functions, one registration file per domain.
//!
//! Bindings are thin: convert the arguments, call the library, convert back.
//! Heavy state (model weights, optimizer moments, a trainer) lives in Rust
//! behind `Arc<Mutex<..>>` handles that scripts hold; a hot reload swaps code,
//! never handles. Every function is registered through [`func`] with a doc
//! comment whose first line is its usage, so the REPL's `:help` shows it.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use rhai::Engine;

use super::error::{host, RhaiResult};
use super::host::Host;
use crate::data::{Dataset, Tokenizer};
use crate::model::Qwen3;
use crate::rollout::RolloutBatch;
use crate::train::{AdamW, Trainer};

/// A model in memory, with its tokenizer and (once `update` ran) its optimizer.
#[derive(Clone)]
pub struct ModelHandle(pub Arc<Mutex<ModelSlot>>);

/// What a [`ModelHandle`] holds.
pub struct ModelSlot {
    pub model: Qwen3,
    pub tokenizer: Option<Tokenizer>,
    /// The folder it was loaded from (its tokenizer files are copied on save).
    pub dir: Option<PathBuf>,
    /// AdamW state, created by the first `update`.
    pub opt: Option<AdamW>,
}

/// A tokenizer.
#[derive(Clone)]
pub struct TokenizerHandle(pub Arc<Tokenizer>);

/// A loaded dataset.
#[derive(Clone)]
pub struct DatasetHandle(pub Arc<Dataset>);

/// A batch of sampled responses, with rewards, advantages and the S2T mask once computed.
#[derive(Clone)]
pub struct RolloutHandle(pub Arc<Mutex<RolloutState>>);

/// What a [`RolloutHandle`] holds.
pub struct RolloutState {
    pub batch: RolloutBatch,
    pub tokenizer: Option<Tokenizer>,
    /// One advantage per sample (`advantages(r)`).
    pub advantages: Option<Vec<f32>>,
    /// Per sample, per response token: silenced by S2T (`s2t(r)`).
    pub silenced: Option<Vec<Vec<bool>>>,
}

/// A training run (a [`Trainer`]) driven step by step.
#[derive(Clone)]
pub struct RunHandle(pub Arc<Mutex<Trainer>>);

/// Locks a handle's mutex; a poisoned lock (a panic in an earlier call) is a host error.
pub fn lock<'a, T>(m: &'a Mutex<T>, what: &str) -> RhaiResult<MutexGuard<'a, T>> {
    m.lock().map_err(|_| host(format!("{what} is unusable after an earlier failure")))
}

/// `doc` as Rhai doc-comment lines (`/// ...`).
pub(crate) fn doc_comment(doc: &str) -> String {
    doc.trim().lines().map(|l| format!("/// {}", l.trim_end())).collect::<Vec<_>>().join("\n")
}

/// Registers a function `name` with a doc comment (`doc`'s first line is the
/// usage). Functions are marked volatile: they touch models and files, so the
/// optimizer must never fold them at compile time.
macro_rules! func {
    ($engine:expr, $name:expr, $doc:expr, $f:expr) => {
        rhai::FuncRegistration::new($name)
            .with_volatility(true)
            .with_comments([$crate::script::bindings::doc_comment($doc)])
            .register_into_engine($engine, $f)
    };
}

/// Registers a property getter `obj.name` with a doc comment.
macro_rules! getter {
    ($engine:expr, $name:expr, $doc:expr, $f:expr) => {
        rhai::FuncRegistration::new_getter($name)
            .with_comments([$crate::script::bindings::doc_comment($doc)])
            .register_into_engine($engine, $f)
    };
}

pub mod algo;
pub mod data;
pub mod eval;
pub mod model;
pub mod reward;
pub mod rollout;
pub mod train;

/// Registers every domain.
pub fn register_all(engine: &mut Engine, host: &Arc<Host>) {
    engine
        .register_type_with_name::<ModelHandle>("Model")
        .register_type_with_name::<TokenizerHandle>("Tokenizer")
        .register_type_with_name::<DatasetHandle>("Dataset")
        .register_type_with_name::<RolloutHandle>("Rollout")
        .register_type_with_name::<RunHandle>("Run");
    model::register(engine, host);
    data::register(engine, host);
    rollout::register(engine, host);
    reward::register(engine, host);
    algo::register(engine, host);
    train::register(engine, host);
    eval::register(engine, host);
}
