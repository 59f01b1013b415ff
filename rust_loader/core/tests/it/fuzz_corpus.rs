//! The fuzz targets' committed corpora (`fuzz/corpus/`: the seeds, what the fuzzers found that reached new
//! code, and every input that once failed), replayed through the same harness on every `cargo test`.
use std::path::Path;

use crate::fuzz_harness;

fn replay(target: &str, run: fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut inputs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .collect();
    inputs.sort();
    assert!(
        inputs.len() >= 5,
        "{}: the corpus is missing",
        dir.display()
    );
    for input in inputs {
        let bytes = std::fs::read(&input).expect("a corpus file");
        if std::panic::catch_unwind(|| run(&bytes)).is_err() {
            panic!("{target} panicked on {}", input.display());
        }
    }
}

#[test]
fn every_data_file_in_the_corpus_is_read_or_refused_without_a_panic() {
    replay("read_file", fuzz_harness::read_file);
}

#[test]
fn every_damaged_index_cache_in_the_corpus_is_indexed_again() {
    replay("index_cache", fuzz_harness::index_cache);
}

/// The loader's one line for a file the fuzzer found, its first byte (the harness's choice of name) dropped.
fn loader_error(found: &str, name: &str) -> String {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let bytes = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz/corpus/read_file")
            .join(found),
    )
    .unwrap();
    let path = dir.path().join(name);
    std::fs::write(&path, &bytes[1..]).unwrap();
    match recipe_core::Loader::new(crate::config_with(&[&path], dir.path(), 4)) {
        Ok(_) => panic!("{found} was read"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn an_arrow_batch_whose_buffers_lie_outside_it_is_one_line_naming_the_file() {
    let line = loader_error("found-arrow-buffer-length-past-the-body", "found.arrow");
    assert!(
        line.contains("found.arrow")
            && line.contains("not a valid Arrow IPC file: a buffer outside its record batch"),
        "{line}"
    );
}

#[test]
fn a_parquet_footer_declaring_more_elements_than_bytes_is_refused_at_once() {
    let line = loader_error(
        "found-parquet-footer-with-a-list-of-2e31-booleans",
        "found.parquet",
    );
    assert!(
        line.contains("found.parquet")
            && line.contains(
                "not a valid Parquet file: a damaged footer (more elements than bytes left"
            ),
        "{line}"
    );
}
