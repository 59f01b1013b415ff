//! Thin PyO3 layer over `recipe_core`.
use pyo3::prelude::*;

#[pymodule]
fn _loader(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
