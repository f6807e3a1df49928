//! The library's one error type. Every variant says what was expected, what was
//! found, and where (file, line, field, tensor name and shape).

use std::path::PathBuf;

/// Errors raised by the stapo library. The binary wraps them with `anyhow` context.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A line of a text file (JSONL, config) could not be parsed.
    #[error("{path}:{line}: {msg}")]
    Parse { path: PathBuf, line: usize, msg: String },
    /// A required configuration field is missing or has an invalid value.
    #[error("{file}: field `{field}`: {msg}")]
    Config { file: String, field: String, msg: String },
    /// A tensor is absent from a checkpoint.
    #[error("{file}: missing tensor `{name}`")]
    MissingTensor { file: String, name: String },
    /// A tensor in a checkpoint has the wrong shape.
    #[error("{file}: tensor `{name}` has shape {found:?}, expected {expected:?}")]
    Shape { file: String, name: String, expected: Vec<usize>, found: Vec<usize> },
    /// A Rhai script failed; `pos` is `file:line:col` when known.
    #[error("script error at {pos}: {msg}")]
    Script { pos: String, msg: String },
    /// A host function called by a script failed (I/O, a bad argument, a tensor
    /// error); `pos` is the call's `file:line:col`. Scripts cannot raise this
    /// kind themselves (see `script::error::HostError`).
    #[error("host error at {pos}: {msg}")]
    Host { pos: String, msg: String },
    /// An argument or value is outside what the function accepts.
    #[error("{0}")]
    Invalid(String),
    /// An error from candle (tensor ops, devices).
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// An error from the tokenizers crate.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}

/// The library's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
    /// A free-form invalid-input error.
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::Invalid(msg.into())
    }
}
