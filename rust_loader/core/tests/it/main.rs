//! The crate's integration tests, as one test binary: each `tests/*.rs` file would be a binary of its own,
//! and every one of them links the crate with its dependencies (arrow, parquet, tokenizers) under the release
//! profile's LTO, about a minute each on a 2-core machine.
mod columnar;
mod loader;
mod module_layers;
