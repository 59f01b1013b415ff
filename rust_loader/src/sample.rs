//! Python binding of `recipe_sample`: `write_sample(path, n, seed, fmt)`.
use std::path::PathBuf;

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use recipe_sample::{write_sample_file, SampleError, SampleFormat};

/// Writes `n` generated recipes to `path` in the format its name says (`.csv`, `.jsonl`, `.parquet`, `.arrow`;
/// a `.gz` or `.zst` suffix compresses); `fmt` ("recipenlg-csv", "foodcom-csv", "jsonl", "parquet", "arrow"), if
/// given, must agree with the name (`foodcom-csv` picks Food.com's layout for a `.csv`). Returns the format
/// written. Raises ValueError for an unknown format or file name and OSError when the file cannot be written.
#[pyfunction]
#[pyo3(signature = (path, n, seed = 0, fmt = None))]
fn write_sample(
    py: Python<'_>,
    path: PathBuf,
    n: u64,
    seed: u64,
    fmt: Option<&str>,
) -> PyResult<&'static str> {
    let requested = fmt.map(SampleFormat::parse).transpose().map_err(to_py)?;
    let written = py
        .detach(|| write_sample_file(&path, n, seed, requested))
        .map_err(to_py)?;
    Ok(written.name())
}

fn to_py(err: SampleError) -> PyErr {
    match err {
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
        _ => PyValueError::new_err(err.to_string()),
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(write_sample, m)?)?;
    Ok(())
}
