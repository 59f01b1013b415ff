//! Python binding of `recipe_core::sample`: `write_sample(path, n, seed, fmt)`.
use std::path::PathBuf;

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use recipe_core::sample::{write_sample_file, SampleError, SampleFormat};

/// Writes `n` generated recipes to `path` in `fmt` ("recipenlg-csv", "foodcom-csv" or "jsonl"); a `.gz` or
/// `.zst` suffix compresses. Raises ValueError for an unknown format and OSError when the file cannot be written.
#[pyfunction]
#[pyo3(signature = (path, n, seed = 0, fmt = "recipenlg-csv"))]
fn write_sample(py: Python<'_>, path: PathBuf, n: u64, seed: u64, fmt: &str) -> PyResult<()> {
    let format = SampleFormat::parse(fmt).map_err(to_py)?;
    py.detach(|| write_sample_file(&path, n, seed, format))
        .map_err(to_py)
}

fn to_py(err: SampleError) -> PyErr {
    match err {
        SampleError::BadFormat(_) => PyValueError::new_err(err.to_string()),
        // OSError(errno, strerror, filename) lets Python pick the subclass (FileNotFoundError, PermissionError...).
        SampleError::Io {
            ref path,
            ref source,
        } => match source.raw_os_error() {
            Some(code) => {
                let text = source.to_string();
                let strerror = text.split(" (os error").next().unwrap_or(&text).to_string();
                PyOSError::new_err((code, strerror, path.clone()))
            }
            None => PyOSError::new_err(err.to_string()),
        },
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(write_sample, m)?)?;
    Ok(())
}
