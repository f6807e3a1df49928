//! Bindings for rewards: the built-in math checker, or a Rhai closure
//! `|response, answer| -> bool or number` as the reward function.

use rhai::plugin::{export_module, exported_module};
use rhai::{Array, Dynamic, Engine, FnPtr, NativeCallContext};

use super::{lock, RolloutHandle};
use crate::reward::{self, ExtractMode};
use crate::script::convert::num;
use crate::script::error::{bad_arg, RhaiResult};

fn score_builtin(r: &RolloutHandle) -> RhaiResult<Array> {
    let mut st = lock(&r.0, "rollout")?;
    let answers: Vec<Option<String>> = st.batch.prompts.iter().map(|p| p.answer.clone()).collect();
    let mut out = Array::new();
    for s in &mut st.batch.samples {
        let gold = answers.get(s.prompt_index).cloned().flatten().ok_or_else(|| {
            bad_arg("score", format!("prompt {} has no answer to check against", s.prompt_index))
        })?;
        let v = reward::verify(&gold, &s.text, ExtractMode::Strict);
        let x = if v.correct { 1.0 } else { 0.0 };
        s.reward = Some(x);
        out.push((x as f64).into());
    }
    st.clear_derived();
    Ok(out)
}

fn score_with(ctx: &NativeCallContext, r: &RolloutHandle, f: &FnPtr) -> RhaiResult<Array> {
    // Copy what the closure needs, so the closure may itself use the rollout.
    let (pairs, answers): (Vec<(String, usize)>, Vec<Option<String>>) = {
        let st = lock(&r.0, "rollout")?;
        (
            st.batch.samples.iter().map(|s| (s.text.clone(), s.prompt_index)).collect(),
            st.batch.prompts.iter().map(|p| p.answer.clone()).collect(),
        )
    };
    let mut rewards = Vec::with_capacity(pairs.len());
    for (i, (text, pi)) in pairs.into_iter().enumerate() {
        let ans = answers.get(pi).cloned().flatten().map_or(Dynamic::UNIT, Dynamic::from);
        let v: Dynamic = f.call_within_context(ctx, (text, ans))?;
        let x = if let Ok(b) = v.as_bool() {
            if b {
                1.0
            } else {
                0.0
            }
        } else {
            num(&v).ok_or_else(|| {
                bad_arg(
                    "score",
                    format!("the reward function must return a bool or a number, found {}", v.type_name()),
                )
            })?
        };
        if !(x as f32).is_finite() {
            return Err(bad_arg(
                "score",
                format!(
                    "the reward function returned {x} for sample {i} (prompt {pi}), which is not a \
                     finite f32 (|r| < 3.4e38)"
                ),
            ));
        }
        rewards.push(x as f32);
    }
    let mut st = lock(&r.0, "rollout")?;
    for (s, x) in st.batch.samples.iter_mut().zip(&rewards) {
        s.reward = Some(*x);
    }
    st.clear_derived();
    Ok(rewards.into_iter().map(|x| Dynamic::from(x as f64)).collect())
}

/// Registers the reward functions.
pub(super) fn register(engine: &mut Engine) {
    engine.register_global_module(exported_module!(fns).into());
}

/// The script-visible reward functions.
#[export_module]
mod fns {
    use rhai::{Array, Dynamic, FnPtr, NativeCallContext};

    use super::RolloutHandle;
    use crate::reward::{self, ExtractMode};
    use crate::script::error::RhaiResult;

    /// verify(answer, response) -> bool
    ///
    /// True when the last \boxed{} of `response` is mathematically equivalent to `answer`.
    ///
    /// # Example
    ///
    /// ```rhai
    /// verify("1/2", "so \\boxed{0.5}")
    /// ```
    #[rhai_fn(volatile)]
    pub fn verify(answer: &str, response: &str) -> bool {
        reward::verify(answer, response, ExtractMode::Strict).correct
    }

    /// extract_answer(response) -> string or ()
    ///
    /// The content of the last \boxed{} of `response`.
    ///
    /// # Example
    ///
    /// ```rhai
    /// extract_answer("x = \\boxed{7}")
    /// ```
    #[rhai_fn(volatile)]
    pub fn extract_answer(response: &str) -> Dynamic {
        reward::extract_answer(response, ExtractMode::Strict).map_or(Dynamic::UNIT, Dynamic::from)
    }

    /// is_equivalent(a, b) -> bool
    ///
    /// Math equivalence of two answers (fractions, decimals, intervals, ...).
    ///
    /// # Example
    ///
    /// ```rhai
    /// is_equivalent("\\frac{1}{2}", "0.5")
    /// ```
    #[rhai_fn(volatile)]
    pub fn is_equivalent(a: &str, b: &str) -> bool {
        reward::is_equivalent(a, b)
    }

    /// score(rollout) -> array of float
    ///
    /// Scores every sample with the built-in checker (1 correct, 0 wrong) against its prompt's
    /// answer; stores the rewards in the rollout.
    ///
    /// # Example
    ///
    /// ```rhai
    /// let rs = score(r);
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn score(r: RolloutHandle) -> RhaiResult<Array> {
        super::score_builtin(&r)
    }

    /// score(rollout, reward_fn) -> array of float
    ///
    /// Scores with a closure `|response, answer| -> bool or number`.
    ///
    /// # Example
    ///
    /// ```rhai
    /// score(r, |resp, ans| resp.contains(ans))
    /// ```
    #[rhai_fn(name = "score", volatile, return_raw)]
    pub fn score_with(ctx: NativeCallContext, r: RolloutHandle, f: FnPtr) -> RhaiResult<Array> {
        super::score_with(&ctx, &r, &f)
    }
}
