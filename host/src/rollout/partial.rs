//! Partial rollouts (Kimi k1.5 §2.6.2; slime's `--partial-rollout`; AReaL's
//! interruptible rollouts): the groups in flight between a run's steps
//! ([`PartialRollout`]) and one step of them (`PartialRollout::step`).
//!
//! A training step waits for its longest response; with partial rollouts the
//! engine holds more groups than the step needs (`rollout.partial.extra_prompts`)
//! and the step ends as soon as `prompts_per_step` GRPO groups have all their
//! responses (the `Partial` scheduling policy). A group enters an update only
//! whole; the unfinished responses stay here, with their tokens, per-token
//! log-probs, entropies, the policy version that drew each token and where
//! their generator stands, and continue in the next call under the weights of
//! the next update.
//!
//! **The KV cache across an update** ([`PartialKv`], `rollout.partial.kv`).
//! The keys and values of a carried response were computed by the weights
//! before the update.
//!
//! - `recompute` (the default): they are dropped. AReaL discards them at every
//!   weight update and prefills the prompt and the tokens drawn so far again
//!   under the new weights, and slime's engine flushes its cache with each
//!   weight update, which amounts to the same. So does this engine: a carried
//!   response re-enters the next call as a preempted one does (prefilled again
//!   with its prompt and drawn tokens, the samples of a group sharing the
//!   prompt's blocks through the prefix cache), so every token drawn after the
//!   update sees only the new policy's activations. The price is one prefill
//!   of each carried response per step, reported as `recomputed_tokens`.
//! - `keep`: they stay (PipelineRL's in-flight weight updates). The call's
//!   pool of blocks and the units holding blocks in it outlive the call
//!   (`KeptCache`); the next call takes them back, and its decoding
//!   continues under the new weights over the old keys and values, with no
//!   prefill, reported as `kept_tokens`. Only a response whose blocks the pool
//!   cannot keep (a pool that no longer serves the call: another model shape,
//!   cache dtype or block size, a sequence longer than it holds, a smaller
//!   `kv_cache_gb`) is recomputed, and a call that runs out of blocks preempts
//!   its newest units as always (the kept ones run first). A token drawn after
//!   the update then depends on the new weights and, through the kept keys and
//!   values, on older ones: the distribution it was drawn from is neither
//!   policy's. Its recorded log-prob is still the one the sampler drew it
//!   with, so the update's rollout correction (token-TIS / seq-MIS weighs each
//!   token by the policy being trained over the behaviour that drew it) stays
//!   valid; the behaviour is merely further from the trained policy, so more
//!   weight is truncated or masked. Across a weight update the prefix cache
//!   forgets every block name (the kept blocks were computed by other weights
//!   than a new prompt would be), and the kept sequences name no more blocks.
//!   The pool is not saved with a checkpoint: a resumed run recomputes.
//!
//! `recompute` is the default because it keeps the meaning of a token's
//! policy version exact (the weights that drew it, over keys and values of
//! the same weights) and releases the cache's memory between calls, which the
//! update then has; `keep` trades that for no prefill of the carried
//! responses (on the CPU a prefill token costs a fraction of a decode token:
//! one gemm over the chunk against one matrix-vector product per token) and
//! for holding the pool through the update.
//!
//! Each response keeps its own generator (`rollout::row_seed`), rebuilt from
//! the seed and the count of numbers drawn, so a response continues with the
//! draws it would have made uninterrupted, and a checkpoint ([`PartialRollout`]
//! is serialized with the trainer's state) resumes it exactly.
//!
//! A response may span `max_staleness` policy versions at most: before a call,
//! one whose oldest token is older is restarted (its tokens dropped, drawn
//! again from its prompt) or its whole group dropped (`on_stale`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::batch::{Finish, Sample};
use super::blocks::BlockTable;
use super::engine::{self, run_requests, CacheState, GenerateOptions};
use super::kv_cache_manager::KvCacheManager;
use super::request::{Kind, Requests, Unit};
use super::row::{CarriedResponse, Row};
use super::scheduler::SchedulePolicy;
use super::stats::EngineStats;
use super::SamplingParams;
use crate::model::Qwen3;
use crate::{Error, Result};

