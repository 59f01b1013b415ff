//! Thin PyO3 layer over `recipe_core`: argument conversion, GIL release, numpy hand-over, error mapping.
use std::path::PathBuf;

use numpy::{IntoPyArray, PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyMapping, PyString, PyTuple};
use recipe_core::{Loader, LoaderConfig, LoaderError, LoaderOptions, State};
use serde_json::Value;

mod errors;
mod render;
mod sample;
mod signals;

use errors::to_py;

/// A keyword argument as the JSON-like value `LoaderOptions::set` reads; path-like objects become strings.
fn to_value(v: &Bound<'_, PyAny>) -> PyResult<Value> {
    if v.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(b) = v.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if v.cast::<PyInt>().is_ok() {
        if let Ok(i) = v.extract::<i64>() {
            return Ok(Value::from(i));
        }
        if let Ok(u) = v.extract::<u64>() {
            return Ok(Value::from(u));
        }
        return Ok(Value::String(v.str()?.to_string())); // out of range: the option's check says so
    }
    if let Ok(f) = v.cast::<PyFloat>() {
        return Ok(serde_json::Number::from_f64(f.value()).map_or(Value::Null, Value::Number));
    }
    if let Ok(s) = v.cast::<PyString>() {
        return Ok(Value::String(s.to_string()));
    }
    if v.hasattr("__fspath__")? {
        let os = v.py().import("os")?;
        return Ok(Value::String(
            os.call_method1("fspath", (v,))?.str()?.to_string(),
        ));
    }
    if let Ok(m) = v.cast::<PyMapping>() {
        let mut out = serde_json::Map::new();
        for item in m.items()?.iter() {
            let (key, value) = item.extract::<(Bound<'_, PyAny>, Bound<'_, PyAny>)>()?;
            out.insert(key.str()?.to_string(), to_value(&value)?);
        }
        return Ok(Value::Object(out));
    }
    if v.cast::<PyList>().is_ok() || v.cast::<PyTuple>().is_ok() {
        let items: PyResult<Vec<Value>> = v.try_iter()?.map(|x| to_value(&x?)).collect();
        return Ok(Value::Array(items?));
    }
    Ok(Value::String(v.repr()?.to_string()))
}

/// Logs what the loader gathered as warnings through Python's `logging` (logger `trainer.data`), so they get
/// the application's handlers and secret masking.
fn log_warnings(py: Python<'_>, warnings: Vec<String>) -> PyResult<()> {
    if warnings.is_empty() {
        return Ok(());
    }
    let log = py
        .import("logging")?
        .call_method1("getLogger", ("trainer.data",))?;
    for w in warnings {
        log.call_method1("warning", ("%s", w))?;
    }
    Ok(())
}

/// Streams padded batches of recipe data; see `trainer.data.loader.RecipeStream` for the documented API and
/// `LOADER_OPTIONS` for the keyword options.
#[pyclass(module = "trainer._loader")]
struct RecipeLoader {
    inner: Loader,
}

#[pymethods]
impl RecipeLoader {
    #[new]
    #[pyo3(signature = (paths, tokenizer, **options))]
    fn new(
        py: Python<'_>,
        paths: Vec<String>,
        tokenizer: PathBuf,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let mut pairs = Vec::new();
        for (k, v) in options.into_iter().flat_map(|d| d.iter()) {
            pairs.push((k.extract::<String>()?, to_value(&v)?));
        }
        let options = LoaderOptions::from_pairs(pairs).map_err(to_py)?;
        let cfg = LoaderConfig {
            paths,
            tokenizer,
            options,
        };
        // Indexing can take minutes: Ctrl-C (or a SIGTERM handler that raises) stops it.
        let mut inner = signals::interruptible(py, |cancel| Loader::new_cancellable(cfg, cancel))?
            .map_err(to_py)?;
        log_warnings(py, inner.take_warnings())?;
        Ok(RecipeLoader { inner })
    }

    /// The next batch as a dict of 2-D int64 arrays (packed batches add the segment ids and positions), or None
    /// at the end of the epoch (the stream then moves to the next epoch).
    fn next_batch<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let inner = &mut self.inner;
        let Some(b) = py.detach(|| inner.next_batch()).map_err(to_py)? else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        let (rows, sl, tl) = (b.rows, b.source_len, b.target_len);
        let put = |key: &str, v: Vec<i64>, width: usize| -> PyResult<()> {
            d.set_item(key, v.into_pyarray(py).reshape([rows, width])?)
        };
        put("input_ids", b.input_ids, sl)?;
        put("attention_mask", b.attention_mask, sl)?;
        put("labels", b.labels, tl)?;
        if let Some(s) = b.segments {
            put("encoder_segment_ids", s.encoder_segment_ids, sl)?;
            put("decoder_segment_ids", s.decoder_segment_ids, tl)?;
            put("encoder_positions", s.encoder_positions, sl)?;
            put("decoder_positions", s.decoder_positions, tl)?;
        }
        Ok(Some(d))
    }

    fn __len__(&mut self, py: Python<'_>) -> usize {
        let inner = &mut self.inner;
        py.detach(|| inner.len())
    }

    fn set_epoch(&mut self, epoch: i64) -> PyResult<()> {
        let epoch = u64::try_from(epoch)
            .map_err(|_| errors::config_error(format!("epoch must be >= 0, got {epoch}")))?;
        self.inner.set_epoch(epoch);
        Ok(())
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
        serde_json::to_string(&s).map_err(|e| to_py(LoaderError::Internal(e.to_string())))
    }

    /// `n` of this split's records (all when fewer), drawn with `seed` (the same on every rank), in file
    /// order: dicts as `RecipeRenderer.read` makes them (`id`, `source`, `reference`, `source_ids`,
    /// `target_ids`).
    fn sample_records<'py>(
        &self,
        py: Python<'py>,
        n: usize,
        seed: u64,
    ) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let inner = &self.inner;
        let records = py.detach(|| inner.sample_records(n, seed)).map_err(to_py)?;
        records
            .into_iter()
            .map(|r| render::to_dict(py, r))
            .collect()
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

/// `LOADER_OPTIONS`: the keyword options of `RecipeLoader`, as a list of dicts (`name`, `type`: the Python
/// annotation, `default`, `doc`), from the one declaration in `recipe_core::options`.
fn options_table(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let json = serde_json::to_string(&LoaderOptions::table())
        .map_err(|e| to_py(LoaderError::Internal(e.to_string())))?;
    py.import("json")?.call_method1("loads", (json,))
}

/// The directory where the loader keeps index caches and decoded copies when the data's directory is not
/// writable, and converted datasets: `cache_dir`, else `$XDG_CACHE_HOME/recipe-trainer`, else
/// `~/.cache/recipe-trainer`.
#[pyfunction]
#[pyo3(signature = (cache_dir = None))]
fn cache_root(cache_dir: Option<PathBuf>) -> PathBuf {
    recipe_core::paths::cache_root(cache_dir.as_deref())
}

#[pymodule]
fn _loader(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RecipeLoader>()?;
    m.add_function(wrap_pyfunction!(cache_root, m)?)?;
    m.add("LOADER_OPTIONS", options_table(m.py())?)?;
    errors::register(m)?;
    sample::register(m)?;
    render::register(m)?;
    Ok(())
}
