//! Signals that ask a run to stop: the first SIGINT (Ctrl-C), SIGTERM (what Slurm,
//! Kubernetes, `timeout` and `docker stop` send) or SIGUSR1 (Slurm's warning ahead of a
//! preemption, `--signal=USR1@90`) sets a process-wide flag, which the script engine's
//! `on_progress`, the rollout's decode steps and the training loop check: a rollout in
//! progress is abandoned, an update in progress finishes, and the training loop then
//! writes a checkpoint and returns. `stapo run` exits with `128 + signal` (130 for SIGINT,
//! 143 for SIGTERM, 138 for SIGUSR1 on Linux). A second signal before the flag is cleared
//! exits at once with `128 + signal`; every checkpoint write is atomic (a temporary folder
//! renamed into place, then `latest` renamed over), so this leaves the last complete
//! checkpoint as it was.
//!
//! Under several ranks (`mpirun`) each process has its flag, set when the signal reaches
//! it: the ranks agree between steps whether to stop (the flag set on any of them), so
//! that they all stop at the same step boundary, and a rank that received no signal
//! adopts the one another rank received ([`adopt`]), so that every rank exits alike. A
//! rollout cancelled on one rank fails the step on all of them.
//!
//! TorchTitan, verl and TRL save on SIGTERM the same way (a flag checked between steps),
//! as does PyTorch Lightning's `SLURMEnvironment` with `auto_requeue` on SIGUSR1.
//!
//! [`arm_test_signal`] raises signals at named points of a step (`rollout`, `update`,
//! `save`), so that tests can signal a real process at a chosen moment; `stapo` arms it
//! from `STAPO_TEST_SIGNAL` (see [`TestSignal::parse`]).
//!
//! Uses the C library's `signal`, `raise` and `_exit` directly (std links it anyway); the
//! handler only touches atomics, which is async-signal-safe. On non-Unix targets the flag
//! exists but nothing sets it.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Mutex;

use crate::{Error, Result};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// The first signal received since the flag was last cleared (0: none).
static RECEIVED: AtomicI32 = AtomicI32::new(0);

/// SIGINT (Ctrl-C).
pub const SIGINT: i32 = 2;
/// SIGTERM.
pub const SIGTERM: i32 = 15;
/// SIGUSR1 (its number differs between Linux and the BSDs).
pub const SIGUSR1: i32 = if cfg!(any(
    target_os = "macos",
    target_os = "ios",
    target_os = "freebsd",
    target_os = "openbsd",
    target_os = "netbsd"
)) {
    30
} else {
    10
};

#[cfg(unix)]
mod imp {
    use std::sync::atomic::Ordering;

    extern "C" {
        fn signal(signum: i32, handler: usize) -> usize;
        fn raise(sig: i32) -> i32;
        fn _exit(code: i32) -> !;
    }

    extern "C" fn on_signal(sig: i32) {
        let _ = super::RECEIVED.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
        if super::INTERRUPTED.swap(true, Ordering::SeqCst) {
            // SAFETY: `_exit` is async-signal-safe and never returns.
            unsafe { _exit(128 + sig) }
        }
    }

    /// Registers `on_signal` for each of `signals`.
    pub fn install(signals: &[i32]) {
        for &s in signals {
            // SAFETY: installs a handler that only uses atomics and `_exit`.
            unsafe {
                signal(s, on_signal as extern "C" fn(i32) as usize);
            }
        }
    }

    /// Sends `sig` to this process.
    pub fn send(sig: i32) {
        // SAFETY: `raise` has no memory-safety preconditions.
        unsafe {
            raise(sig);
        }
    }
}

/// Installs the SIGINT handler (the REPL: Ctrl-C cancels the running command) and returns
/// the flag it sets.
pub fn install() -> &'static AtomicBool {
    #[cfg(unix)]
    imp::install(&[SIGINT]);
    &INTERRUPTED
}

/// Installs the handler for SIGINT, SIGTERM and SIGUSR1 (`stapo run`: any of them stops
/// the run after a checkpoint) and returns the flag it sets.
pub fn install_preemption() -> &'static AtomicBool {
    #[cfg(unix)]
    imp::install(&[SIGINT, SIGTERM, SIGUSR1]);
    &INTERRUPTED
}

/// Clears the flag (after a cancelled step has been handled).
pub fn clear() {
    RECEIVED.store(0, Ordering::SeqCst);
    INTERRUPTED.store(false, Ordering::SeqCst);
}

