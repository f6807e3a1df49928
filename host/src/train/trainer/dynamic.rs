//! A step's rollouts and dynamic sampling (DAPO, verl's `filter_groups`): `Roller`
//! draws the prompts, rolls them out and scores them, one generation batch after another
//! (under partial rollouts it takes the whole groups of those in flight, `partial.rs`);
//! the prompts and scored samples of a step gathered over those batches (`Gathered`)
//! keep only groups whose rewards are mixed until the step's target is held over all
//! ranks; `StepBatch` is what the gathering collected for the step. A `Roller` borrows
//! what a rollout needs and nothing of the update, so that a step's rollout can run in a
//! thread beside another step's update (`rollout.async`). Depends on `data` (the
//! examples), `rollout` (samples, engine figures), `reward` (scoring), `dist` (the count
//! over ranks), `guard` (the test signals) and `train::update` (the sequences of the batch
//! metrics).

use std::sync::atomic::AtomicBool;
use std::time::Instant;

use super::metrics::RolloutFigures;
use super::partial::PartialSource;
use super::plan::{mix, StepPlan};
use super::prompts::PromptSource;
use crate::data::{Example, Prompt};
use crate::dist::{self, Comm};
use crate::guard::signal;
use crate::model::Qwen3;
use crate::reward;
use crate::rollout::{EngineStats, GenerateOptions, PartialFigures, Sample};
use crate::train::update::Sequence;
use crate::train::RunConfig;
use crate::Result;

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
            let (round, partial) = self.roll_out(plan, b.gen_batches as u64, progress, cancel)?;
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

/// What `Roller::gather` collected: the samples the update trains on, everything
/// sampled (for the batch metrics) and the rollout figures.
#[derive(Debug, Default)]
pub(super) struct StepBatch {
    pub(super) kept: Gathered,
    pub(super) all_seqs: Vec<Sequence>,
    pub(super) rollout_secs: f64,
    pub(super) local_tokens: usize,
    pub(super) gen_batches: usize,
    pub(super) groups_dropped: usize,
    pub(super) engine: RolloutFigures,
    /// Under partial rollouts: staleness, carried and recomputed responses.
    pub(super) partial: Option<PartialFigures>,
}

/// The prompts and scored samples of a step, gathered over one or more generation
/// batches; sample `prompt_index` and `group` index `examples`.
#[derive(Debug, Default)]
pub(super) struct Gathered {
    pub(super) examples: Vec<Example>,
    pub(super) texts: Vec<String>,
    pub(super) samples: Vec<Sample>,
    /// The engine's figures of the generation call.
    pub(super) stats: EngineStats,
}

impl Gathered {
    /// Appends the groups of `round` whose rewards are mixed (DAPO dynamic sampling;
    /// a single-sample group is all-equal), renumbered, until `target` groups are held
    /// over all ranks of `comm` (`held` before this round; the groups of a round are
    /// numbered rank by rank, as one process would meet them). Returns how many
    /// all-equal groups this rank dropped and the groups now held over all ranks.
    pub(super) fn add_mixed(
        &mut self,
        comm: &dyn Comm,
        round: &Gathered,
        target: usize,
        held: usize,
    ) -> Result<(usize, usize)> {
        let mut dropped = 0;
        let mut mixed = Vec::new();
        for (p, (ex, text)) in round.examples.iter().zip(&round.texts).enumerate() {
            let members: Vec<&Sample> = round.samples.iter().filter(|s| s.prompt_index == p).collect();
            if !members.windows(2).any(|w| w[0].reward != w[1].reward) {
                dropped += 1;
                continue;
            }
            mixed.push((ex, text, members));
        }
        let (first, total) = dist::offset_and_total(comm, mixed.len())?;
        for (j, (ex, text, members)) in mixed.into_iter().enumerate() {
            if held + first + j >= target {
                break;
            }
            let new = self.examples.len();
            for s in members {
                let mut s = s.clone();
                s.prompt_index = new;
                // The group's global index (its position over all ranks' kept groups).
                s.group = held + first + j;
                self.samples.push(s);
            }
            self.examples.push(ex.clone());
            self.texts.push(text.clone());
        }
        Ok((dropped, (held + total).min(target)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Example;
    use crate::rollout::Finish;

    fn round(rewards: &[&[f32]]) -> Gathered {
        let mut g = Gathered::default();
        for (p, rs) in rewards.iter().enumerate() {
            g.examples.push(Example {
                id: format!("q{p}"),
                problem: String::new(),
                answer: String::new(),
                source: String::new(),
                messages: None,
            });
            g.texts.push(format!("prompt {p}"));
            for (i, &r) in rs.iter().enumerate() {
                g.samples.push(Sample {
                    group: p,
                    prompt_index: p,
                    sample_index: i,
                    prompt_ids: vec![1],
                    response_ids: vec![2, p as u32],
                    logprobs: vec![0.; 2],
                    old_logprobs: vec![0.; 2],
                    entropies: vec![0.; 2],
                    versions: Vec::new(),
                    text: String::new(),
                    finish: Finish::Eos,
                    truncated: false,
                    reward: Some(r),
                });
            }
        }
        g
    }

    #[test]
    fn dynamic_sampling_refills_to_the_target() {
        // Target 3 groups. Batch 1: q0 mixed, q1 all wrong, q2 mixed → 2 kept, 1 dropped.
        // Batch 2: q0 all right, q1 mixed, q2 mixed → q1 fills the third place; q2 is surplus.
        let mut kept = Gathered::default();
        let local = crate::dist::Local;
        assert_eq!(kept.add_mixed(&local, &round(&[&[1., 0.], &[0., 0.], &[0., 1.]]), 3, 0).unwrap(), (1, 2));
        assert_eq!(kept.examples.len(), 2);
        assert_eq!(kept.add_mixed(&local, &round(&[&[1., 1.], &[1., 0.], &[0., 1.]]), 3, 2).unwrap(), (1, 3));
        let ids: Vec<&str> = kept.examples.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(ids, ["q0", "q2", "q1"]);
        assert_eq!(kept.texts, ["prompt 0", "prompt 2", "prompt 1"]);
        // Renumbered: group and prompt index follow the kept order; the samples are the
        // originals (their response's second token is the original prompt index).
        let seen: Vec<(usize, usize, u32)> =
            kept.samples.iter().map(|s| (s.group, s.prompt_index, s.response_ids[1])).collect();
        assert_eq!(seen, [(0, 0, 0), (0, 0, 0), (1, 1, 2), (1, 1, 2), (2, 2, 1), (2, 2, 1)]);
        // A single sample per prompt is never mixed.
        assert_eq!(Gathered::default().add_mixed(&local, &round(&[&[1.], &[0.]]), 3, 0).unwrap(), (2, 0));
    }
}
