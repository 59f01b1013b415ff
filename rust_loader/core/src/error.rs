//! The one error type of the loader.
use thiserror::Error;

/// Every failure the loader reports. The Python layer maps `File` to `RecipeFileError` (an `OSError`) and
/// `Data`/`Config` to `RecipeDataError` (a `ValueError`).
#[derive(Debug, Error, Clone, PartialEq)]
pub enum LoaderError {
    /// Missing path, empty glob, unreadable or corrupt file, unreadable tokenizer.
    #[error("{path}: {reason}")]
    File { path: String, reason: String },
    /// A bad record (strict mode) or a file whose content cannot be used; `line` is 1-based, 0 when unknown.
    #[error("{}", fmt_data(.path, *.line, .reason))]
    Data {
        path: String,
        line: u64,
        reason: String,
    },
    /// Bad settings: unknown placeholder, conflicting options.
    #[error("{0}")]
    Config(String),
    /// A bug: a worker panicked. Reported instead of crossing into Python as a panic.
    #[error("internal loader error: {0}")]
    Internal(String),
}

fn fmt_data(path: &str, line: u64, reason: &str) -> String {
    if line == 0 {
        format!("{path}: {reason}")
    } else {
        format!("{path}:{line}: {reason}")
    }
}

impl LoaderError {
    pub fn file(path: impl std::fmt::Display, reason: impl std::fmt::Display) -> Self {
        LoaderError::File {
            path: path.to_string(),
            reason: reason.to_string(),
        }
    }
    pub fn data(path: impl std::fmt::Display, line: u64, reason: impl std::fmt::Display) -> Self {
        LoaderError::Data {
            path: path.to_string(),
            line,
            reason: reason.to_string(),
        }
    }
}

pub type Result<T> = std::result::Result<T, LoaderError>;
