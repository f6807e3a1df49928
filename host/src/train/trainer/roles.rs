//! Rollout ranks and trainer ranks (`rollout.async.roles`, slime's and AReaL's
//! disaggregated placement): of a job's N ranks the first N - R train and the last R
//! generate. The ranks split into two groups ([`Comm::split`]): the rollout ranks share
//! each step's prompts among themselves (GRPO groups whole), generate and score them,
//! and send the finished groups (tokens, every token's rollout log-prob, old log-prob
//! and entropy, rewards, the batch figures) point to point to the trainer ranks, each
//! trainer receiving the groups of its share; the trainers update data-parallel over
//! their own group (the gradient all-reduce among trainers only); then trainer 0 (rank
//! 0, which writes the run folder) broadcasts the step's outcome and the new weights to
//! the rollout ranks over a third group, itself and the rollout ranks (`fanout`).
//!
//! Under `staleness: 1` a rollout rank, having sent step k's groups, generates step
//! k+1's under the weights of step k while the trainers update step k (the trainers
//! receive them once their update is done, then send the weights of step k+1); step 0
//! is generated under the initial weights. Under `staleness: 0` the rollout ranks wait
//! for each update's weights before the next step's rollout. The policy versions are
//! those of one process under `rollout.async` (`ahead.rs`), so both runs train on the
//! same rollouts. Depends on `dist` (groups, messages), `model` (the rollout ranks'
//! weight copy) and the trainer's dynamic-sampling part (the batch a rollout gathers).

use std::sync::Arc;

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use super::ahead::drawn_with;
use super::dynamic::{Gathered, StepBatch};
use super::metrics::{RolloutFigures, StepMetrics};
use super::plan::StepPlan;
use crate::data::{Example, SamplerState};
use crate::dist::{self, Comm, BUCKET_ELEMS};
use crate::guard::{signal, OnDivergence};
use crate::model::{Qwen3, RolloutCopy};
use crate::rollout::{Sample, SamplingParams};
use crate::train::update::Sequence;
use crate::train::RunConfig;
use crate::{Error, Result};

const FIELD: &str = "rollout.async.roles.rollout_ranks";

fn config_error(field: &str, msg: String) -> Error {
    Error::Config { file: "run config".into(), field: field.into(), msg }
}

/// What a rank does in a job split into roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// Updates the policy (data-parallel among the trainer ranks).
    Trainer,
    /// Generates and scores the steps' groups.
    Rollout,
}

/// This rank's part in a job split into rollout and trainer ranks.
pub(super) struct Roles {
    pub(super) role: Role,
    world: Arc<dyn Comm>,
    /// Trainer ranks (world ranks `0..trainers`); the rollout ranks follow.
    trainers: usize,
    rollouts: usize,
    /// Trainer 0 (rank 0 here) and the rollout ranks: the step's outcome and the new
    /// weights go out over it. `None` on the other trainers.
    fanout: Option<Arc<dyn Comm>>,
    /// A rollout rank's weights: a copy in the sampling dtype, set from each broadcast.
    copy: Option<RolloutCopy>,
    /// A rollout rank: the rollout of the next step it sent beside the last update.
    pub(super) sent_ahead: Option<SentAhead>,
    /// A trainer rank: the next step's groups, received after this step's update.
    pub(super) held: Option<Held>,
    /// A trainer rank: the rollout ranks are sending the next step's groups (drawn beside
    /// this step's update), not received yet.
    pub(super) ahead_pending: bool,
}

/// A rollout rank's record of the rollout it drew ahead.
pub(super) struct SentAhead {
    sampling: SamplingParams,
    dynamic_sampling: bool,
    /// The epoch order before its prompts were drawn (put back when it is drawn again).
    pub(super) sampler_before: SamplerState,
    /// It failed or was cancelled on some rollout rank: every rank draws it again.
    given_up: bool,
}

impl SentAhead {
    /// Whether the step under `plan` trains on it (else it is drawn again).
    pub(super) fn serves(&self, plan: &StepPlan) -> bool {
        !self.given_up && drawn_with(&self.sampling, self.dynamic_sampling, plan)
    }
}

/// A trainer's groups of the next step, received beside the update.
pub(super) struct Held {
    sampling: SamplingParams,
    dynamic_sampling: bool,
    /// `None`: the rollout ranks gave it up.
    received: Option<Received>,
}

