//! Which kernels serve the model's ops ([`Kernels`]): the fused CPU kernels of
//! this folder or the composed candle ops. The switch lives beside the kernels
//! (which read it in [`super::supported`]) so that they import nothing from
//! model/ above them; `model::options` holds it in `ModelOptions` with the
//! recomputation setting.

use std::cell::Cell;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::{Error, Result};

/// Which implementation serves the ops of the forward and backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kernels {
    /// The fused CPU kernels of [`super`] (`model::fused`) where they apply (CPU tensors
    /// in f32 or f64), the composed candle ops everywhere else.
    #[default]
    Fused,
    /// The composed candle ops on every device and dtype: the code a CUDA or
    /// bf16 run takes, on the CPU (for A/B checks and memory measurements).
    Composed,
}

thread_local! {
    /// The kernels of a [`Kernels::scope`] running on this thread.
    static SCOPED: Cell<Option<Kernels>> = const { Cell::new(None) };
}

/// The process default (`ModelOptions::kernels`), as a byte.
static DEFAULT_KERNELS: AtomicU8 = AtomicU8::new(0);

impl Kernels {
    /// Parses `fused` or `composed`; `what` names the field in the error.
    pub fn parse(s: &str, what: &str) -> Result<Self> {
        match s {
            "fused" => Ok(Self::Fused),
            "composed" => Ok(Self::Composed),
            _ => Err(Error::invalid(format!("{what}: expected \"fused\" or \"composed\", got {s:?}"))),
        }
    }

    /// The name [`Kernels::parse`] reads.
    pub fn name(self) -> &'static str {
        match self {
            Self::Fused => "fused",
            Self::Composed => "composed",
        }
    }

    /// The kernels in force on this thread: those of the innermost
    /// [`Kernels::scope`], else the process default.
    pub fn current() -> Self {
        SCOPED.with(Cell::get).unwrap_or_else(Self::process_default)
    }

    /// Runs `f` with these kernels on this thread (and the process default
    /// unchanged); the previous setting comes back when `f` returns or panics.
    /// Ops dispatch on the thread that builds the graph and runs its backward,
    /// so a forward and backward inside `f` use these kernels throughout.
    pub fn scope<R>(self, f: impl FnOnce() -> R) -> R {
        struct Restore(Option<Kernels>);
        impl Drop for Restore {
            fn drop(&mut self) {
                SCOPED.with(|s| s.set(self.0));
            }
        }
        let _restore = Restore(SCOPED.with(|s| s.replace(Some(self))));
        f()
    }

    /// The process default, as `ModelOptions::set_process_default` last set it
    /// (fused when never set).
    pub(in crate::model) fn process_default() -> Self {
        Self::from_u8(DEFAULT_KERNELS.load(Ordering::Relaxed))
    }

    /// Makes these kernels the process default (through `ModelOptions`).
    pub(in crate::model) fn set_process_default(self) {
        DEFAULT_KERNELS.store(self as u8, Ordering::Relaxed);
    }

    fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Fused,
            _ => Self::Composed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_errors_name_the_field() {
        for k in [Kernels::Fused, Kernels::Composed] {
            assert_eq!(Kernels::parse(k.name(), "x").unwrap(), k);
        }
        let e = Kernels::parse("fast", "--kernels").unwrap_err().to_string();
        assert!(e.contains("--kernels") && e.contains("\"fast\""), "{e}");
        assert_eq!(Kernels::from_u8(Kernels::Composed as u8), Kernels::Composed);
        assert_eq!(Kernels::from_u8(Kernels::Fused as u8), Kernels::Fused);
    }

    /// A scope switches this thread only, nests, and restores the setting
    /// after a panic.
    #[test]
    fn scopes_nest_and_stay_on_their_thread() {
        let outer = Kernels::current();
        Kernels::Composed.scope(|| {
            assert_eq!(Kernels::current(), Kernels::Composed);
            Kernels::Fused.scope(|| assert_eq!(Kernels::current(), Kernels::Fused));
            assert_eq!(Kernels::current(), Kernels::Composed);
            let other = std::thread::spawn(Kernels::current).join().unwrap();
            assert_eq!(other, Kernels::process_default());
        });
        assert_eq!(Kernels::current(), outer);
        let r = std::panic::catch_unwind(|| Kernels::Composed.scope(|| panic!("inside")));
        assert!(r.is_err());
        assert_eq!(Kernels::current(), outer);
    }
}
