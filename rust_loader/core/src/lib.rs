//! recipe_core: reading recipe dumps, rendering, tokenizing and batching, without Python.

pub mod cancel;
pub mod columnar;
pub mod compress;
pub mod error;
pub mod formats;
pub mod hash;
pub mod index;
pub mod mixture;
pub mod options;
pub mod pack;
pub mod parquet_footer;
pub mod paths;
pub mod plan;
pub mod records;
pub mod render;
pub mod scratch;
pub mod split;
pub mod stream;
pub mod tokenize;

pub use error::LoaderError;
pub use options::LoaderOptions;
pub use stream::{Batch, Loader, LoaderConfig, State, Stats};
