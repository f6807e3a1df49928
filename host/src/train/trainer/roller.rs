//! A step's rollouts (`Roller`): draws the prompts, rolls them out and scores them, one
//! generation batch after another, keeping the groups with mixed rewards under dynamic
//! sampling (`dynamic.rs`); under partial rollouts the step's groups are the whole ones
//! of those in flight (`partial.rs`'s `PartialSource`). A `Roller` borrows what a
//! rollout needs and nothing of the update, so that a step's rollout can run in a thread
//! beside another step's update (`rollout.async`). Depends on `data` (the prompts),
//! `rollout` (generation), `reward` (scoring), `guard` (the test signals) and
//! `train::update` (the sequences of the batch metrics).

use std::sync::atomic::AtomicBool;
use std::time::Instant;

use super::dynamic::{Gathered, StepBatch};
use super::partial::PartialSource;
use super::plan::{mix, StepPlan};
use super::prompts::PromptSource;
use crate::data::Prompt;
use crate::dist::{self, Comm};
use crate::guard::signal;
use crate::model::Qwen3;
use crate::reward;
use crate::rollout::{GenerateOptions, PartialFigures};
use crate::train::update::Sequence;
use crate::train::RunConfig;
use crate::{Error, Result};

/// What a step's rollouts need: the run's settings, its prompts, its ranks and the
/// weights to sample.
pub(super) struct Roller<'a> {
    pub(super) cfg: &'a RunConfig,
    pub(super) prompts: &'a mut PromptSource,
    pub(super) comm: &'a dyn Comm,
    pub(super) model: &'a Qwen3,
    /// The step the rollouts are for (it seeds them; under partial rollouts, the policy
    /// version that samples them).
    pub(super) step: u64,
    /// Under partial rollouts (`rollout.partial`): the groups in flight between steps,
    /// which the step's groups come from.
    pub(super) partial: Option<&'a mut PartialSource>,
}

/// `r`, or an error on every rank of `comm` when it is one on any: a rollout cancelled
/// (a stop signal reaches each rank at its own moment) or failed on one rank must not
/// leave the others waiting in the collectives that follow it (one small collective). A
/// rank that received no signal adopts one another rank received.
fn failed_on_any_rank<T>(comm: &dyn Comm, r: Result<T>) -> Result<T> {
    if comm.size() == 1 {
        return r;
    }
    let [a, b, c] = signal::received_counts();
    let [failed, a, b, c] = dist::sum_f64(comm, [f64::from(u8::from(r.is_err())), a, b, c])?;
    signal::adopt_received(&[a, b, c]);
    match r {
        Ok(_) if failed > 0.0 => {
            Err(Error::invalid(format!("the rollout was cancelled or failed on {failed} other rank(s)")))
        }
        r => r,
    }
}

impl Roller<'_> {
    /// The step's rollouts, scored. With dynamic sampling, keeps generating batches of
    /// prompts until `data.prompts_per_step` groups have mixed rewards (verl `filter_groups`),
    /// at most `rollout.max_num_gen_batches` batches (0 = no limit).
    pub(super) fn gather(
        &mut self,
        plan: &StepPlan,
        progress: Option<&dyn Fn(usize)>,
        cancel: Option<&AtomicBool>,
        warnings: &mut Vec<String>,
    ) -> Result<StepBatch> {
        let target = self.cfg.data.prompts_per_step;
        let dynamic = plan.objective.dynamic_sampling;
        let mut b = StepBatch::default();
        // Mixed groups held over all ranks.
        let mut held = 0usize;
        let mut last_round;
        loop {
            let t0 = Instant::now();
            let round = self.roll_out(plan, b.gen_batches as u64, progress, cancel);
            let (round, partial) = failed_on_any_rank(self.comm, round)?;
            if let Some(f) = partial {
                b.partial.get_or_insert_with(Default::default).add(&f);
            }
            b.rollout_secs += t0.elapsed().as_secs_f64();
            b.local_tokens += round.samples.iter().map(|s| s.response_ids.len()).sum::<usize>();
            b.engine.add(&round.stats);
            let offset = b.all_seqs.len();
            b.all_seqs.extend(round.samples.iter().map(|s| {
                let mut q = Sequence::from_sample(s, s.reward.unwrap_or(0.0));
                q.group += offset; // unique across batches, for the batch metrics
                q
            }));
            b.gen_batches += 1;
            if !dynamic {
                b.kept = round;
                return Ok(b);
            }
            let (dropped, now) = b.kept.add_mixed(self.comm, &round, target, held)?;
            b.groups_dropped += dropped;
            held = now;
            last_round = round;
            if held >= target {
                break;
            }
            let max_batches = self.cfg.rollout.max_num_gen_batches;
            if max_batches > 0 && b.gen_batches >= max_batches {
                warnings.push(format!(
                    "dynamic sampling: {held} of {target} groups with mixed rewards after {} \
                     generation batches (max_num_gen_batches); updating on fewer",
                    b.gen_batches
                ));
                break;
            }
        }
        if held == 0 {
            // No group had mixed rewards: the update drops them all and reports it.
            b.kept = last_round;
        }
        Ok(b)
    }

    /// Generation batch `round` of the step: the next `data.prompts_per_step` prompts, rolled
    /// out under `plan` and scored. Batch 0 is seeded as a step without refills always was.
    /// Under partial rollouts, the next `data.prompts_per_step` whole groups of those in
    /// flight ([`PartialSource`]), with the partial figures.
    fn roll_out(
        &mut self,
        plan: &StepPlan,
        round: u64,
        progress: Option<&dyn Fn(usize)>,
        cancel: Option<&AtomicBool>,
    ) -> Result<(Gathered, Option<PartialFigures>)> {
        let mut sampling = plan.sampling.clone();
        let seed = mix(self.cfg.seed, self.step);
        sampling.seed = if round == 0 { seed } else { mix(seed, round) };
        let step = self.step;
        let progress_and_signal = |n: usize| {
            signal::reached("rollout", step);
            if let Some(p) = progress {
                p(n);
            }
        };
        let opts = GenerateOptions {
            progress: Some(&progress_and_signal),
            cancel,
            engine: self.cfg.rollout.engine,
            ..GenerateOptions::default()
        };
        if let Some(source) = self.partial.as_deref_mut() {
            let (mut g, figures) =
                source.next_groups(self.prompts, self.comm, self.model, self.cfg, &sampling, &opts, step)?;
            for s in &mut g.samples {
                let v = reward::verify(&g.examples[s.prompt_index].answer, &s.text, self.cfg.data.extract);
                s.reward = Some(if v.correct { 1.0 } else { 0.0 });
            }
            return Ok((g, Some(figures)));
        }
        // Each rank samples its share of the global batch, with each response's seed from
        // its global prompt index.
        let (examples, share) = self.prompts.next_share(self.cfg.data.prompts_per_step, self.comm)?;
        let prompts: Vec<Prompt> = examples.iter().map(|e| e.prompt()).collect();
        let opts = GenerateOptions { first_prompt_index: share.start, ..opts };
        let gen = self.prompts.generator(self.model);
        let generated = gen.generate(&prompts, &sampling, &opts)?;
        let (mut samples, texts, stats) = (generated.samples, generated.prompt_texts, generated.stats);
        for s in &mut samples {
            let v = reward::verify(&examples[s.prompt_index].answer, &s.text, self.cfg.data.extract);
            s.reward = Some(if v.correct { 1.0 } else { 0.0 });
            // Group ids are global prompt indices (the update orders ranks' groups by them).
            s.group += share.start;
        }
        Ok((Gathered { examples, texts, samples, stats }, None))
    }
}
