//! Ctrl-C for the CLI: the first SIGINT sets a process-wide flag, which the
//! engine's `on_progress` and the training loop (rollout decode steps) check,
//! so the running step stops and control returns to the script (or the REPL
//! prompt); a second SIGINT before the flag is cleared exits at once.
//!
//! Uses the C library's `signal` directly (std links it anyway); the handler
//! only touches atomics, which is async-signal-safe. On non-Unix targets the
//! flag exists but nothing sets it.

use std::sync::atomic::{AtomicBool, Ordering};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

#[cfg(unix)]
mod imp {
    use std::sync::atomic::Ordering;

    extern "C" {
        fn signal(signum: i32, handler: usize) -> usize;
        fn _exit(code: i32) -> !;
    }

    const SIGINT: i32 = 2;

    extern "C" fn on_sigint(_sig: i32) {
        if super::INTERRUPTED.swap(true, Ordering::SeqCst) {
            // SAFETY: `_exit` is async-signal-safe and never returns.
            unsafe { _exit(130) }
        }
    }

    /// Registers `on_sigint` for SIGINT.
    pub fn install() {
        // SAFETY: installs a handler that only uses atomics and `_exit`.
        unsafe {
            signal(SIGINT, on_sigint as extern "C" fn(i32) as usize);
        }
    }
}

/// Installs the SIGINT handler (once is enough) and returns the flag it sets.
pub fn install() -> &'static AtomicBool {
    #[cfg(unix)]
    imp::install();
    &INTERRUPTED
}

/// Clears the flag (after a cancelled step has been handled).
pub fn clear() {
    INTERRUPTED.store(false, Ordering::SeqCst);
}
