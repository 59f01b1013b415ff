//! A scratch directory that is removed when dropped, for the tests and benchmarks of code that reads files.
//!
//! Plain std, on purpose: a dev-dependency such as `tempfile` brings crates (rustix, bitflags with other
//! features) that the wheel's build does not use, and feature unification then builds arrow and parquet a
//! second time for `cargo test`, minutes on a 2-core machine.
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

static NEXT: AtomicU64 = AtomicU64::new(0);

/// A fresh directory under the system's temporary directory; it and its contents go when this is dropped.
pub struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    /// Makes a directory no other process or thread has: the name holds the process id, a counter and the time.
    pub fn new() -> std::io::Result<Self> {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let name = format!(
            "recipe-core-{}-{}-{nanos}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let path = std::env::temp_dir().join(name);
        std::fs::create_dir(&path)?;
        Ok(Self { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        // Best effort: a test that failed may have left a file open; the name is unique either way.
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::ScratchDir;

    #[test]
    fn each_scratch_dir_is_new_and_goes_when_dropped() {
        let a = ScratchDir::new().unwrap();
        let b = ScratchDir::new().unwrap();
        assert_ne!(a.path(), b.path());
        std::fs::write(a.path().join("f"), b"x").unwrap();
        let kept = a.path().to_path_buf();
        drop(a);
        assert!(!kept.exists());
        assert!(b.path().is_dir());
    }
}