/// Records `sig` as received and sets the flag, as the handler does: another rank of the
/// job received it, and this one stops (and exits) as that one does. A signal received
/// before stays the one reported.
pub fn adopt(sig: i32) {
    let _ = RECEIVED.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// The signals a stop comes from, in the order [`adopt_received`] prefers them.
const STOPS: [i32; 3] = [SIGTERM, SIGUSR1, SIGINT];

/// The signal this process received as counts over SIGTERM, SIGUSR1 and SIGINT (a single
/// 1, or none), to be summed over the ranks of a job.
pub fn received_counts() -> [f64; 3] {
    let own = received();
    STOPS.map(|s| f64::from(u8::from(own == Some(s))))
}

/// With `counts`, [`received_counts`] summed over the ranks of a job: the signal this
/// process stops for, its own, else the first that another rank received (which it
/// [adopts](adopt)); `None` when no rank received one.
pub fn adopt_received(counts: &[f64; 3]) -> Option<i32> {
    if let Some(own) = received() {
        return Some(own);
    }
    let other = STOPS.iter().zip(counts).find(|(_, &n)| n > 0.0).map(|(&s, _)| s)?;
    adopt(other);
    Some(other)
}

/// The first signal received since the flag was last cleared.
pub fn received() -> Option<i32> {
    Some(RECEIVED.load(Ordering::SeqCst)).filter(|&s| s != 0)
}

/// The name of signal `sig` (`SIGTERM`).
pub fn name(sig: i32) -> String {
    match sig {
        SIGINT => "SIGINT".into(),
        SIGTERM => "SIGTERM".into(),
        SIGUSR1 => "SIGUSR1".into(),
        other => format!("signal {other}"),
    }
}

/// What stopped the run, for messages: `SIGTERM`, or `Ctrl-C` when the flag was set
/// without a signal (or by SIGINT).
pub fn cause() -> String {
    match received() {
        Some(SIGINT) | None => "Ctrl-C".into(),
        Some(s) => name(s),
    }
}

/// A test's request: raise `signals` (one after the other) when the run reaches `point`
/// of step `step`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestSignal {
    /// The signals, in order.
    pub signals: Vec<i32>,
    /// `rollout` (the first decoded token), `update` (the update starts) or `save` (the
    /// checkpoint's files are written, not yet renamed into place).
    pub point: String,
    /// The step (0-based) at which to raise them.
    pub step: u64,
}

/// The points of a step where [`TestSignal`] can raise its signals.
pub const TEST_POINTS: [&str; 3] = ["rollout", "update", "save"];

impl TestSignal {
    /// Parses `SIGNALS@POINT:STEP`, e.g. `TERM@update:2` or `TERM,TERM@save:1` (SIGNALS:
    /// `INT`, `TERM` or `USR1`, comma-separated; POINT one of [`TEST_POINTS`]).
    pub fn parse(spec: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::invalid(format!(
                "STAPO_TEST_SIGNAL={spec:?}: {why} (expected SIGNALS@POINT:STEP, e.g. TERM@update:2, \
                 with SIGNALS among INT, TERM, USR1 and POINT among {})",
                TEST_POINTS.join(", ")
            ))
        };
        let (sigs, at) = spec.split_once('@').ok_or_else(|| bad("no `@`"))?;
        let (point, step) = at.split_once(':').ok_or_else(|| bad("no `:STEP`"))?;
        let signals = sigs
            .split(',')
            .map(|s| match s.trim().trim_start_matches("SIG") {
                "INT" => Ok(SIGINT),
                "TERM" => Ok(SIGTERM),
                "USR1" => Ok(SIGUSR1),
                other => Err(bad(&format!("unknown signal `{other}`"))),
            })
            .collect::<Result<Vec<_>>>()?;
        if !TEST_POINTS.contains(&point) {
            return Err(bad(&format!("unknown point `{point}`")));
        }
        let step = step.parse().map_err(|_| bad(&format!("`{step}` is not a step number")))?;
        Ok(Self { signals, point: point.to_string(), step })
    }
}

static ARMED: Mutex<Option<TestSignal>> = Mutex::new(None);

/// Arms `t`: the run raises its signals when it reaches its point (once).
pub fn arm_test_signal(t: TestSignal) {
    if let Ok(mut a) = ARMED.lock() {
        *a = Some(t);
    }
}

/// Called by the trainer at `point` of step `step`: raises the armed signals when they
/// were asked for here (and disarms them).
pub fn reached(point: &str, step: u64) {
    let Ok(mut armed) = ARMED.lock() else { return };
    if !armed.as_ref().is_some_and(|t| t.point == point && t.step == step) {
        return;
    }
    let Some(t) = armed.take() else { return };
    drop(armed);
    #[cfg(unix)]
    for s in t.signals {
        imp::send(s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_signal_specs() {
        let t = TestSignal::parse("TERM,SIGTERM@save:3").unwrap();
        assert_eq!(t, TestSignal { signals: vec![SIGTERM, SIGTERM], point: "save".into(), step: 3 });
        assert_eq!(TestSignal::parse("USR1@rollout:0").unwrap().signals, [SIGUSR1]);
        for bad in ["TERM", "TERM@save", "HUP@save:1", "TERM@eval:1", "TERM@save:x"] {
            let e = TestSignal::parse(bad).unwrap_err().to_string();
            assert!(e.contains("STAPO_TEST_SIGNAL") && e.contains(bad), "{e}");
        }
    }
}