/// What happens to a response that would span more than `max_staleness`
/// policy versions (`rollout.partial.on_stale`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnStale {
    /// Its tokens are dropped and it is drawn again from its prompt under the
    /// current policy (its group stays in flight).
    #[default]
    Restart,
    /// Its whole group is dropped (the prompt is not trained on).
    Drop,
}

/// What happens to an unfinished response's keys and values across a weight
/// update (`rollout.partial.kv`; see the module's documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PartialKv {
    /// Dropped, and computed again under the new weights when the response
    /// continues (its prompt and drawn tokens prefilled again).
    #[default]
    Recompute,
    /// Kept in the pool: the response continues under the new weights over
    /// the old keys and values (recomputed only when the pool cannot keep them).
    Keep,
}

/// `rollout.partial`: partial rollouts (off by default: every step samples its
/// own prompts and waits for all their responses).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PartialConfig {
    /// Partial rollouts on (slime's `partial_rollout`).
    pub enable: bool,
    /// Groups kept in flight beyond `data.prompts_per_step` (the over-provisioning;
    /// slime's `over_sampling_batch_size` less the step's batch). `None`: as many
    /// again as `data.prompts_per_step`.
    pub extra_prompts: Option<usize>,
    /// Policy versions a response may span at most (AReaL's
    /// `max_head_offpolicyness`): a token drawn `k` updates before the update it
    /// enters has staleness `k`, at most this.
    pub max_staleness: u64,
    /// `restart` or `drop` a response that would exceed `max_staleness`.
    pub on_stale: OnStale,
    /// `recompute` or `keep` an unfinished response's keys and values across an update.
    pub kv: PartialKv,
}

impl Default for PartialConfig {
    fn default() -> Self {
        PartialConfig {
            enable: false,
            extra_prompts: None,
            max_staleness: 4,
            on_stale: OnStale::Restart,
            kv: PartialKv::Recompute,
        }
    }
}

impl PartialConfig {
    /// Groups in flight for a step of `per_step` groups.
    pub fn in_flight(&self, per_step: usize) -> usize {
        per_step + self.extra_prompts.unwrap_or(per_step)
    }
}

/// One response of a group in flight.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Slot {
    /// Not finished: what it has drawn and where its generator stands.
    Running(CarriedResponse),
    /// Finished, waiting for the rest of its group.
    Done(Sample),
}

/// A GRPO group in flight.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CarriedGroup {
    /// The caller's name for the group's prompt.
    pub key: u64,
    /// The prompt's global index (forced lengths of benchmarks look it up).
    pub index: usize,
    /// The prompt's token ids.
    pub prompt_ids: Vec<u32>,
    /// The seed of each response's generator, by sample index.
    pub seeds: Vec<u64>,
    /// Its `n` responses, by sample index.
    pub responses: Vec<Slot>,
}

impl CarriedGroup {
    fn is_done(&self) -> bool {
        self.responses.iter().all(|r| matches!(r, Slot::Done(_)))
    }

    /// The oldest policy version among its tokens.
    fn oldest(&self) -> Option<u64> {
        let versions = |r: &Slot| match r {
            Slot::Running(c) => c.versions.first().copied(),
            Slot::Done(s) => s.versions.iter().copied().min(),
        };
        self.responses.iter().filter_map(versions).min()
    }
}

/// The groups a run has in flight between its steps, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PartialRollout {
    groups: Vec<CarriedGroup>,
    /// What happens to the unfinished responses' keys and values between calls
    /// (set by the caller, [`PartialRollout::set_kv`]; not saved).
    #[serde(skip)]
    kv: PartialKv,
    /// Under [`PartialKv::Keep`], the cache the last call left (not saved).
    #[serde(skip)]
    kept: KeptCache,
}

