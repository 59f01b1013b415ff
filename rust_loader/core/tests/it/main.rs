//! The crate's integration tests, as one test binary: each `tests/*.rs` file would be a binary of its own,
//! and every one of them links the crate with its dependencies (arrow, parquet, tokenizers) under the release
//! profile's LTO, about a minute each on a 2-core machine.
mod columnar;
mod fuzz_corpus;
#[path = "../../fuzz/src/harness.rs"]
mod fuzz_harness;
mod loader;
mod module_layers;

use std::path::{Path, PathBuf};

use recipe_core::{LoaderConfig, LoaderOptions};

/// The test tokenizer (a small T5-style tokenizer.json).
fn tokenizer() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer.json")
}

/// A loader over `paths` with short lengths, `batch_size` rows a batch and its cache under `cache`.
fn config_with(paths: &[&Path], cache: &Path, batch_size: usize) -> LoaderConfig {
    LoaderConfig {
        paths: paths.iter().map(|p| p.display().to_string()).collect(),
        tokenizer: tokenizer(),
        options: LoaderOptions {
            max_source_length: 64,
            max_target_length: 128,
            batch_size: Some(batch_size),
            num_threads: Some(2),
            prefetch: 4,
            cache_dir: Some(cache.join("cache")),
            ..LoaderOptions::default()
        },
    }
}
