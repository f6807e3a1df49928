//! The library's one error type. Every variant says what was expected, what was
//! found, and where (file, line, field, tensor name and shape).

use std::path::PathBuf;

/// Errors raised by the stapo library. The binary wraps them with `anyhow` context.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        #[source]
        source: std::io::Error,
    },
    /// A line of a text file (JSONL, config) could not be parsed.
    #[error("{path}:{line}: {msg}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The line, from 1.
        line: usize,
        /// What is wrong with it.
        msg: String,
    },
    /// A required configuration field is missing or has an invalid value.
    #[error("{file}: field `{field}`: {msg}")]
    Config {
        /// The file (or source, such as `run config`) the value came from.
        file: String,
        /// The field's dotted path.
        field: String,
        /// What is wrong with the value.
        msg: String,
    },
    /// A tensor is absent from a checkpoint.
    #[error("{file}: missing tensor `{name}`")]
    MissingTensor {
        /// The checkpoint file.
        file: String,
        /// The tensor's name.
        name: String,
    },
    /// A tensor in a checkpoint has the wrong shape.
    #[error("{file}: tensor `{name}` has shape {found:?}, expected {expected:?}")]
    Shape {
        /// The checkpoint file.
        file: String,
        /// The tensor's name.
        name: String,
        /// The shape the model needs.
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },
    /// A Rhai script failed; `pos` is `file:line:col` when known.
    #[error("script error at {pos}: {msg}")]
    Script {
        /// Where: `file:line:col` when known.
        pos: String,
        /// The engine's message.
        msg: String,
    },
    /// A host function called by a script failed (I/O, a bad argument, a tensor
    /// error); `pos` is the call's `file:line:col`. Scripts cannot raise this
    /// kind themselves (see `script::error::HostError`).
    #[error("host error at {pos}: {msg}")]
    Host {
        /// The call's `file:line:col`.
        pos: String,
        /// What failed.
        msg: String,
    },
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
