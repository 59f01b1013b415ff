//! Stopping a long pass (indexing, decompressing or hashing a file) from another thread: the caller sets a flag
//! and the pass returns [`LoaderError::Cancelled`] within one chunk of records or one read block. The Python
//! binding sets it when a signal handler raises (Ctrl-C) while the loader indexes with the GIL released.
use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Cancelled, LoaderError, Result};

/// `Err(Cancelled)` once `flag` is set.
pub fn check(flag: &AtomicBool) -> Result<()> {
    if flag.load(Ordering::Relaxed) {
        return Err(LoaderError::Cancelled);
    }
    Ok(())
}

/// A reader that fails with [`Cancelled`] once `flag` is set, so a loop over its blocks stops with it.
pub struct CancellableRead<'a, R> {
    inner: R,
    flag: &'a AtomicBool,
}

impl<'a, R: Read> CancellableRead<'a, R> {
    pub fn new(inner: R, flag: &'a AtomicBool) -> Self {
        CancellableRead { inner, flag }
    }
}

impl<R: Read> Read for CancellableRead<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.flag.load(Ordering::Relaxed) {
            return Err(std::io::Error::other(Cancelled));
        }
        self.inner.read(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_flag_stops_reads_and_becomes_cancelled() {
        let flag = AtomicBool::new(false);
        let mut r = CancellableRead::new(&b"abcdef"[..], &flag);
        let mut buf = [0u8; 2];
        assert_eq!(r.read(&mut buf).unwrap(), 2);
        flag.store(true, Ordering::Relaxed);
        let e = r.read(&mut buf).unwrap_err();
        assert_eq!(
            LoaderError::io("f.csv", "read error", &e),
            LoaderError::Cancelled
        );
        assert_eq!(check(&flag), Err(LoaderError::Cancelled));
    }
}
