//! Dynamic sampling (DAPO, verl's `filter_groups`): the prompts and scored samples of a
//! step gathered over one or more generation batches (`Gathered`), keeping only groups
//! whose rewards are mixed until the step's target is held over all ranks, and what the
//! gathering collected for the step (`StepBatch`). Depends on `data` (the examples),
//! `rollout` (samples, engine figures), `dist` (the count over ranks) and
//! `train::update` (the sequences of the batch metrics).

use super::metrics::RolloutFigures;
use crate::data::Example;
use crate::dist::{self, Comm};
use crate::rollout::{EngineStats, PartialFigures, Sample};
use crate::train::update::Sequence;
use crate::Result;

/// What `roller.rs`'s `Roller::gather` collected: the samples the update trains on, everything
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
