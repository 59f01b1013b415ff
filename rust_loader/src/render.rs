//! Python binding of `recipe_core::records`: the training loader's rendering (and tokenization) of prompts and
//! references, for generation and evaluation (`trainer.data.prompt`).
use std::collections::BTreeMap;
use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use recipe_core::formats::{ColumnNames, Format};
use recipe_core::plan::Split;
use recipe_core::records::{Prompter, ReadOptions, Rendered};

use crate::errors::{config_error, to_py};

/// Renders recipes into prompts (sources) and references (targets) with the training loader's templates and
/// list rules; with a tokenizer, also their token ids with the training lengths.
#[pyclass(module = "trainer._loader")]
struct RecipeRenderer {
    inner: Prompter,
}

pub(crate) fn to_dict<'py>(py: Python<'py>, r: Rendered) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("id", r.id)?;
    d.set_item("source", r.source)?;
    d.set_item("reference", r.reference)?;
    let tokenized = !r.source_ids.is_empty();
    d.set_item("source_ids", tokenized.then_some(r.source_ids))?;
    d.set_item("target_ids", r.target_ids)?;
    Ok(d)
}

#[pymethods]
impl RecipeRenderer {
    #[new]
    #[pyo3(signature = (*, task = "ingredients-to-recipe", source_template = None, target_template = None,
        tokenizer = None, max_source_length = 512, max_target_length = 512))]
    fn new(
        py: Python<'_>,
        task: &str,
        source_template: Option<String>,
        target_template: Option<String>,
        tokenizer: Option<PathBuf>,
        max_source_length: usize,
        max_target_length: usize,
    ) -> PyResult<Self> {
        let inner = py
            .detach(|| {
                Prompter::new(
                    task,
                    source_template.as_deref(),
                    target_template.as_deref(),
                    tokenizer
                        .as_deref()
                        .map(|t| (t, max_source_length, max_target_length)),
                )
            })
            .map_err(to_py)?;
        Ok(RecipeRenderer { inner })
    }

    /// The source template in use (a preset's, or the override).
    #[getter]
    fn source_template(&self) -> &str {
        &self.inner.renderer.source.text
    }

    /// The target template in use (a preset's, or the override).
    #[getter]
    fn target_template(&self) -> &str {
        &self.inner.renderer.target.text
    }

    /// Renders one recipe given as fields, as a dict (id, source, reference, source_ids, target_ids).
    #[pyo3(signature = (*, id = "cli:1", title = "", ingredients = Vec::new(), directions = Vec::new(),
        ner = None))]
    fn render<'py>(
        &self,
        py: Python<'py>,
        id: &str,
        title: &str,
        ingredients: Vec<String>,
        directions: Vec<String>,
        ner: Option<Vec<String>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let r = self
            .inner
            .render_fields(id, title, ingredients, directions, ner)
            .map_err(to_py)?;
        to_dict(py, r)
    }

    /// Every usable record of `paths`, in file order, as dicts (id, source, reference, source_ids,
    /// target_ids), with the skip counts by reason and the first skipped records as `file:line: reason`.
    #[pyo3(signature = (paths, *, data_format = None, split = "all", eval_fraction = 0.0, columns = None))]
    #[allow(clippy::type_complexity)]
    fn read<'py>(
        &self,
        py: Python<'py>,
        paths: Vec<String>,
        data_format: Option<&str>,
        split: &str,
        eval_fraction: f64,
        columns: Option<BTreeMap<String, String>>,
    ) -> PyResult<(Vec<Bound<'py, PyDict>>, Bound<'py, PyDict>, Vec<String>)> {
        let format = match data_format {
            None => None,
            Some(f) => Some(Format::parse(f).ok_or_else(|| {
                config_error(format!(
                    "unknown data_format {f:?} (recipenlg-csv, foodcom-csv, jsonl, parquet, arrow)"
                ))
            })?),
        };
        let names = ColumnNames::new(&columns.unwrap_or_default()).map_err(config_error)?;
        let split = Split::parse(split).ok_or_else(|| {
            config_error(format!("split must be all, train or eval, got {split:?}"))
        })?;
        if split != Split::All && !(eval_fraction > 0.0 && eval_fraction < 1.0) {
            return Err(config_error(format!(
                "split {split} needs 0 < eval_fraction < 1, got {eval_fraction}"
            )));
        }
        let opts = ReadOptions {
            format,
            names,
            split,
            eval_fraction,
        };
        let inner = &self.inner;
        let set = py.detach(|| inner.read(&paths, &opts)).map_err(to_py)?;
        let records = set
            .records
            .into_iter()
            .map(|r| to_dict(py, r))
            .collect::<PyResult<Vec<_>>>()?;
        let skipped = PyDict::new(py);
        for (reason, n) in set.skipped {
            skipped.set_item(reason, n)?;
        }
        let examples = set.examples.iter().map(|e| e.to_string()).collect();
        Ok((records, skipped, examples))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RecipeRenderer>()?;
    Ok(())
}
