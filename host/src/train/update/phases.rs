//! Where an update's time goes: wall-clock and process CPU seconds per phase
//! (old-policy forward, forward, loss and statistics, backward, optimizer),
//! summed over every update of the process while [`PhaseTimes::start`] is in
//! force (`stapo bench train` turns it on); off, each phase costs one atomic
//! load. The CPU seconds over the wall seconds of a phase say how many cores
//! it kept busy.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// One phase of an update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The old-policy log-probs, a forward without gradient (decoder and head).
    OldPolicy,
    /// The forward with gradient through the decoder layers (to the hidden states).
    Forward,
    /// The head's statistics (log-prob, entropy) from the hidden states and
    /// the objective (loss, its metrics).
    Loss,
    /// The backward, and the gradients added into the mini-batch's store.
    Backward,
    /// Gradient clipping and the optimizer step.
    Optimizer,
}

impl Phase {
    /// Every phase, in the order an update runs them.
    pub const ALL: [Phase; 5] =
        [Phase::OldPolicy, Phase::Forward, Phase::Loss, Phase::Backward, Phase::Optimizer];

    /// The phase's name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Phase::OldPolicy => "old-policy forward (no grad)",
            Phase::Forward => "forward (decoder layers)",
            Phase::Loss => "loss and statistics (head, objective)",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer (clip, AdamW)",
        }
    }

    /// Runs `f` as phase `p`, or untimed for `None`.
    pub fn time_if<R>(p: Option<Phase>, f: impl FnOnce() -> R) -> R {
        match p {
            Some(p) => p.time(f),
            None => f(),
        }
    }

    /// Runs `f` as this phase: its time is added to the totals while recording.
    pub fn time<R>(self, f: impl FnOnce() -> R) -> R {
        if !RECORDING.load(Ordering::Relaxed) {
            return f();
        }
        let (c0, s) = (cpu_seconds(), Instant::now());
        let r = f();
        let wall = s.elapsed().as_secs_f64();
        let cpu = cpu_seconds() - c0;
        if let Ok(mut t) = TOTALS.lock() {
            // Checked again under the lock: a span still running at
            // [`PhaseTimes::stop`] is not added after it.
            if RECORDING.load(Ordering::Relaxed) {
                let slot = &mut t.0[self as usize];
                slot.wall += wall;
                slot.cpu += cpu;
                slot.calls += 1;
            }
        }
        r
    }
}

/// The time of one phase, summed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PhaseTime {
    /// Wall-clock seconds.
    pub wall: f64,
    /// CPU seconds of the whole process (every thread) over the same spans.
    pub cpu: f64,
    /// How many spans were summed.
    pub calls: usize,
}

/// The summed time of every [`Phase`], indexed as [`Phase::ALL`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PhaseTimes(pub [PhaseTime; 5]);

static RECORDING: AtomicBool = AtomicBool::new(false);
static TOTALS: Mutex<PhaseTimes> = Mutex::new(PhaseTimes([PhaseTime { wall: 0.0, cpu: 0.0, calls: 0 }; 5]));

impl PhaseTimes {
    /// Zeroes the totals and starts recording (process-wide).
    pub fn start() {
        if let Ok(mut t) = TOTALS.lock() {
            *t = PhaseTimes::default();
        }
        RECORDING.store(true, Ordering::Relaxed);
    }

    /// Stops recording and returns the totals since [`PhaseTimes::start`].
    pub fn stop() -> PhaseTimes {
        let t = TOTALS.lock();
        RECORDING.store(false, Ordering::Relaxed);
        t.map(|t| *t).unwrap_or_default()
    }

    /// True between [`PhaseTimes::start`] and [`PhaseTimes::stop`].
    pub fn recording() -> bool {
        RECORDING.load(Ordering::Relaxed)
    }

    /// The time of `p`.
    pub fn get(&self, p: Phase) -> PhaseTime {
        self.0[p as usize]
    }

    /// Wall seconds over every phase.
    pub fn wall(&self) -> f64 {
        self.0.iter().map(|t| t.wall).sum()
    }

    /// CPU seconds over every phase.
    pub fn cpu(&self) -> f64 {
        self.0.iter().map(|t| t.cpu).sum()
    }
}

/// CPU seconds this process has used, user and system, every thread (Linux:
/// `/proc/self/stat`, in clock ticks of 10 ms; 0 elsewhere).
pub fn cpu_seconds() -> f64 {
    let read = || -> Option<f64> {
        let s = std::fs::read_to_string("/proc/self/stat").ok()?;
        // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
        let rest = s.rsplit_once(')')?.1;
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
        Some(ticks as f64 / 100.0)
    };
    read().unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Recording sums wall time per phase and counts the spans; a stopped
    /// recorder adds nothing. (One test: the recorder is process-wide.)
    #[test]
    fn phases_sum_while_recording_only() {
        let spin = |ms: u128| {
            let s = Instant::now();
            while s.elapsed().as_millis() < ms {
                std::hint::black_box(0u64);
            }
        };
        PhaseTimes::start();
        Phase::Backward.time(|| spin(30));
        Phase::Backward.time(|| spin(30));
        let v = Phase::Loss.time(|| 7);
        let t = PhaseTimes::stop();
        assert_eq!(v, 7);
        // Other tests' updates may run while this one records: at least ours.
        let b = t.get(Phase::Backward);
        assert!(b.calls >= 2 && t.get(Phase::Loss).calls >= 1, "{t:?}");
        assert!(b.wall >= 0.06, "backward wall {}", b.wall);
        assert!(t.wall() >= b.wall && t.cpu() >= 0.0);
        Phase::Forward.time(|| spin(1));
        assert_eq!(PhaseTimes::stop(), t, "nothing recorded after stop");
    }
}
