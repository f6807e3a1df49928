//! What the engine schedules (vLLM v1's `request.py` and `request_queue.py`):
//! the responses being drawn ([`Requests`]), the units that run through the
//! model ([`Kind`], [`Unit`]) and the two queues ([`Queues`]: waiting,
//! running).
//!
//! A GRPO group is one unit while its prompt is prefilled; when the prompt is
//! in the cache it forks into its `n` samples, one unit each.

use std::collections::VecDeque;
use std::ops::Range;

use super::blocks::BlockTable;
use super::row::Row;
use super::sampler::row_seed;
use super::SamplingParams;

/// What runs through the model: a group's prompt before it forks, or one
/// sample (its prompt and the tokens it has drawn).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// Local prompt index.
    Group(usize),
    /// Row id (`prompt * n + sample`).
    Sample(usize),
}

/// A unit admitted to the cache.
pub(super) struct Unit {
    pub(super) kind: Kind,
    pub(super) table: BlockTable,
    /// Still prefilling (its tokens count as prefill): from admission until it
    /// draws (a group forks into decoding samples).
    pub(super) prefill: bool,
}

impl Unit {
    /// A unit just admitted, holding `table`'s blocks.
    pub(super) fn admitted(kind: Kind, table: BlockTable) -> Self {
        Self { kind, table, prefill: true }
    }
}

/// The waiting queue (first come, first served; a preempted unit goes back to
/// its front) and the running list (oldest first).
pub(super) struct Queues {
    pub(super) waiting: VecDeque<Kind>,
    pub(super) running: Vec<Unit>,
}

impl Queues {
    /// True when nothing waits and nothing runs.
    pub(super) fn is_empty(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }
}

/// Every group of `prompts` prompts, in order.
pub(super) fn prompts_waiting(prompts: usize) -> VecDeque<Kind> {
    (0..prompts).map(Kind::Group).collect()
}

/// The prompts of one call and every response being drawn from them.
pub(super) struct Requests<'a> {
    pub(super) prompts: &'a [Vec<u32>],
    pub(super) params: &'a SamplingParams,
    /// One per response, by id `prompt * n + sample`.
    pub(super) rows: Vec<Row>,
    /// Each prompt's index in the whole batch (forced lengths are per global index).
    pub(super) global: Vec<usize>,
    /// Groups whose every response has ended in this call, and how many end the
    /// call (a policy that stops early, when enough groups are whole, reads them).
    pub(super) groups_done: usize,
    pub(super) groups_wanted: Option<usize>,
}

impl<'a> Requests<'a> {
    /// `params.n` empty responses per prompt, each with its own generator;
    /// `first_prompt_index` is the global index of `prompts[0]` (for the seeds).
    pub(super) fn new(
        prompts: &'a [Vec<u32>],
        params: &'a SamplingParams,
        first_prompt_index: usize,
    ) -> Self {
        let n = params.n;
        let rows = (0..prompts.len() * n)
            .map(|id| {
                let seed = row_seed(params.seed, first_prompt_index + id / n, id % n);
                Row::new(id / n, id % n, seed, params.max_new_tokens)
            })
            .collect();
        let global = (first_prompt_index..first_prompt_index + prompts.len()).collect();
        Self::with_rows(prompts, params, rows, global)
    }

    /// The responses `rows` (`prompts.len() * n`, by id) of `prompts`, whose
    /// global indices are `global`.
    pub(super) fn with_rows(
        prompts: &'a [Vec<u32>],
        params: &'a SamplingParams,
        rows: Vec<Row>,
        global: Vec<usize>,
    ) -> Self {
        Self { prompts, params, rows, global, groups_done: 0, groups_wanted: None }
    }

    /// Whether every response of the group of response `id` has ended.
    pub(super) fn group_done(&self, id: usize) -> bool {
        let p = id / self.n();
        self.rows[p * self.n()..(p + 1) * self.n()].iter().all(|r| r.done)
    }

    /// Samples per prompt.
    pub(super) fn n(&self) -> usize {
        self.params.n
    }

    /// Tokens of a unit: its prompt, then (a sample) what it has drawn.
    pub(super) fn total(&self, kind: Kind) -> usize {
        match kind {
            Kind::Group(p) => self.prompts[p].len(),
            Kind::Sample(id) => self.prompts[id / self.n()].len() + self.rows[id].ids.len(),
        }
    }

    /// The token of a unit at position `pos`.
    pub(super) fn token(&self, kind: Kind, pos: usize) -> u32 {
        let (p, drawn) = match kind {
            Kind::Group(p) => (p, &[][..]),
            Kind::Sample(id) => (id / self.n(), &self.rows[id].ids[..]),
        };
        let prompt = &self.prompts[p];
        if pos < prompt.len() {
            prompt[pos]
        } else {
            drawn[pos - prompt.len()]
        }
    }

    /// The tokens of a unit at positions `range`.
    pub(super) fn tokens(&self, kind: Kind, range: Range<usize>) -> Vec<u32> {
        range.map(|p| self.token(kind, p)).collect()
    }

    /// Rows a unit decodes once its prompt is in: `n` for a group, 1 for a sample.
    pub(super) fn rows_of(&self, kind: Kind) -> usize {
        match kind {
            Kind::Group(_) => self.n(),
            Kind::Sample(_) => 1,
        }
    }

    /// Blocks of `block_size` tokens a unit holds at its longest (every
    /// response at `max_new_tokens`; the last token is never fed back).
    pub(super) fn full_blocks(&self, kind: Kind, block_size: usize) -> usize {
        let seq = |p: usize| {
            super::blocks::blocks_for(self.prompts[p].len() + self.params.max_new_tokens - 1, block_size)
        };
        match kind {
            Kind::Group(p) => self.n() * seq(p),
            Kind::Sample(id) => seq(id / self.n()),
        }
    }
}