/// The KV cache a partial rollout keeps between calls under [`PartialKv::Keep`]:
/// the pool and the units holding blocks in it. It is not part of the rollout's
/// state: a clone (what a checkpoint saves) holds none, two rollouts compare
/// equal whatever they keep, and a rollout without one recomputes.
#[derive(Default)]
struct KeptCache(Option<Box<Kept>>);

/// A kept pool and its units, oldest first.
struct Kept {
    kv: KvCacheManager,
    units: Vec<KeptUnit>,
    /// The policy version of the call that left it.
    version: u64,
}

/// A unit holding blocks in a kept pool: a group's prompt being prefilled
/// (`sample` None) or one of its responses.
struct KeptUnit {
    key: u64,
    sample: Option<usize>,
    table: BlockTable,
    prefill: bool,
}

impl Kept {
    /// Returns the blocks of the units `drop` names to the pool.
    fn release(&mut self, drop: impl Fn(&KeptUnit) -> bool) {
        let pool = &mut self.kv.pool;
        self.units.retain_mut(|u| {
            let d = drop(u);
            if d {
                u.table.release(pool);
            }
            !d
        });
    }
}

impl Clone for KeptCache {
    /// None: the kept blocks belong to the one rollout that runs on.
    fn clone(&self) -> Self {
        KeptCache(None)
    }
}

impl PartialEq for KeptCache {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl std::fmt::Debug for KeptCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            None => write!(f, "KeptCache(none)"),
            Some(k) => write!(
                f,
                "KeptCache({} units, {} of {} blocks held)",
                k.units.len(),
                k.kv.pool.used_blocks(),
                k.kv.pool.num_blocks()
            ),
        }
    }
}

/// What [`PartialRollout::enforce_staleness`] did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StaleOutcome {
    /// Responses restarted.
    pub restarted: usize,
    /// The keys of the groups dropped.
    pub dropped: Vec<u64>,
}

/// One step of a [`PartialRollout`]: the whole groups it returns and the figures.
#[derive(Debug, Clone, Default)]
pub struct PartialStep {
    /// `(key, samples)` of each group returned, in the order they were
    /// admitted; sample `group` and `prompt_index` are the group's position here.
    pub groups: Vec<(u64, Vec<Sample>)>,
    /// What the engine did in this call.
    pub stats: EngineStats,
    /// Staleness, carried and recomputed responses.
    pub figures: PartialFigures,
}

/// The partial rollout's figures over a step (metrics.jsonl `partial`, TensorBoard
/// `stapo/partial/...`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PartialFigures {
    /// Mean staleness of the tokens returned (policy versions between the one that
    /// drew a token and the one sampling now).
    pub staleness_mean: f64,
    /// Their largest staleness.
    pub staleness_max: u64,
    /// Tokens returned per staleness (`"0"`, `"1"`, ...).
    pub staleness_hist: BTreeMap<String, usize>,
    /// Share of the returned tokens drawn by an older policy (staleness above 0).
    pub off_policy_token_frac: f64,
    /// Unfinished responses left in flight after the step.
    pub carried_responses: usize,
    /// Groups left in flight after the step.
    pub carried_groups: usize,
    /// Responses that continued from an earlier step in this one.
    pub resumed_responses: usize,
    /// Tokens those responses had drawn and that were prefilled again (their keys and
    /// values recomputed under the current weights).
    pub recomputed_tokens: usize,
    /// Tokens those responses had drawn whose keys and values stayed in the cache
    /// across the update (`rollout.partial.kv = "keep"`): not prefilled again.
    pub kept_tokens: usize,
    /// Responses restarted for staleness (`on_stale = restart`).
    pub restarted_responses: usize,
    /// Groups dropped for staleness (`on_stale = drop`).
    pub dropped_groups: usize,
    /// Tokens returned (the weight of the means when steps are summed).
    pub tokens: usize,
}

