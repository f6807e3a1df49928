//! Non-finite values: the tensors of a folder about to become a checkpoint verified
//! finite ([`check_folder_finite`]), and the streak of steps that skipped an optimizer
//! step for a non-finite loss, gradient norm or update ([`NonFiniteStreak`]), which
//! stops a run after `guard.max_nonfinite_steps` in a row.

use std::path::Path;

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};

use crate::{Error, Result};

/// Checks every float tensor of every `*.safetensors` file in `dir` (model and optimizer
/// state) for NaN and infinity, one tensor at a time; `what` names the folder's role in
/// the error (`checkpoint step-000004`), which names the file and the tensor.
pub fn check_folder_finite(dir: &Path, what: &str) -> Result<()> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    for f in &files {
        // SAFETY: read-only mapping of a file this process has just written and nobody
        // else writes (the folder is still the private temporary one).
        let st = unsafe { MmapedSafetensors::new(f) }.map_err(|e| Error::Config {
            file: f.display().to_string(),
            field: "<safetensors>".into(),
            msg: format!("unreadable: {e}"),
        })?;
        let mut names: Vec<String> = st.tensors().into_iter().map(|(n, _)| n).collect();
        names.sort();
        for name in names {
            let t = st.load(&name, &Device::Cpu)?;
            if !t.dtype().is_float() {
                continue;
            }
            let t = t.to_dtype(DType::F32)?.flatten_all()?;
            let bad = t.to_vec1::<f32>()?.iter().filter(|v| !v.is_finite()).count();
            if bad > 0 {
                return Err(Error::invalid(format!(
                    "{what}: tensor `{name}` in {} holds {bad} non-finite value(s) (NaN or infinity); \
                     the checkpoint was not written and `latest` still names the previous one",
                    f.display()
                )));
            }
        }
    }
    Ok(())
}

/// Consecutive steps that skipped an optimizer step because a value was not finite.
#[derive(Debug, Clone, Default)]
pub struct NonFiniteStreak {
    /// The first step of the current streak and its length.
    first: u64,
    len: usize,
}

impl NonFiniteStreak {
    /// Records step `step` (`reasons`: why each of its skipped optimizer steps was skipped;
    /// empty for a step that skipped none). Returns the error that stops the run when
    /// this makes `limit` steps in a row (`limit` 0: never).
    pub fn observe(&mut self, step: u64, reasons: &[String], limit: usize) -> Option<Error> {
        let Some(last) = reasons.last() else {
            self.len = 0;
            return None;
        };
        if self.len == 0 {
            self.first = step;
        }
        self.len += 1;
        (limit > 0 && self.len >= limit).then(|| {
            Error::invalid(format!(
                "step {step}: {} step(s) in a row (steps {}-{step}) skipped their update because a value \
                 was not finite (step {step}: {last}); stopping the run (guard.max_nonfinite_steps = \
                 {limit}); the weights are those before step {}, and no checkpoint holds a non-finite value",
                self.len, self.first, self.first
            ))
        })
    }

    /// Steps in the current streak.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the last step observed skipped nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn a_streak_stops_at_the_limit_and_resets_on_a_good_step() {
        let mut s = NonFiniteStreak::default();
        let nan = vec!["gradient norm is NaN".to_string()];
        assert!(s.observe(4, &nan, 3).is_none());
        assert!(s.observe(5, &[], 3).is_none(), "a good step resets");
        assert!(s.observe(6, &nan, 3).is_none());
        assert!(s.observe(7, &nan, 3).is_none());
        let e = s.observe(8, &nan, 3).expect("third in a row").to_string();
        assert!(e.contains("step 8") && e.contains("steps 6-8") && e.contains("gradient norm is NaN"), "{e}");
        let mut never = NonFiniteStreak::default();
        assert!((0..10).all(|i| never.observe(i, &nan, 0).is_none()));
        assert_eq!(never.len(), 10);
    }

    #[test]
    fn a_folder_with_a_nan_tensor_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let good = candle_core::Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
        let bad = candle_core::Tensor::new(&[1f32, f32::NAN, f32::INFINITY], &Device::Cpu).unwrap();
        let ids = candle_core::Tensor::new(&[1u32, 2], &Device::Cpu).unwrap();
        let ok: HashMap<String, _> = [("a".to_string(), good.clone()), ("ids".to_string(), ids)].into();
        candle_core::safetensors::save(&ok, dir.path().join("model.safetensors")).unwrap();
        check_folder_finite(dir.path(), "checkpoint step-000001").unwrap();
        let with_nan: HashMap<String, _> = [("a".to_string(), good), ("b.exp_avg".to_string(), bad)].into();
        candle_core::safetensors::save(&with_nan, dir.path().join("optimizer.safetensors")).unwrap();
        let e = check_folder_finite(dir.path(), "checkpoint step-000001").unwrap_err().to_string();
        assert!(
            e.contains("`b.exp_avg`") && e.contains("optimizer.safetensors") && e.contains("2 non-finite"),
            "{e}"
        );
    }
}