impl Held {
    /// Whether it was drawn as `plan` says.
    pub(super) fn drawn_with(&self, plan: &StepPlan) -> bool {
        drawn_with(&self.sampling, self.dynamic_sampling, plan)
    }

    /// The groups when the step under `plan` trains on them.
    pub(super) fn serving(self, plan: &StepPlan) -> Option<Received> {
        if drawn_with(&self.sampling, self.dynamic_sampling, plan) {
            self.received
        } else {
            None
        }
    }
}

/// What a trainer received of a step from the rollout ranks.
pub(super) struct Received {
    pub(super) batch: StepBatch,
    /// The policy version of the weights that sampled it.
    pub(super) version: u64,
    /// The epoch order after its prompts were drawn (what the trainer's checkpoints save).
    pub(super) sampler_after: SamplerState,
    pub(super) warnings: Vec<String>,
}

/// Splits `world` into roles when `cfg` asks for them: this rank's roles and the
/// communicator of its group (`world` itself without roles). Collective.
pub(super) fn split(world: Arc<dyn Comm>, cfg: &RunConfig) -> Result<(Option<Roles>, Arc<dyn Comm>)> {
    let Some(r) = &cfg.rollout.asynchronous.roles else {
        return Ok((None, world));
    };
    let (n, rollouts) = (world.size(), r.rollout_ranks);
    if rollouts == 0 || rollouts >= n {
        let expected = if n < 2 {
            "roles need a job of at least 2 ranks (rollout ranks and at least one trainer rank)".to_string()
        } else {
            format!("expected 1 to {} (at least one rank must train)", n - 1)
        };
        return Err(config_error(
            FIELD,
            format!(
                "{rollouts} rollout rank(s) in a job of {n} rank(s): {expected}; start the job with more \
                 ranks (mpirun -np {}) or give fewer rollout ranks",
                rollouts.max(1) + 1
            ),
        ));
    }
    let trainers = n - rollouts;
    let per_step = cfg.data.prompts_per_step;
    if per_step < rollouts.max(trainers) {
        return Err(config_error(
            "data.prompts_per_step",
            format!(
                "{per_step} prompts per step cannot be shared by {rollouts} rollout rank(s) and \
                 {trainers} trainer rank(s) (each needs at least one)"
            ),
        ));
    }
    if cfg.guard.on_divergence == OnDivergence::Rollback {
        return Err(config_error(
            "guard.on_divergence",
            "`rollback` restarts the trainer from a checkpoint, which rollout and trainer roles \
             (rollout.async.roles) do not support: use `stop` or `warn`"
                .into(),
        ));
    }
    let rank = world.rank();
    let role = if rank < trainers { Role::Trainer } else { Role::Rollout };
    let group = world.split(usize::from(role == Role::Rollout), rank)?;
    let fan = world.split(usize::from(rank != 0 && rank < trainers), rank)?;
    let fanout = (rank == 0 || rank >= trainers).then_some(fan);
    let roles = Roles {
        role,
        world,
        trainers,
        rollouts,
        fanout,
        copy: None,
        sent_ahead: None,
        held: None,
        ahead_pending: false,
    };
    Ok((Some(roles), group))
}

impl Roles {
    /// Every rank of the job, both roles.
    pub(super) fn world(&self) -> &Arc<dyn Comm> {
        &self.world
    }

    /// This rank rolls out.
    pub(super) fn rolls_out(&self) -> bool {
        self.role == Role::Rollout
    }

    /// A rollout rank's weights: a copy of `master` in `dtype`, replaced by each
    /// broadcast.
    pub(super) fn keep_copy(&mut self, master: &Qwen3, dtype: DType) -> Result<()> {
        if self.rolls_out() {
            self.copy = Some(RolloutCopy::new(master, dtype)?);
        }
        Ok(())
    }

    /// The weights a rollout rank samples.
    pub(super) fn model(&self) -> Result<&Qwen3> {
        self.copy.as_ref().map(|c| c.model()).ok_or_else(|| Error::invalid("roles: no weights on this rank"))
    }

