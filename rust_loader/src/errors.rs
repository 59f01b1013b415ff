//! The loader's exception classes and the one mapping of core errors onto them.
//!
//! `RecipeLoaderError` is the base of all of them; each other class also derives from the built-in exception a
//! caller would expect, so `except OSError` and `except ValueError` keep working:
//! `RecipeFileError(RecipeLoaderError, OSError)` (with `errno` when an I/O error caused it),
//! `RecipeDataError(RecipeLoaderError, ValueError)`, `RecipeConfigError(RecipeDataError)` (bad settings, a resume
//! state of other data) and `RecipeInternalError(RecipeLoaderError, RuntimeError)` (a bug, e.g. a worker panic).
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};
use recipe_core::LoaderError;

create_exception!(
    trainer._loader,
    RecipeLoaderError,
    PyException,
    "Base class of every error the recipe loader raises."
);

struct Classes {
    file: Py<PyType>,
    data: Py<PyType>,
    config: Py<PyType>,
    internal: Py<PyType>,
}

static CLASSES: PyOnceLock<Classes> = PyOnceLock::new();

/// A class with several bases (`create_exception!` takes one), made as `type(name, bases, namespace)` does.
fn class(
    py: Python<'_>,
    name: &str,
    bases: &[Bound<'_, PyType>],
    doc: &str,
) -> PyResult<Py<PyType>> {
    let namespace = PyDict::new(py);
    namespace.set_item("__module__", "trainer._loader")?;
    namespace.set_item("__doc__", doc)?;
    let made = py
        .get_type::<PyType>()
        .call1((name, PyTuple::new(py, bases)?, namespace))?;
    Ok(made.cast_into::<PyType>()?.unbind())
}

fn classes(py: Python<'_>) -> &Classes {
    CLASSES.get_or_init(py, || {
        let base = py.get_type::<RecipeLoaderError>();
        let make = || -> PyResult<Classes> {
            let data = class(
                py,
                "RecipeDataError",
                &[base.clone(), py.get_type::<PyValueError>()],
                "A bad record (strict mode), a bad template or bad settings; names file:line where there is one.",
            )?;
            let config = class(
                py,
                "RecipeConfigError",
                &[data.bind(py).clone()],
                "Bad loader settings (an unknown option, a value out of range, options that conflict) or a \
                 resume state from other data or settings.",
            )?;
            Ok(Classes {
                file: class(
                    py,
                    "RecipeFileError",
                    &[base.clone(), py.get_type::<PyOSError>()],
                    "A missing, empty, unreadable or corrupt file (or tokenizer); names the path. `errno` is \
                     set when an I/O error caused it.",
                )?,
                data,
                config,
                internal: class(
                    py,
                    "RecipeInternalError",
                    &[base.clone(), py.get_type::<PyRuntimeError>()],
                    "A bug in the loader (a worker thread panicked), reported instead of crashing.",
                )?,
            })
        };
        make().expect("creating the loader's exception classes")
    })
}

/// The Python exception for a core error.
pub fn to_py(e: LoaderError) -> PyErr {
    Python::attach(|py| {
        let c = classes(py);
        let (class, errno) = match &e {
            LoaderError::File { errno, .. } => (&c.file, *errno),
            LoaderError::Data { .. } => (&c.data, None),
            LoaderError::Config(_) => (&c.config, None),
            LoaderError::Internal(_) => (&c.internal, None),
            // Only returned after the binding's own signal check raised; never seen otherwise.
            LoaderError::Cancelled => (&c.internal, None),
        };
        let made = || -> PyResult<PyErr> {
            let exc = class.bind(py).call1((e.to_string(),))?;
            if let Some(code) = errno {
                // Set after construction: OSError(errno, strerror) would rewrite the message as "[Errno N] ...".
                exc.setattr("errno", code)?;
            }
            Ok(PyErr::from_value(exc))
        };
        made().unwrap_or_else(|err| err)
    })
}

/// A settings error raised by the binding itself (e.g. a keyword argument of an unsupported type).
pub fn config_error(message: String) -> PyErr {
    to_py(LoaderError::Config(message))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let c = classes(py);
    m.add("RecipeLoaderError", py.get_type::<RecipeLoaderError>())?;
    m.add("RecipeFileError", c.file.bind(py))?;
    m.add("RecipeDataError", c.data.bind(py))?;
    m.add("RecipeConfigError", c.config.bind(py))?;
    m.add("RecipeInternalError", c.internal.bind(py))?;
    Ok(())
}