impl PartialFigures {
    /// Adds another call's figures (the carried counts are the later call's).
    pub fn add(&mut self, o: &PartialFigures) {
        let tokens = self.tokens + o.tokens;
        let w = |a: f64, n: usize| a * n as f64;
        let mean = |a: f64, b: f64| (w(a, self.tokens) + w(b, o.tokens)) / tokens.max(1) as f64;
        self.staleness_mean = mean(self.staleness_mean, o.staleness_mean);
        self.off_policy_token_frac = mean(self.off_policy_token_frac, o.off_policy_token_frac);
        self.staleness_max = self.staleness_max.max(o.staleness_max);
        for (k, v) in &o.staleness_hist {
            *self.staleness_hist.entry(k.clone()).or_default() += v;
        }
        self.carried_responses = o.carried_responses;
        self.carried_groups = o.carried_groups;
        self.resumed_responses += o.resumed_responses;
        self.recomputed_tokens += o.recomputed_tokens;
        self.kept_tokens += o.kept_tokens;
        self.restarted_responses += o.restarted_responses;
        self.dropped_groups += o.dropped_groups;
        self.tokens = tokens;
    }

    /// The staleness figures of `samples` at policy `version`.
    fn of_tokens(samples: &[Sample], version: u64) -> Self {
        let mut f = PartialFigures::default();
        let (mut sum, mut off) = (0u64, 0usize);
        for v in samples.iter().flat_map(|s| &s.versions) {
            let k = version.saturating_sub(*v);
            sum += k;
            off += usize::from(k > 0);
            f.staleness_max = f.staleness_max.max(k);
            *f.staleness_hist.entry(k.to_string()).or_default() += 1;
            f.tokens += 1;
        }
        f.staleness_mean = sum as f64 / f.tokens.max(1) as f64;
        f.off_policy_token_frac = off as f64 / f.tokens.max(1) as f64;
        f
    }
}

impl PartialRollout {
    /// Groups in flight (finished ones waiting to be returned among them).
    pub fn in_flight(&self) -> usize {
        self.groups.len()
    }

    /// The groups in flight, oldest first.
    pub fn groups(&self) -> &[CarriedGroup] {
        &self.groups
    }

    /// Unfinished responses in flight.
    pub fn unfinished(&self) -> usize {
        self.groups.iter().flat_map(|g| &g.responses).filter(|r| matches!(r, Slot::Running(_))).count()
    }

    /// What happens to the unfinished responses' keys and values between calls
    /// from now on (`recompute` drops a kept cache at once).
    pub fn set_kv(&mut self, kv: PartialKv) {
        self.kv = kv;
        if kv == PartialKv::Recompute {
            self.kept = KeptCache(None);
        }
    }

    /// Blocks the kept cache holds (0 when none is kept).
    pub fn kept_blocks(&self) -> usize {
        self.kept.0.as_ref().map_or(0, |k| k.kv.pool.used_blocks())
    }

    /// The kept pool's accounting, `(blocks held, distinct blocks of the kept units,
    /// references held, references the kept units make)`: equal pairs when no block
    /// leaked. `None` when nothing is kept.
    #[cfg(test)]
    pub(super) fn kept_accounting(&self) -> Option<(usize, usize, usize, usize)> {
        let k = self.kept.0.as_ref()?;
        let pool = &k.kv.pool;
        let mut distinct: Vec<u32> = k.units.iter().flat_map(|u| u.table.blocks().to_vec()).collect();
        let made: usize = distinct.len();
        distinct.sort_unstable();
        distinct.dedup();
        let refs: usize = (0..pool.num_blocks() as u32).map(|b| pool.refs(b) as usize).sum();
        Some((pool.used_blocks(), distinct.len(), refs, made))
    }

