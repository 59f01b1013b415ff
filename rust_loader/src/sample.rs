//! Python binding of `recipe_core::sample` (owned by the sample-data work).
use pyo3::prelude::*;

pub fn register(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
