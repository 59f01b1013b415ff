//! What the content check costs on a big file: the xxh3-64 of every byte, as the loader computes it when a
//! data file's inode or ctime differ from the cached index's (`chmod`, a copy with `cp -p`, `rsync -t`).
//!
//! `FILE=/path/to/big.csv cargo bench -p recipe_core --bench content_check`
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use recipe_core::hash::hash_file;

fn main() {
    let path = std::env::var("FILE").expect("FILE=/path/to/a/big/file");
    let size = std::fs::metadata(&path).unwrap().len() as f64;
    for pass in 1..=3 {
        let t = Instant::now();
        let h = hash_file(std::path::Path::new(&path), &AtomicBool::new(false)).unwrap();
        let s = t.elapsed().as_secs_f64();
        println!(
            "pass {pass}: {:.2} GB hashed in {s:.2} s ({:.2} GB/s), xxh3 {h:016x}",
            size / 1e9,
            size / 1e9 / s
        );
    }
}
