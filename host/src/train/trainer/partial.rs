//! Partial rollouts in the training loop (`rollout.partial`): the source of a step's
//! groups when a step ends as soon as `data.prompts_per_step` groups are whole
//! ([`PartialSource`]). It keeps the groups in flight between steps
//! (`rollout::PartialRollout`) with the problem and rendered prompt of each, tops them
//! up with new prompts from the [`PromptSource`] to `prompts_per_step +
//! extra_prompts`, restarts or drops the responses older than `max_staleness`, and
//! hands the step its whole groups. Its state ([`PartialState`]) is saved with each
//! checkpoint; a KV cache kept between steps (`rollout.partial.kv = "keep"`) is not, so
//! a resumed run recomputes the carried responses' keys and values once. Depends on `rollout` (the partial engine), `data` (the examples),
//! `dist` and the run configuration.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::dynamic::Gathered;
use super::prompts::PromptSource;
use crate::data::{Example, Prompt};
use crate::dist::Comm;
use crate::model::Qwen3;
use crate::rollout::{row_seed, GenerateOptions, PartialFigures, PartialRollout, SamplingParams};
use crate::train::RunConfig;
use crate::{Error, Result};

/// The groups a run has in flight between its steps and the problem each answers.
#[derive(Debug, Clone, Default)]
pub(super) struct PartialSource {
    rollout: PartialRollout,
    /// The problem and rendered prompt of each group in flight, by key.
    problems: BTreeMap<u64, (Example, String)>,
    next_key: u64,
}

/// What a checkpoint holds of a [`PartialSource`]: the groups in flight (tokens,
/// per-token log-probs, entropies and policy versions, where each generator stands)
/// and their problems.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(super) struct PartialState {
    rollout: PartialRollout,
    problems: Vec<(u64, Example, String)>,
    next_key: u64,
}

impl PartialState {
    /// Groups in flight.
    pub(super) fn groups_in_flight(&self) -> usize {
        self.rollout.in_flight()
    }
}

impl PartialSource {
    /// The source a checkpoint's `state` describes.
    pub(super) fn restore(state: PartialState) -> Result<Self> {
        let problems: BTreeMap<u64, (Example, String)> =
            state.problems.into_iter().map(|(k, e, t)| (k, (e, t))).collect();
        if let Some(g) = state.rollout.groups().iter().find(|g| !problems.contains_key(&g.key)) {
            return Err(Error::invalid(format!(
                "trainer_state.json: `partial`: group {} in flight has no problem",
                g.key
            )));
        }
        Ok(Self { rollout: state.rollout, problems, next_key: state.next_key })
    }

    /// Its state, for a checkpoint.
    pub(super) fn state(&self) -> PartialState {
        PartialState {
            rollout: self.rollout.clone(),
            problems: self.problems.iter().map(|(k, (e, t))| (*k, e.clone(), t.clone())).collect(),
            next_key: self.next_key,
        }
    }

    /// The next `data.prompts_per_step` whole groups at policy `version` (updates
    /// applied), sampled from `model`: stale responses restarted or dropped, the groups
    /// in flight topped up with the next prompts of `prompts` (seeded as a synchronous
    /// step seeds its batch: `sampling.seed` and the prompt's place in the draw), then
    /// one partial call. The samples are not scored yet.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn next_groups(
        &mut self,
        prompts: &mut PromptSource,
        comm: &dyn Comm,
        model: &Qwen3,
        cfg: &RunConfig,
        sampling: &SamplingParams,
        opts: &GenerateOptions,
        version: u64,
    ) -> Result<(Gathered, PartialFigures)> {
        let pcfg = &cfg.rollout.partial;
        let target = cfg.data.prompts_per_step;
        self.rollout.set_kv(pcfg.kv);
        let stale = self.rollout.enforce_staleness(version, pcfg);
        for k in &stale.dropped {
            self.problems.remove(k);
        }
        let need = pcfg.in_flight(target).saturating_sub(self.rollout.in_flight());
        if need > 0 {
            let (examples, _) = prompts.next_share(need, comm)?;
            let texts: Vec<Prompt> = examples.iter().map(|e| e.prompt()).collect();
            let (ids, rendered) = prompts.generator(model).encode(&texts)?;
            for (i, ((ex, ids), text)) in examples.into_iter().zip(ids).zip(rendered).enumerate() {
                let seeds: Vec<u64> = (0..sampling.n).map(|s| row_seed(sampling.seed, i, s)).collect();
                self.rollout.admit(self.next_key, i, ids, &seeds);
                self.problems.insert(self.next_key, (ex, text));
                self.next_key += 1;
            }
        }
        let step =
            prompts.generator(model).generate_partial(&mut self.rollout, sampling, opts, version, target)?;
        let mut g = Gathered { stats: step.stats, ..Gathered::default() };
        for (key, samples) in step.groups {
            let (ex, text) = self.problems.remove(&key).ok_or_else(|| {
                Error::invalid(format!("partial rollouts: group {key} came back without its problem"))
            })?;
            g.examples.push(ex);
            g.texts.push(text);
            g.samples.extend(samples);
        }
        let mut figures = step.figures;
        figures.restarted_responses += stale.restarted;
        figures.dropped_groups += stale.dropped.len();
        Ok((g, figures))
    }
}