    /// A rollout rank: sends its part of a step's groups (`batch`; `Err`: its rollout
    /// failed, `Ok(None)`: given up) to the trainers: trainer t gets the groups of
    /// its share of all of them, and trainer `j % trainers` the batch figures of
    /// rollout rank j. `group` is the rollout ranks' communicator (collective there).
    pub(super) fn send(
        &self,
        group: &dyn Comm,
        batch: Result<Option<StepBatch>>,
        version: u64,
        sampler_after: SamplerState,
        warnings: Vec<String>,
    ) -> Result<()> {
        let kept = match &batch {
            Ok(Some(b)) => b.kept.examples.len(),
            _ => 0,
        };
        let (_, total) = dist::offset_and_total(group, kept)?;
        let me = group.rank();
        for t in 0..self.trainers {
            let mut part = Part {
                version,
                sampler_after: Some(sampler_after),
                signal: signal::received(),
                ..Part::default()
            };
            match &batch {
                Err(e) => part.error = Some(format!("rollout rank {me}: {e}")),
                Ok(None) => part.absent = true,
                Ok(Some(b)) => {
                    let share = dist::shard(total, t, self.trainers);
                    for (p, (ex, text)) in b.kept.examples.iter().zip(&b.kept.texts).enumerate() {
                        let members: Vec<Sample> =
                            b.kept.samples.iter().filter(|s| s.prompt_index == p).cloned().collect();
                        if members.first().is_some_and(|s| share.contains(&s.group)) {
                            part.groups.push((ex.clone(), text.clone(), members));
                        }
                    }
                    part.rollout_secs = b.rollout_secs;
                    part.gen_batches = b.gen_batches;
                    if me % self.trainers == t {
                        part.figures = true;
                        part.all_seqs = b.all_seqs.clone();
                        part.local_tokens = b.local_tokens;
                        part.groups_dropped = b.groups_dropped;
                        part.engine = b.engine.clone();
                        part.warnings = warnings.clone();
                    }
                }
            }
            self.world.send_bytes(t, &part.encode()?)?;
        }
        Ok(())
    }

    /// A trainer: the step's groups from every rollout rank, merged in the order of
    /// their group ids; `None` when the rollout ranks gave them up. A rollout rank's
    /// failure is an error naming it.
    pub(super) fn receive(&self) -> Result<Option<Received>> {
        let mut parts = Vec::with_capacity(self.rollouts);
        for j in 0..self.rollouts {
            parts.push(Part::decode(&self.world.recv_bytes(self.trainers + j)?)?);
        }
        // A stop signal one rollout rank received is this rank's too.
        if let Some(sig) = parts.iter().find_map(|p| p.signal) {
            signal::adopt(sig);
        }
        if let Some(e) = parts.iter().find_map(|p| p.error.clone()) {
            return Err(Error::invalid(e));
        }
        if parts.iter().any(|p| p.absent) {
            return Ok(None);
        }
        let version = parts[0].version;
        let sampler_after = parts[0]
            .sampler_after
            .ok_or_else(|| Error::invalid("roles: a rollout message without its epoch order"))?;
        let mut b = StepBatch::default();
        let mut have_figures = false;
        let mut groups = Vec::new();
        let mut warnings = Vec::new();
        for p in parts {
            b.rollout_secs = b.rollout_secs.max(p.rollout_secs);
            b.gen_batches = b.gen_batches.max(p.gen_batches);
            groups.extend(p.groups);
            if p.figures {
                // Group ids of the figures' sequences stay distinct across rollout ranks.
                let base = b.all_seqs.iter().map(|q| q.group + 1).max().unwrap_or(0);
                b.all_seqs.extend(p.all_seqs.into_iter().map(|mut q| {
                    q.group += base;
                    q
                }));
                b.local_tokens += p.local_tokens;
                b.groups_dropped += p.groups_dropped;
                // The engine figures of the first rollout rank reporting here, as each rank
                // of a data-parallel run reports its own.
                if !have_figures {
                    b.engine = p.engine;
                    have_figures = true;
                }
                warnings.extend(p.warnings);
            }
        }
        groups.sort_by_key(|(_, _, m)| m.first().map_or(0, |s| s.group));
        let mut kept = Gathered::default();
        for (ex, text, members) in groups {
            let p = kept.examples.len();
            kept.samples.extend(members.into_iter().map(|mut s| {
                s.prompt_index = p;
                s
            }));
            kept.examples.push(ex);
            kept.texts.push(text);
        }
        b.kept = kept;
        Ok(Some(Received { batch: b, version, sampler_after, warnings }))
    }

