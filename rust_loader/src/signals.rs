//! Long native work that Python signals can still interrupt.
//!
//! Python runs a signal handler (Ctrl-C's `KeyboardInterrupt`, a SIGTERM handler) only when the main thread
//! executes bytecode or calls `PyErr_CheckSignals`, so native code that runs for minutes with the GIL released
//! would hold a Ctrl-C until it returns. [`interruptible`] runs the work on a helper thread and, from the
//! calling thread, takes the GIL every [`POLL`] to run pending handlers; one that raises stops the work (through
//! its cancel flag) and its exception is returned.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use pyo3::prelude::*;

/// How often pending signal handlers get a chance to run.
const POLL: Duration = Duration::from_millis(100);

/// Tells the waiting thread that the work is over, when dropped.
struct Finished<'a>(&'a (Mutex<bool>, Condvar));

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        *self.0 .0.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.0 .1.notify_one();
    }
}

/// Runs `work(cancel)` with the GIL released, running Python's signal handlers every [`POLL`] meanwhile. When a
/// handler raises, `cancel` is set, the work is waited for (it should return soon after) and the handler's
/// exception is returned; otherwise the work's result.
pub fn interruptible<T: Send>(
    py: Python<'_>,
    work: impl FnOnce(&AtomicBool) -> T + Send,
) -> PyResult<T> {
    let cancel = AtomicBool::new(false);
    let done = (Mutex::new(false), Condvar::new());
    std::thread::scope(|scope| {
        let worker = scope.spawn(|| {
            let _finished = Finished(&done); // also when `work` panics
            work(&cancel)
        });
        let mut raised = None;
        loop {
            let finished = py.detach(|| {
                let guard = done.0.lock().unwrap_or_else(|e| e.into_inner());
                let (guard, _) = done
                    .1
                    .wait_timeout_while(guard, POLL, |finished| !*finished)
                    .unwrap_or_else(|e| e.into_inner());
                *guard
            });
            if finished {
                break;
            }
            if raised.is_none() {
                if let Err(e) = py.check_signals() {
                    cancel.store(true, Ordering::Relaxed);
                    raised = Some(e);
                }
            }
        }
        let out = worker
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p));
        match raised {
            Some(e) => Err(e),
            None => Ok(out),
        }
    })
}
