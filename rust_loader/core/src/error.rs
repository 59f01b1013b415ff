//! The one error type of the loader.
use thiserror::Error;

/// Every failure the loader reports. The Python layer maps each variant to its own exception class, all under
/// `RecipeLoaderError`: `File` to `RecipeFileError` (an `OSError`, with `errno` when an I/O error caused it),
/// `Data` to `RecipeDataError` (a `ValueError`), `Config` to `RecipeConfigError` (a `RecipeDataError`) and
/// `Internal` to `RecipeInternalError` (a `RuntimeError`); `Cancelled` gives way to the Python exception that
/// asked for it.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum LoaderError {
    /// Missing path, empty glob, unreadable or corrupt file, unreadable tokenizer. `errno` is the operating
    /// system's error number when an I/O error caused it.
    #[error("{path}: {reason}")]
    File {
        path: String,
        reason: String,
        errno: Option<i32>,
    },
    /// A bad record (strict mode) or a file whose content cannot be used; `line` is 1-based, 0 when unknown.
    #[error("{}", fmt_data(.path, *.line, .reason))]
    Data {
        path: String,
        line: u64,
        reason: String,
    },
    /// Bad settings: unknown option or placeholder, conflicting options, a resume state of other data.
    #[error("{0}")]
    Config(String),
    /// A bug: a worker panicked. Reported instead of crossing into Python as a panic.
    #[error("internal loader error: {0}")]
    Internal(String),
    /// The caller stopped the pass (see [`crate::cancel`]); the Python binding raises the exception of the
    /// signal handler that asked for it instead.
    #[error("cancelled")]
    Cancelled,
}

fn fmt_data(path: &str, line: u64, reason: &str) -> String {
    if line == 0 {
        format!("{path}: {reason}")
    } else {
        format!("{path}:{line}: {reason}")
    }
}

impl LoaderError {
    /// A file error without an operating-system cause.
    pub fn file(path: impl std::fmt::Display, reason: impl std::fmt::Display) -> Self {
        LoaderError::File {
            path: path.to_string(),
            reason: reason.to_string(),
            errno: None,
        }
    }
    /// A file error caused by `err`, keeping its errno; `context` (may be empty) says what was being done.
    /// A read that failed with [`Cancelled`] (stopped by [`crate::cancel::CancellableRead`]) is
    /// [`LoaderError::Cancelled`].
    pub fn io(path: impl std::fmt::Display, context: &str, err: &std::io::Error) -> Self {
        if err.get_ref().is_some_and(|e| e.is::<Cancelled>()) {
            return LoaderError::Cancelled;
        }
        LoaderError::File {
            path: path.to_string(),
            reason: if context.is_empty() {
                err.to_string()
            } else {
                format!("{context}: {err}")
            },
            errno: err.raw_os_error(),
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

/// The I/O error a read fails with when the caller stopped it ([`crate::cancel::CancellableRead`]);
/// [`LoaderError::io`] turns it into [`LoaderError::Cancelled`].
#[derive(Debug)]
pub struct Cancelled;

impl std::fmt::Display for Cancelled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("cancelled")
    }
}

impl std::error::Error for Cancelled {}
