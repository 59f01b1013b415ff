//! The loader reads back every format the generator writes, with the same records: a seed's recipes give the
//! same token ids from CSV, JSONL, Parquet and Arrow, plain or compressed.
use std::path::{Path, PathBuf};

use crate::write_sample_file;
use recipe_core::{Loader, LoaderConfig, LoaderOptions};

fn tokenizer() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../core/tests/data/tokenizer.json")
}

/// Every batch's labels, row by row, of one epoch of `path` (natural order).
fn rows(path: &Path, cache: &Path) -> Vec<Vec<i64>> {
    let mut l = Loader::new(LoaderConfig {
        paths: vec![path.display().to_string()],
        tokenizer: tokenizer(),
        options: LoaderOptions {
            max_source_length: 64,
            max_target_length: 128,
            batch_size: Some(4),
            num_threads: Some(2),
            cache_dir: Some(cache.to_path_buf()),
            ..LoaderOptions::default()
        },
    })
    .unwrap();
    let mut out = vec![];
    while let Some(b) = l.next_batch().unwrap() {
        for r in 0..b.rows {
            let mut row = b.input_ids[r * b.source_len..(r + 1) * b.source_len].to_vec();
            row.extend(&b.labels[r * b.target_len..(r + 1) * b.target_len]);
            out.push(row);
        }
    }
    out
}

#[test]
fn every_format_reads_back_as_the_same_records() {
    let dir = recipe_core::scratch::ScratchDir::new().unwrap();
    let cache = dir.path().join("cache");
    let csv = dir.path().join("r.csv");
    write_sample_file(&csv, 300, 2, None).unwrap();
    let want = rows(&csv, &cache);
    assert_eq!(want.len(), 300);
    for (name, magic) in [
        ("r.jsonl", &b"{"[..]),
        ("r.parquet", &b"PAR1"[..]),
        ("r.arrow", &b"ARROW1"[..]),
        ("a.jsonl.zstd", &b"\x28\xb5\x2f\xfd"[..]),
        ("B.JSONL.GZ", &b"\x1f\x8b"[..]),
        ("c.csv.Zst", &b"\x28\xb5\x2f\xfd"[..]),
        ("d.parquet.gz", &b"\x1f\x8b"[..]),
    ] {
        let p = dir.path().join(name);
        write_sample_file(&p, 300, 2, None).unwrap();
        assert!(std::fs::read(&p).unwrap().starts_with(magic), "{name}");
        assert_eq!(rows(&p, &cache), want, "{name}");
    }
}
