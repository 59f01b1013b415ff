//! recipe_core: reading recipe dumps, rendering, tokenizing and batching, without Python.

pub mod error;
pub mod formats;
pub mod hash;
pub mod index;
pub mod plan;
pub mod records;
pub mod render;
pub mod sample;
pub mod stream;
pub mod tokenize;

pub use error::LoaderError;
pub use stream::{Batch, Loader, LoaderConfig, State, Stats};