    /// A trainer: receives the next step's groups, drawn ahead under `plan`.
    pub(super) fn hold(&mut self, plan: &StepPlan) -> Result<()> {
        self.ahead_pending = false;
        let received = self.receive()?;
        self.held = Some(Held {
            sampling: plan.sampling.clone(),
            dynamic_sampling: plan.objective.dynamic_sampling,
            received,
        });
        Ok(())
    }

    /// Seconds the groups held for the next step took to generate (0 when none).
    pub(super) fn held_rollout_secs(&self) -> f64 {
        self.held.as_ref().and_then(|h| h.received.as_ref()).map_or(0.0, |r| r.batch.rollout_secs)
    }

    /// A rollout rank: records the rollout it drew ahead under `plan`.
    pub(super) fn sent_ahead(&mut self, plan: &StepPlan, sampler_before: SamplerState, given_up: bool) {
        self.sent_ahead = Some(SentAhead {
            sampling: plan.sampling.clone(),
            dynamic_sampling: plan.objective.dynamic_sampling,
            sampler_before,
            given_up,
        });
    }

    /// A trainer whose step failed: gives up the next step's groups, received (`held`) or
    /// still on their way (received here and dropped, so that no message is left over).
    pub(super) fn give_up_ahead(&mut self) {
        self.held = None;
        if std::mem::take(&mut self.ahead_pending) {
            let _ = self.receive();
        }
    }

    /// Trainer 0: sends the step's outcome (with `steps`, the steps completed after it)
    /// and, after a step that completed, the new weights of `master` to the rollout
    /// ranks. Other trainers send nothing.
    pub(super) fn publish(&self, outcome: &Result<StepMetrics>, steps: u64, master: &Qwen3) -> Result<()> {
        let Some(fan) = self.fanout.as_ref().filter(|_| self.role == Role::Trainer) else {
            return Ok(());
        };
        let msg = match outcome {
            Ok(m) => Outcome { metrics: Some(m.clone()), error: None, steps, signal: signal::received() },
            Err(e) => {
                Outcome { metrics: None, error: Some(e.to_string()), steps, signal: signal::received() }
            }
        };
        let mut bytes = dist::exact_json_bytes(&msg)?;
        fan.broadcast_bytes(0, &mut bytes)?;
        if outcome.is_ok() {
            let params: Vec<Tensor> = master.merged_params()?.into_iter().map(|(_, t)| t).collect();
            for range in dist::buckets(params.iter().map(|t| t.elem_count()), BUCKET_ELEMS) {
                let mut flat = Vec::new();
                for t in &params[range] {
                    flat.extend(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
                }
                fan.broadcast_f32(0, &mut flat)?;
            }
        }
        Ok(())
    }

    /// A rollout rank: the step's outcome from trainer 0 (the steps the trainers have
    /// completed, and the step's metrics or the error that ended it there) and, after a
    /// step that completed, the new weights.
    pub(super) fn receive_outcome(&self) -> Result<(u64, Result<StepMetrics>)> {
        let fan = self
            .fanout
            .as_ref()
            .ok_or_else(|| Error::invalid("roles: a trainer has no outcome to wait for"))?;
        let mut bytes = Vec::new();
        fan.broadcast_bytes(0, &mut bytes)?;
        let msg: Outcome = dist::exact_json_value(&bytes)
            .map_err(|e| Error::invalid(format!("roles: the step outcome from rank 0: {e}")))?;
        if let Some(sig) = msg.signal {
            signal::adopt(sig);
        }
        let metrics = match (msg.metrics, msg.error) {
            (Some(m), None) => m,
            (_, Some(e)) => {
                return Ok((msg.steps, Err(Error::invalid(format!("on the trainer ranks: {e}")))))
            }
            (None, None) => return Err(Error::invalid("roles: rank 0 sent an empty step outcome")),
        };
        let copy = self.copy.as_ref().ok_or_else(|| Error::invalid("roles: no weights on this rank"))?;
        let params = copy.model().params();
        let dtype = copy.dtype();
        for range in dist::buckets(params.iter().map(|(_, v)| v.elem_count()), BUCKET_ELEMS) {
            let mut flat = vec![0f32; params[range.clone()].iter().map(|(_, v)| v.elem_count()).sum()];
            fan.broadcast_f32(0, &mut flat)?;
            let mut at = 0;
            for (_, v) in &params[range] {
                let n = v.elem_count();
                let t = Tensor::from_slice(&flat[at..at + n], v.shape(), v.device())?.to_dtype(dtype)?;
                v.set(&t)?;
                at += n;
            }
        }
        Ok((msg.steps, Ok(metrics)))
    }
}

/// The step's outcome, trainer 0 to the rollout ranks.
#[derive(Serialize, Deserialize)]
struct Outcome {
    metrics: Option<StepMetrics>,
    error: Option<String>,
    /// The steps the trainers have completed (a step can fail after it counted, e.g. when
    /// its checkpoint cannot be written).
    steps: u64,
    /// A stop signal that trainer 0 received (or adopted from a rollout rank).
    signal: Option<i32>,
}

/// What one rollout rank sends one trainer of one step.
#[derive(Default, Serialize, Deserialize)]
struct Part {
    /// The rollout failed on the rollout rank.
    error: Option<String>,
    /// A stop signal the rollout rank received.
    signal: Option<i32>,
    /// The rollout was given up (drawn ahead, failed or cancelled): drawn again next step.
    absent: bool,
    version: u64,
    sampler_after: Option<SamplerState>,
    /// The groups of the trainer's share: example, prompt text, responses.
    groups: Vec<(Example, String, Vec<Sample>)>,
    rollout_secs: f64,
    gen_batches: usize,
    /// Whether the batch figures below are this trainer's to report.
    figures: bool,
    all_seqs: Vec<Sequence>,
    local_tokens: usize,
    groups_dropped: usize,
    engine: RolloutFigures,
    warnings: Vec<String>,
}

impl Part {
    /// The message without the per-token f32 vectors (log-probs, entropies), in
    /// [`dist::exact_json_bytes`], then those vectors as their bits, so that every value
    /// arrives exactly (NaN and infinities too): `[u64 length][message][u64 count]
    /// [u64 lengths...][f32 values...]`.
    fn encode(mut self) -> Result<Vec<u8>> {
        let mut floats: Vec<Vec<f32>> = Vec::new();
        for (_, _, members) in &mut self.groups {
            for s in members {
                floats.push(std::mem::take(&mut s.logprobs));
                floats.push(std::mem::take(&mut s.old_logprobs));
                floats.push(std::mem::take(&mut s.entropies));
            }
        }
        for q in &mut self.all_seqs {
            floats.push(q.rollout_logprobs.take().unwrap_or_default());
        }
        let json = dist::exact_json_bytes(&self)?;
        let mut out = Vec::with_capacity(json.len() + 16);
        out.extend((json.len() as u64).to_le_bytes());
        out.extend(json);
        out.extend((floats.len() as u64).to_le_bytes());
        for f in &floats {
            out.extend((f.len() as u64).to_le_bytes());
        }
        for f in &floats {
            out.extend(f.iter().flat_map(|x| x.to_le_bytes()));
        }
        Ok(out)
    }

