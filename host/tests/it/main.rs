//! The integration test binary: one process, one module per concern.

mod acyclic;
mod architecture;
mod common;
mod dataset;
mod dist;
mod guard;
mod hf;
mod kill;
mod lora;
mod model;
mod prompt;
mod script;
mod train;
mod trainer;
