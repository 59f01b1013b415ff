//! Thin PyO3 layer over `recipe_core`.
use pyo3::prelude::*;

mod sample;

#[pymodule]
fn _loader(m: &Bound<'_, PyModule>) -> PyResult<()> {
    sample::register(m)?;
    Ok(())
}
