//! The scheduler (vLLM v1's `core/sched/scheduler.py`; mistral.rs's
//! `paged_attention/scheduler.rs`): a waiting queue and a running list,
//! iteration-level scheduling (Yu et al. 2022, "Orca"; Kwon et al. 2023).
//!
//! Every step, each running unit gets its next token (decode) or its next
//! chunk of prompt (chunked prefill, within the policy's prefill budget, so
//! that a long prompt never stalls the decoding rows); when the pool runs
//! out, the most recently admitted unit is preempted: its blocks are returned
//! and it waits, at the front of the queue, to be recomputed (prefilled again
//! with the tokens it has drawn, which it keeps). Then the scheduling policy
//! ([`SchedulePolicy`], one file each, a [`Scheduling`] trait object) admits
//! waiting units. After the model call, [`Scheduler::ready`] says which units
//! draw (a group whose prompt is in forks into its samples, which share the
//! prompt's blocks) and [`Scheduler::retire`] drops finished samples.
//!
//! # Adding a policy
//!
//! Write `rollout/scheduler/<name>.rs` with a `#[derive(Default)]` type that
//! implements [`Scheduling`], and add one line to the `policies!` list below:
//! the line declares the file's module and the [`SchedulePolicy`] variant
//! that selects it.

mod policy;

pub(super) use policy::{Admission, Scheduling};

use super::kv_cache_manager::KvCacheManager;
use super::request::{Kind, Queues, Requests, Unit};
use super::stats::EngineStats;
use crate::{Error, Result};

