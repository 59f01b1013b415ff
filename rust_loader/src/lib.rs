//! Thin PyO3 layer over `recipe_core`: argument conversion, GIL release, numpy hand-over, error mapping.
use std::path::PathBuf;

use numpy::{IntoPyArray, PyArray1, PyArrayMethods};
use pyo3::create_exception;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use recipe_core::plan::{PlanConfig, Split};
use recipe_core::{Loader, LoaderConfig, LoaderError, State};

mod render;
mod sample;

create_exception!(
    _loader,
    RecipeDataError,
    PyValueError,
    "A bad record (strict mode), bad template or settings."
);
create_exception!(
    _loader,
    RecipeFileError,
    PyOSError,
    "A missing, empty, unreadable or corrupt file."
);

fn to_py(e: LoaderError) -> PyErr {
    match e {
        LoaderError::File { .. } => RecipeFileError::new_err(e.to_string()),
        LoaderError::Data { .. } | LoaderError::Config(_) => {
            RecipeDataError::new_err(e.to_string())
        }
        LoaderError::Internal(_) => PyRuntimeError::new_err(e.to_string()),
    }
}

/// Streams padded batches of recipe data; see `trainer.data.RecipeStream` for the documented API.
#[pyclass(module = "trainer._loader")]
struct RecipeLoader {
    inner: Loader,
}

#[pymethods]
impl RecipeLoader {
    #[new]
    #[pyo3(signature = (paths, tokenizer, *, task = "ingredients-to-recipe", source_template = None,
        target_template = None, max_source_length = 512, max_target_length = 512, batch_size = None,
        max_tokens = None, pad_to_multiple_of = None, shuffle = false, seed = 0, epoch = 0, rank = 0,
        world_size = 1, split = "all", eval_fraction = 0.0, strict = false, dedup = false, data_format = None,
        num_threads = None, prefetch = 8, cache_dir = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        paths: Vec<String>,
        tokenizer: PathBuf,
        task: &str,
        source_template: Option<String>,
        target_template: Option<String>,
        max_source_length: usize,
        max_target_length: usize,
        batch_size: Option<usize>,
        max_tokens: Option<usize>,
        pad_to_multiple_of: Option<usize>,
        shuffle: bool,
        seed: u64,
        epoch: u64,
        rank: usize,
        world_size: usize,
        split: &str,
        eval_fraction: f64,
        strict: bool,
        dedup: bool,
        data_format: Option<String>,
        num_threads: Option<usize>,
        prefetch: usize,
        cache_dir: Option<PathBuf>,
    ) -> PyResult<Self> {
        let split = Split::parse(split).ok_or_else(|| {
            RecipeDataError::new_err(format!("split must be all, train or eval, got {split:?}"))
        })?;
        let cfg = LoaderConfig {
            paths,
            tokenizer,
            task: task.to_string(),
            source_template,
            target_template,
            max_source_length,
            max_target_length,
            plan: PlanConfig {
                batch_size,
                max_tokens,
                pad_to_multiple_of: pad_to_multiple_of.unwrap_or(1),
                shuffle,
                seed,
                rank,
                world_size,
                split,
                eval_fraction,
                dedup,
            },
            epoch,
            strict,
            data_format,
            num_threads,
            prefetch,
            cache_dir,
        };
        let inner = py.detach(|| Loader::new(cfg)).map_err(to_py)?;
        Ok(RecipeLoader { inner })
    }

    /// The next batch as a dict of 2-D int64 arrays, or None at the end of the epoch (the stream then moves to
    /// the next epoch).
    fn next_batch<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let inner = &mut self.inner;
        let Some(b) = py.detach(|| inner.next_batch()).map_err(to_py)? else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        let ids: Bound<'py, PyArray1<i64>> = b.input_ids.into_pyarray(py);
        d.set_item("input_ids", ids.reshape([b.rows, b.source_len])?)?;
        d.set_item(
            "attention_mask",
            b.attention_mask
                .into_pyarray(py)
                .reshape([b.rows, b.source_len])?,
        )?;
        d.set_item(
            "labels",
            b.labels.into_pyarray(py).reshape([b.rows, b.target_len])?,
        )?;
        Ok(Some(d))
    }

    fn __len__(&mut self, py: Python<'_>) -> usize {
        let inner = &mut self.inner;
        py.detach(|| inner.len())
    }

    fn set_epoch(&mut self, epoch: u64) {
        self.inner.set_epoch(epoch);
    }

    #[getter]
    fn epoch(&self) -> u64 {
        self.inner.epoch()
    }

    /// `(epoch, batches_consumed, fingerprint)`.
    fn state(&self) -> (u64, u64, String) {
        let s = self.inner.state();
        (s.epoch, s.batches_consumed, s.fingerprint)
    }

    fn load_state(
        &mut self,
        py: Python<'_>,
        epoch: u64,
        batches_consumed: u64,
        fingerprint: String,
    ) -> PyResult<()> {
        let inner = &mut self.inner;
        py.detach(|| {
            inner.load_state(&State {
                epoch,
                batches_consumed,
                fingerprint,
            })
        })
        .map_err(to_py)
    }

    /// Stats as a JSON string.
    fn stats_json(&mut self, py: Python<'_>) -> PyResult<String> {
        let inner = &mut self.inner;
        let s = py.detach(|| inner.stats());
        serde_json::to_string(&s).map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// Token lengths `(source, target)` of the selected records, as 1-D arrays.
    fn lengths<'py>(
        &self,
        py: Python<'py>,
    ) -> (Bound<'py, PyArray1<u16>>, Bound<'py, PyArray1<u16>>) {
        let (s, t) = self.inner.lengths();
        (s.into_pyarray(py), t.into_pyarray(py))
    }
}

#[pymodule]
fn _loader(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RecipeLoader>()?;
    m.add("RecipeDataError", m.py().get_type::<RecipeDataError>())?;
    m.add("RecipeFileError", m.py().get_type::<RecipeFileError>())?;
    sample::register(m)?;
    render::register(m)?;
    Ok(())
}