    /// Puts a new group in flight: prompt `prompt_ids` (global index `index`),
    /// one response per seed of `seeds` (`rollout::row_seed`), named `key` (unique
    /// among the groups in flight: a kept cache names its units by it, and is
    /// recomputed while two groups share a key).
    pub fn admit(&mut self, key: u64, index: usize, prompt_ids: Vec<u32>, seeds: &[u64]) {
        let responses = seeds.iter().map(|&s| Slot::Running(CarriedResponse::fresh(s))).collect();
        self.groups.push(CarriedGroup { key, index, prompt_ids, seeds: seeds.to_vec(), responses });
    }

    /// Before a call at policy `version`: every response whose oldest token is more
    /// than `cfg.max_staleness` versions old is restarted, or its group dropped.
    pub fn enforce_staleness(&mut self, version: u64, cfg: &PartialConfig) -> StaleOutcome {
        let mut out = StaleOutcome::default();
        let mut restarted: Vec<(u64, usize)> = Vec::new();
        let too_old = |v: u64| version.saturating_sub(v) > cfg.max_staleness;
        match cfg.on_stale {
            OnStale::Drop => self.groups.retain(|g| {
                let stale = g.oldest().is_some_and(too_old);
                if stale {
                    out.dropped.push(g.key);
                }
                !stale
            }),
            OnStale::Restart => {
                for g in &mut self.groups {
                    for (s, (r, &seed)) in g.responses.iter_mut().zip(&g.seeds).enumerate() {
                        let oldest = match r {
                            Slot::Running(c) => c.versions.first().copied(),
                            Slot::Done(s) => s.versions.iter().copied().min(),
                        };
                        if oldest.is_some_and(too_old) {
                            *r = Slot::Running(CarriedResponse::fresh(seed));
                            out.restarted += 1;
                            restarted.push((g.key, s));
                        }
                    }
                }
            }
        }
        if let Some(k) = self.kept.0.as_mut() {
            k.release(|u| {
                out.dropped.contains(&u.key) || u.sample.is_some_and(|s| restarted.contains(&(u.key, s)))
            });
        }
        out
    }