/// Declares each policy's module and its [`SchedulePolicy`] variant.
macro_rules! policies {
    ($($(#[$attr:meta])* $variant:ident => $file:ident::$ty:ident;)+) => {
        $(mod $file;)+

        /// How the scheduler admits work: which `Scheduling` policy runs.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
        pub enum SchedulePolicy {
            $($(#[$attr])* $variant,)+
        }

        impl SchedulePolicy {
            /// A fresh instance of the policy, for one call.
            pub(in crate::rollout) fn build(self) -> Box<dyn Scheduling> {
                match self {
                    $(Self::$variant => Box::new($file::$ty::default()),)+
                }
            }
        }
    };
}

policies! {
    /// Continuous batching (the default): refills rows as responses end,
    /// chunked prefill, preemption by recompute, prefix caching.
    #[default]
    Continuous => continuous::Continuous;
    /// The replaced static batcher, for benchmarks: whole chunks of
    /// `max_rows / n` prompts, every sequence's maximum length reserved, no
    /// refill until the chunk ends.
    Static => static_batch::StaticBatch;
    /// Partial rollouts: continuous batching over more groups than a training
    /// step needs; the call ends as soon as the wanted number of groups have
    /// all their responses, the unfinished ones left for the next call.
    Partial => partial::Partial;
}

pub use continuous::PREFILL_TOKENS;

/// The queues of one call and the policy that fills them.
pub(super) struct Scheduler {
    pub(super) queues: Queues,
    policy: Box<dyn Scheduling>,
    max_rows: usize,
}

/// The units that draw after a step's model call (`(logits row, row id)`, by
/// row id) and the groups that forked into their samples.
pub(super) struct Ready {
    pub(super) draws: Vec<(usize, usize)>,
    forks: Vec<(usize, Vec<Unit>)>,
}

impl Scheduler {
    /// `queues` (what waits, nothing running yet) under `policy`.
    pub(super) fn new(policy: Box<dyn Scheduling>, queues: Queues, max_rows: usize) -> Self {
        Self { queues, policy, max_rows }
    }

    /// Whether the policy lets prefix caching run.
    pub(super) fn prefix_caching(&self) -> bool {
        self.policy.prefix_caching()
    }

    /// Whether the call is over.
    pub(super) fn is_done(&self, reqs: &Requests) -> bool {
        self.policy.is_done(&self.queues, reqs)
    }

    /// One step's schedule: `(running index, tokens)` of every unit the model
    /// call runs, the running units first (oldest first), then those the
    /// policy admits. An empty schedule is an error: no work fits the cache.
    pub(super) fn schedule(
        &mut self,
        kv: &mut KvCacheManager,
        reqs: &Requests,
        stats: &mut EngineStats,
    ) -> Result<Vec<(usize, usize)>> {
        let (mut sched, budget) = self.schedule_running(kv, reqs, stats)?;
        let mut a = Admission {
            queues: &mut self.queues,
            kv: &mut *kv,
            reqs,
            stats: &mut *stats,
            sched: &mut sched,
            budget,
            max_rows: self.max_rows,
        };
        self.policy.admit(&mut a)?;
        if sched.is_empty() {
            return Err(Error::invalid(format!(
                "rollout engine: no work fits the KV cache ({} of {} blocks free, {} waiting)",
                kv.pool.free_blocks(),
                kv.pool.num_blocks(),
                self.queues.waiting.len()
            )));
        }
        Ok(sched)
    }

    /// Gives each running unit its next tokens, oldest first: one for a
    /// decoding sample, the next chunk of a prompt being prefilled. Preempts
    /// the newest units when blocks run out. Returns `(unit, tokens)` pairs
    /// and the prefill budget left.
    fn schedule_running(
        &mut self,
        kv: &mut KvCacheManager,
        reqs: &Requests,
        stats: &mut EngineStats,
    ) -> Result<(Vec<(usize, usize)>, usize)> {
        let mut budget = self.policy.prefill_budget();
        let mut sched = Vec::with_capacity(self.queues.running.len());
        let mut i = 0;
        while i < self.queues.running.len() {
            let u = &self.queues.running[i];
            let need = reqs.total(u.kind) - u.table.len();
            let n = if need == 1 { 1 } else { need.min(budget) };
            if n == 0 {
                i += 1;
                continue;
            }
            if need > 1 {
                budget -= n;
            }
            if !self.make_room(kv, reqs, stats, i, n)? {
                break; // unit i itself was preempted, and every newer one
            }
            sched.push((i, n));
            i += 1;
        }
        Ok((sched, budget))
    }

    /// Frees blocks for `n` more tokens of running unit `i` by preempting the
    /// newest units; false when `i` had to go itself.
    fn make_room(
        &mut self,
        kv: &mut KvCacheManager,
        reqs: &Requests,
        stats: &mut EngineStats,
        i: usize,
        n: usize,
    ) -> Result<bool> {
        let q = &mut self.queues;
        loop {
            let need = q.running[i].table.blocks_needed(&kv.pool, n);
            if need <= kv.pool.free_blocks() {
                let u = &mut q.running[i];
                kv.append(reqs, u.kind, &mut u.table, n)?;
                return Ok(true);
            }
            self.policy.may_preempt(kv)?;
            let Some(mut victim) = q.running.pop() else { return Ok(false) };
            victim.table.release(&mut kv.pool);
            q.waiting.push_front(victim.kind);
            stats.preemptions += 1;
            if q.running.len() == i {
                return Ok(false);
            }
        }
    }

    /// After the model call over `sched`: the units whose tokens are all in
    /// the cache draw their next token (a group forks into its samples, one
    /// draw each, from the prompt's last logits).
    pub(super) fn ready(
        &mut self,
        sched: &[(usize, usize)],
        kv: &mut KvCacheManager,
        reqs: &Requests,
    ) -> Ready {
        let n = reqs.n();
        let running = &mut self.queues.running;
        let mut draws: Vec<(usize, usize)> = Vec::new();
        let mut forks: Vec<(usize, Vec<Unit>)> = Vec::new();
        for (k, &(i, _)) in sched.iter().enumerate() {
            let kind = running[i].kind;
            if running[i].table.len() < reqs.total(kind) {
                continue; // a prompt part-way through its prefill
            }
            running[i].prefill = false;
            match kind {
                Kind::Sample(id) => draws.push((k, id)),
                Kind::Group(p) => {
                    let samples: Vec<Unit> = (p * n..(p + 1) * n)
                        .map(|id| Unit {
                            kind: Kind::Sample(id),
                            table: running[i].table.fork(&mut kv.pool),
                            prefill: false,
                        })
                        .collect();
                    running[i].table.release(&mut kv.pool);
                    draws.extend((p * n..(p + 1) * n).map(|id| (k, id)));
                    forks.push((i, samples));
                }
            }
        }
        draws.sort_by_key(|&(_, id)| id);
        Ready { draws, forks }
    }

    /// Puts forked samples in their group's place and drops finished samples,
    /// returning their blocks.
    pub(super) fn retire(&mut self, ready: Ready, kv: &mut KvCacheManager, reqs: &Requests) {
        let mut forks = ready.forks.into_iter().peekable();
        let old = std::mem::take(&mut self.queues.running);
        let mut running = Vec::with_capacity(old.len());
        for (i, u) in old.into_iter().enumerate() {
            if let Some((_, samples)) = forks.next_if(|(g, _)| *g == i) {
                running.extend(samples);
            } else {
                running.push(u);
            }
        }
        for mut u in running {
            match u.kind {
                Kind::Sample(id) if reqs.rows[id].done => u.table.release(&mut kv.pool),
                _ => self.queues.running.push(u),
            }
        }
    }
}
