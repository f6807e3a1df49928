//! The integration test binary: one process, one module per concern.

mod common;
mod hf;
mod model;
mod train;
mod trainer;