    /// One step at policy `version`: runs the engine (`opts` with the `Partial`
    /// policy) over the groups in flight until `wanted` groups are whole, counting
    /// those already finished, and returns them (the first to finish; at most
    /// `wanted`). The inputs are checked by the caller (`rollout::generate_partial`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn step(
        &mut self,
        model: &Qwen3,
        params: &SamplingParams,
        decode: &dyn Fn(&[u32]) -> String,
        opts: &GenerateOptions,
        eos: Option<u32>,
        version: u64,
        wanted: usize,
    ) -> Result<PartialStep> {
        let n = params.n;
        if let Some(g) = self.groups.iter().find(|g| g.responses.len() != n) {
            return Err(Error::invalid(format!(
                "rollout.partial: a group in flight has {} responses but rollout.sampling.n is {n}; \
                 n cannot change while responses are carried between steps",
                g.responses.len()
            )));
        }
        self.finish_overlong(params, decode);
        // Groups already whole, in the order they finished (oldest first here).
        let mut order: Vec<usize> = (0..self.groups.len()).filter(|&i| self.groups[i].is_done()).collect();
        let mut figures = PartialFigures::default();
        let mut stats = EngineStats::default();
        let running: Vec<usize> = (0..self.groups.len()).filter(|&i| !self.groups[i].is_done()).collect();
        if order.len() < wanted && !running.is_empty() {
            let prompts: Vec<Vec<u32>> = running.iter().map(|&i| self.groups[i].prompt_ids.clone()).collect();
            let global: Vec<usize> = running.iter().map(|&i| self.groups[i].index).collect();
            let opts = GenerateOptions { policy: SchedulePolicy::Partial, version: Some(version), ..*opts };
            let mut kept = self.take_kept(model, &opts, &prompts, params, version);
            let units = self.kept_units(kept.as_mut(), &running, n);
            let mut rows = Vec::with_capacity(running.len() * n);
            let mut waiting = std::collections::VecDeque::new();
            for (p, &i) in running.iter().enumerate() {
                let g = &mut self.groups[i];
                let has_unit = |s: Option<usize>| units.iter().any(|u| u.0 == p && u.1 == s);
                let fresh = g.responses.iter().all(|r| matches!(r, Slot::Running(c) if c.ids.is_empty()))
                    && !(0..n).any(|s| has_unit(Some(s)));
                if fresh && !has_unit(None) {
                    waiting.push_back(Kind::Group(p));
                }
                for (s, r) in g.responses.iter_mut().enumerate() {
                    match r {
                        Slot::Running(c) => {
                            let unit = has_unit(Some(s));
                            if !c.ids.is_empty() {
                                figures.resumed_responses += 1;
                                if unit {
                                    figures.kept_tokens += c.ids.len();
                                } else {
                                    figures.recomputed_tokens += c.ids.len();
                                }
                            }
                            if !fresh && !unit {
                                waiting.push_back(Kind::Sample(p * n + s));
                            }
                            rows.push(Row::resume(p, s, std::mem::take(c)));
                        }
                        Slot::Done(_) => {
                            let mut row = Row::new(p, s, 0, 0);
                            row.done = true;
                            rows.push(row);
                        }
                    }
                }
            }
            let cache = kept.map(|k| CacheState {
                kv: k.kv,
                running: units
                    .into_iter()
                    .map(|(p, s, table, prefill)| Unit {
                        kind: s.map_or(Kind::Group(p), |s| Kind::Sample(p * n + s)),
                        table,
                        prefill,
                    })
                    .collect(),
            });
            let mut reqs = Requests::with_rows(&prompts, params, rows, global);
            reqs.groups_wanted = Some(wanted - order.len());
            let end = run_requests(model, reqs, waiting, cache, decode, &opts, eos)?;
            stats = end.stats;
            for sample in end.out {
                let (p, s) = (sample.prompt_index, sample.sample_index);
                let g = &mut self.groups[running[p]];
                g.responses[s] = Slot::Done(sample);
                if g.is_done() {
                    order.push(running[p]);
                }
            }
            for (id, mut row) in end.rows.into_iter().enumerate() {
                if !row.done {
                    self.groups[running[id / n]].responses[id % n] = Slot::Running(row.carry());
                }
            }
            if self.kv == PartialKv::Keep {
                let key = |p: usize| self.groups[running[p]].key;
                let units = end
                    .cache
                    .running
                    .into_iter()
                    .map(|u| {
                        let (key, sample) = match u.kind {
                            Kind::Group(p) => (key(p), None),
                            Kind::Sample(id) => (key(id / n), Some(id % n)),
                        };
                        KeptUnit { key, sample, table: u.table, prefill: u.prefill }
                    })
                    .collect();
                self.kept = KeptCache(Some(Box::new(Kept { kv: end.cache.kv, units, version })));
            }
        }
        order.truncate(wanted);
        order.sort_unstable();
        let mut taken = Vec::with_capacity(order.len());
        for &i in order.iter().rev() {
            taken.push(self.groups.remove(i));
        }
        taken.reverse();
        let groups: Vec<(u64, Vec<Sample>)> = taken
            .into_iter()
            .enumerate()
            .map(|(pos, g)| {
                let samples = g
                    .responses
                    .into_iter()
                    .map(|r| match r {
                        Slot::Done(mut s) => {
                            (s.group, s.prompt_index) = (pos, pos);
                            s
                        }
                        Slot::Running(_) => unreachable!("only whole groups are returned"),
                    })
                    .collect();
                (g.key, samples)
            })
            .collect();
        let all: Vec<Sample> = groups.iter().flat_map(|(_, s)| s.iter().cloned()).collect();
        let mut f = PartialFigures::of_tokens(&all, version);
        f.resumed_responses = figures.resumed_responses;
        f.recomputed_tokens = figures.recomputed_tokens;
        f.kept_tokens = figures.kept_tokens;
        f.carried_responses = self.unfinished();
        f.carried_groups = self.groups.len();
        Ok(PartialStep { groups, stats, figures: f })
    }

    /// Under [`PartialKv::Keep`], the kept cache for a call at policy `version` over
    /// `prompts` under `opts`, if it serves the call (else it is dropped, and every
    /// response it held is recomputed). Across a weight update the prefix cache forgets
    /// its names and the kept sequences name no more blocks.
    fn take_kept(
        &mut self,
        model: &Qwen3,
        opts: &GenerateOptions,
        prompts: &[Vec<u32>],
        params: &SamplingParams,
        version: u64,
    ) -> Option<Kept> {
        let mut k = *self.kept.0.take()?;
        let mut keys: Vec<u64> = self.groups.iter().map(|g| g.key).collect();
        keys.sort_unstable();
        keys.dedup();
        let unique = keys.len() == self.groups.len();
        if self.kv != PartialKv::Keep
            || !unique
            || !k.kv.serves(model, &opts.engine, prompts, params, engine::caching(opts))
        {
            return None;
        }
        if k.version != version {
            k.kv.pool.forget_names();
            for u in &mut k.units {
                u.table.stop_naming();
            }
            k.version = version;
        }
        Some(k)
    }

    /// The kept units of `kept` that continue in this call, as `(local prompt, sample,
    /// table, prefill)`, oldest first (`running`: the groups of the call, by local
    /// prompt). A unit that does not match its response (its group gone, its response
    /// ended or restarted) has its blocks returned to the pool.
    fn kept_units(
        &self,
        kept: Option<&mut Kept>,
        running: &[usize],
        n: usize,
    ) -> Vec<(usize, Option<usize>, BlockTable, bool)> {
        let Some(k) = kept else { return Vec::new() };
        let local = |key: u64| running.iter().position(|&i| self.groups[i].key == key);
        let valid = |u: &KeptUnit| {
            let Some(p) = local(u.key) else { return false };
            let g = &self.groups[running[p]];
            match u.sample {
                Some(s) => {
                    s < n
                        && matches!(&g.responses[s],
                    Slot::Running(c) if u.table.len() <= g.prompt_ids.len() + c.ids.len())
                }
                None => {
                    u.table.len() <= g.prompt_ids.len()
                        && g.responses.iter().all(|r| matches!(r, Slot::Running(c) if c.ids.is_empty()))
                }
            }
        };
        k.release(|u| !valid(u));
        // A group's prompt unit and units of its samples cannot both be kept.
        let groups: Vec<u64> = k.units.iter().filter(|u| u.sample.is_none()).map(|u| u.key).collect();
        k.release(|u| u.sample.is_some() && groups.contains(&u.key));
        k.units
            .drain(..)
            .map(|u| (local(u.key).expect("checked above"), u.sample, u.table, u.prefill))
            .collect()
    }

    /// Ends, as truncated, every response already at `params.max_new_tokens`
    /// (the budget was lowered while it was in flight).
    fn finish_overlong(&mut self, params: &SamplingParams, decode: &dyn Fn(&[u32]) -> String) {
        let mut ended: Vec<(u64, usize)> = Vec::new();
        for g in &mut self.groups {
            for (s, r) in g.responses.iter_mut().enumerate() {
                if let Slot::Running(c) = r {
                    if c.ids.len() >= params.max_new_tokens && !c.ids.is_empty() {
                        let mut row = Row::resume(0, s, std::mem::take(c));
                        *r = Slot::Done(row.finish(Finish::Length, &g.prompt_ids, decode));
                        ended.push((g.key, s));
                    }
                }
            }
        }
        if let Some(k) = self.kept.0.as_mut() {
            k.release(|u| u.sample.is_some_and(|s| ended.contains(&(u.key, s))));
        }
    }
}
