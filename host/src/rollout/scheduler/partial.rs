//! Partial rollouts (Kimi k1.5 §2.6.2; slime's `--partial-rollout`, AReaL's
//! interruptible generation): continuous batching over more groups than a
//! training step needs, so the rows stay full while the longest responses
//! run; the call is over as soon as the wanted number of GRPO groups have all
//! their responses (`Requests::groups_wanted`), and the unfinished responses
//! are left for the next call (`rollout::partial`, which carries them across
//! the update).

use super::continuous::Continuous;
use super::policy::{Admission, Scheduling};
use crate::rollout::request::{Queues, Requests};
use crate::Result;

/// Continuous batching that stops when enough groups are whole.
#[derive(Debug, Default)]
pub(super) struct Partial(Continuous);

impl Scheduling for Partial {
    fn prefill_budget(&self) -> usize {
        self.0.prefill_budget()
    }

    fn admit(&mut self, a: &mut Admission<'_, '_>) -> Result<()> {
        self.0.admit(a)
    }

    /// Over when nothing is left, or when `groups_wanted` groups have ended in
    /// this call.
    fn is_done(&self, queues: &Queues, reqs: &Requests) -> bool {
        queues.is_empty() || reqs.groups_wanted.is_some_and(|w| reqs.groups_done >= w)
    }
}