    fn decode(bytes: &[u8]) -> Result<Self> {
        let bad = || Error::invalid("roles: a rollout message cut short");
        let mut at = 0usize;
        let word = |at: &mut usize| -> Result<usize> {
            let w = bytes.get(*at..*at + 8).ok_or_else(bad)?;
            *at += 8;
            Ok(u64::from_le_bytes(w.try_into().map_err(|_| bad())?) as usize)
        };
        let n = word(&mut at)?;
        let json = bytes.get(at..at + n).ok_or_else(bad)?;
        at += n;
        let mut part: Part = dist::exact_json_value(json)
            .map_err(|e| Error::invalid(format!("roles: rollout message: {e}")))?;
        let count = word(&mut at)?;
        let lens = (0..count).map(|_| word(&mut at)).collect::<Result<Vec<usize>>>()?;
        let mut floats = lens.into_iter().map(|len| {
            let b = bytes.get(at..at + 4 * len).ok_or_else(bad)?;
            at += 4 * len;
            Ok(dist::bytes_f32(b))
        });
        let mut next = || floats.next().unwrap_or_else(|| Err(bad()));
        for (_, _, members) in &mut part.groups {
            for s in members {
                s.logprobs = next()?;
                s.old_logprobs = next()?;
                s.entropies = next()?;
            }
        }
        for q in &mut part.all_seqs {
            q.rollout_logprobs = Some(next()?);
        }
        Ok(part)
    }
}
