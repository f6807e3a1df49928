//! Steps 1-2 of the update: rewards (scaled, overlong-shaped) and group advantages
//! ([`score`]), the sequences that reach the loss ([`active_sequences`]: DAPO dynamic
//! sampling), and their global order over ranks.

use super::Sequence;
use crate::algo::{self, group_advantages, Advantages, ObjectiveConfig};
use crate::dist::{self, Comm};
use crate::Result;

/// Rewards and advantages of a batch (verl `compute_advantage`).
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    /// Rewards on the objective's scale, overlong-shaped: what the advantages see.
    pub rewards: Vec<f32>,
    /// Rewards on the objective's scale before length shaping: what dynamic sampling sees
    /// (DAPO filters groups on accuracy, before shaping makes equal rewards differ).
    pub unshaped: Vec<f32>,
    /// Group advantages of `rewards`.
    pub advantages: Advantages,
}

/// Scales and shapes the rewards of `seqs` under `obj` and computes group advantages.
pub fn score(seqs: &[Sequence], obj: &ObjectiveConfig) -> Result<Scored> {
    let lens: Vec<usize> = seqs.iter().map(|s| s.response_ids.len()).collect();
    let unshaped: Vec<f32> = seqs.iter().map(|s| obj.reward_scale.apply(s.reward)).collect();
    let mut rewards = unshaped.clone();
    if let Some(ol) = &obj.overlong {
        ol.apply(&mut rewards, &lens)?;
    }
    let groups: Vec<usize> = seqs.iter().map(|s| s.group).collect();
    let advantages = group_advantages(&rewards, &groups, obj.adv, obj.std)?;
    Ok(Scored { rewards, unshaped, advantages })
}

/// Settings that a caller left at values that do not fit the run: DAPO's overlong buffer
/// at the preset's L_max while responses stop (truncated) far below it, and
/// seq-mean-token-sum-norm without a constant length (it then divides by the padded length).
pub(super) fn run_setting_warnings(obj: &ObjectiveConfig, seqs: &[Sequence]) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(o) = &obj.overlong {
        let longest_cut = seqs.iter().filter(|s| s.truncated).map(|s| s.response_ids.len()).max();
        if let Some(cut) = longest_cut.filter(|&c| c <= o.max_len.saturating_sub(o.cache_len)) {
            out.push(format!(
                "the overlong penalty can never fire: responses are cut at {cut} tokens but it starts \
                 after {} (L_max {} - L_cache {}); set overlong_max_len to the run's max_tokens",
                o.max_len.saturating_sub(o.cache_len),
                o.max_len,
                o.cache_len
            ));
        }
    }
    if obj.agg == crate::algo::AggMode::SeqMeanTokenSumNorm && obj.norm_len.is_none() {
        out.push(
            "seq-mean-token-sum-norm without norm_len divides by the mini-batch's padded length; \
             set norm_len to the run's max_tokens (Dr.GRPO)"
                .into(),
        );
    }
    out
}

/// Indices of the sequences that reach the loss: non-empty responses, minus the groups
/// DAPO's dynamic sampling drops (all rewards equal) when `obj.dynamic_sampling`.
pub fn active_sequences(seqs: &[Sequence], obj: &ObjectiveConfig, scored: &Scored) -> Result<Vec<usize>> {
    let mut active: Vec<usize> = (0..seqs.len()).filter(|&i| !seqs[i].response_ids.is_empty()).collect();
    if obj.dynamic_sampling {
        let groups: Vec<usize> = seqs.iter().map(|s| s.group).collect();
        let ds = algo::dynamic_sampling(&scored.unshaped, &groups)?;
        active.retain(|&i| ds.keep[i]);
    }
    Ok(active)
}

/// Every rank's active sequences as `(rank, index into its seqs)`, in global order:
/// one rank keeps its own order; several sort by `(group, rank, index)`.
pub(super) fn global_order(
    comm: &dyn Comm,
    seqs: &[Sequence],
    active: &[usize],
) -> Result<Vec<(usize, usize)>> {
    if comm.size() == 1 {
        return Ok(active.iter().map(|&i| (0, i)).collect());
    }
    let mine: Vec<(usize, usize)> = active.iter().map(|&i| (seqs[i].group, i)).collect();
    let mut all: Vec<(usize, usize, usize)> = dist::all_gather_json(comm, &mine)?
        .into_iter()
        .enumerate()
        .flat_map(|(r, v)| v.into_iter().map(move |(g, i)| (g, r, i)))
        .collect();
    all.sort_unstable();
    Ok(all.into_iter().map(|(_, r, i)| (r, i)).collect())
}
