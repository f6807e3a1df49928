//! The integration test binary: one process, one module per concern.

mod acyclic;
mod architecture;
mod asynchronous;
mod causes;
mod common;
mod dataset;
mod dist;
mod divergence;
mod guard;
mod hf;
mod kill;
mod lora;
mod model;
mod partial;
mod preempt;
mod prompt;
mod readme;
mod recovery;
mod script;
mod train;
mod trainer;
