//! What a scheduling policy decides ([`Scheduling`]) and what it sees while it
//! admits work ([`Admission`]).
//!
//! The scheduler ([`super::Scheduler`]) does the mechanism every policy
//! shares: each step it gives every running unit its next tokens (oldest
//! first), preempts the newest units when blocks run out, then hands the rest
//! of the step to the policy, which admits waiting units. The policy decides
//! how many prompt tokens a step may prefill, whether a full pool preempts or
//! is an error, whether the prefix cache may be used, which waiting units
//! enter and when a call is over.

use crate::rollout::blocks::BlockTable;
use crate::rollout::kv_cache_manager::KvCacheManager;
use crate::rollout::request::{Kind, Queues, Requests, Unit};
use crate::rollout::stats::EngineStats;
use crate::Result;

/// The behaviour of one scheduling policy. A policy is one file of
/// `rollout/scheduler/` and one line of the `policies!` registration in
/// `rollout/scheduler/mod.rs`.
pub(in crate::rollout) trait Scheduling {
    /// Prompt tokens one step may prefill (running prefills and admissions together).
    fn prefill_budget(&self) -> usize;

    /// Whether automatic prefix caching may run under this policy.
    fn prefix_caching(&self) -> bool {
        true
    }

    /// Called when a running unit needs blocks the pool lacks, before the
    /// newest unit is preempted: an error refuses preemption.
    fn may_preempt(&self, _kv: &KvCacheManager) -> Result<()> {
        Ok(())
    }

    /// Admits waiting units into this step.
    fn admit(&mut self, a: &mut Admission<'_, '_>) -> Result<()>;

    /// Whether the call is over: by default when nothing waits and nothing runs (a
    /// policy that ends a call early, when enough groups have finished, looks at
    /// `reqs`' responses).
    fn is_done(&self, queues: &Queues, _reqs: &Requests) -> bool {
        queues.is_empty()
    }
}

/// The state a policy admits into: the queues, the cache, the responses, the
/// step's schedule so far and the prefill budget it left.
pub(in crate::rollout) struct Admission<'s, 'r> {
    pub(in crate::rollout) queues: &'s mut Queues,
    pub(in crate::rollout) kv: &'s mut KvCacheManager,
    pub(in crate::rollout) reqs: &'s Requests<'r>,
    pub(in crate::rollout) stats: &'s mut EngineStats,
    /// `(running index, tokens)` of every unit this step runs.
    pub(in crate::rollout) sched: &'s mut Vec<(usize, usize)>,
    /// Prompt tokens the step may still prefill.
    pub(in crate::rollout) budget: usize,
    /// Sequences decoded at once at most.
    pub(in crate::rollout) max_rows: usize,
}

impl Admission<'_, '_> {
    /// Moves `kind` (just taken from the waiting queue) to the running list
    /// holding `table`, gives it slots for its next `n` tokens and schedules
    /// them in this step.
    pub(in crate::rollout) fn start(&mut self, kind: Kind, table: BlockTable, n: usize) -> Result<()> {
        self.queues.running.push(Unit::admitted(kind, table));
        let i = self.queues.running.len() - 1;
        self.kv.append(self.reqs, kind, &mut self.queues.running[i].table, n)?;
        self.sched.push((i, n));
        Ok(())
    }
}
