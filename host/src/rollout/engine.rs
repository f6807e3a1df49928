//! The rollout engine: continuous batching over a paged KV cache, in vLLM
//! v1's shape (Kwon et al. 2023): each step the scheduler picks the work
//! (`super::scheduler`: the queues and the scheduling policy), the KV-cache
//! manager gives it slots ([`super::kv_cache_manager`]: the block budget, the
//! pool, prefix caching), the model runner runs one model call and draws
//! (`super::model_runner`), and the engine appends the draws, ends the
//! responses that stop and retires them (`run`). [`EngineStats`] records
//! what the call did.
//!
//! A GRPO group is prefilled once, as one unit; when its prompt is in the
//! cache it forks into its `n` samples, which share the prompt's blocks
//! (`rollout::blocks`: reference counts, copy on write of the partial last
//! block) and each draw their first token from the prompt's last logits.
//!
//! Every response draws from its own generator (`row_seed`), one number per
//! token, so what it samples does not depend on the schedule: not on its
//! neighbours, on preemption, or on the policy.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::batch::{Finish, Sample};
use super::config::EngineConfig;
use super::kv_cache_manager::KvCacheManager;
use super::model_runner::ModelRunner;
use super::request::{prompts_waiting, Kind, Queues, Requests, Unit};
use super::row::{Row, StopRules};
use super::sampler::Sampler;
use super::scheduler::{SchedulePolicy, Scheduler};
use super::stats::EngineStats;
use super::SamplingParams;
use crate::model::{budget, Qwen3};
use crate::{Error, Result};

/// How a generation runs ([`super::generate_with`] and this module's `run`):
/// the engine's settings and scheduling policy, the seeds' offset, and the
/// caller's progress, cancellation and forced lengths.
#[derive(Clone, Copy, Default)]
pub struct GenerateOptions<'a> {
    /// Called after every step with the number of tokens sampled so far.
    pub progress: Option<&'a dyn Fn(usize)>,
    /// When set to true, generation stops at the next step with an error.
    pub cancel: Option<&'a AtomicBool>,
    /// The KV cache budget, rows decoded at once and block size.
    pub engine: EngineConfig,
    /// How the scheduler admits prompts (continuous batching by default).
    pub policy: SchedulePolicy,
    /// Index of `prompts[0]` in the whole batch, for the per-response seeds: a
    /// data-parallel rank that samples prompts `[lo, hi)` of a step's batch
    /// passes `lo`, so every response is drawn as in a one-process run.
    pub first_prompt_index: usize,
    /// Forced lengths (benchmarks): response `(global prompt index, sample
    /// index)` ends, as truncated, at this many tokens (at most `max_new_tokens`).
    pub lengths: Option<&'a dyn Fn(usize, usize) -> usize>,
    /// The policy version (updates applied) of the weights sampling; when set,
    /// every token records it (`Sample::versions`: partial rollouts).
    pub version: Option<u64>,
}

/// One call of `run`: the responses, the scheduler, the cache and the model.
struct Engine<'a> {
    reqs: Requests<'a>,
    scheduler: Scheduler,
    kv: KvCacheManager,
    runner: ModelRunner<'a>,
    stops: StopRules,
    decode: &'a dyn Fn(&[u32]) -> String,
    opts: &'a GenerateOptions<'a>,
    out: Vec<Sample>,
    stats: EngineStats,
}

/// The KV cache of a call and the units holding blocks in it when the call
/// ended: what a partial rollout that keeps its cache (`rollout.partial.kv =
/// "keep"`) hands from one call to the next. `running` is oldest first, its
/// kinds those of the call that ended.
pub(super) struct CacheState {
    pub(super) kv: KvCacheManager,
    pub(super) running: Vec<Unit>,
}

/// What [`run_requests`] returns: the responses that ended (in order of
/// completion), the figures, every row (an unfinished one as the call left it)
/// and the cache with the units still in it.
pub(super) struct CallEnd {
    pub(super) out: Vec<Sample>,
    pub(super) stats: EngineStats,
    pub(super) rows: Vec<Row>,
    pub(super) cache: CacheState,
}

/// Samples `params.n` responses for each of `prompts` (validated by the
/// caller) with the engine; returns them in order of completion and the
/// rollout's figures.
pub(super) fn run(
    model: &Qwen3,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
    decode: &dyn Fn(&[u32]) -> String,
    opts: &GenerateOptions,
    eos: Option<u32>,
) -> Result<(Vec<Sample>, EngineStats)> {
    let reqs = Requests::new(prompts, params, opts.first_prompt_index);
    let end = run_requests(model, reqs, prompts_waiting(prompts.len()), None, decode, opts, eos)?;
    Ok((end.out, end.stats))
}

/// Whether prefix caching runs in a call under `opts`.
pub(super) fn caching(opts: &GenerateOptions) -> bool {
    opts.engine.enable_prefix_caching && opts.policy.build().prefix_caching()
}

/// [`run`] over responses already set up (`reqs`: some may have drawn tokens,
/// or ended) with `waiting` queued in this order and, from `kept`, a cache
/// whose running units (their kinds those of `reqs`) continue first, oldest
/// first; the caller checked that the cache serves this call
/// (`KvCacheManager::serves`). Without `kept` the call makes its own cache.
pub(super) fn run_requests(
    model: &Qwen3,
    reqs: Requests,
    waiting: VecDeque<Kind>,
    kept: Option<CacheState>,
    decode: &dyn Fn(&[u32]) -> String,
    opts: &GenerateOptions,
    eos: Option<u32>,
) -> Result<CallEnd> {
    let start = Instant::now();
    let (prompts, params) = (reqs.prompts, reqs.params);
    let cfg = opts.engine;
    cfg.validate()?;
    let max_rows = cfg.rows(model);
    let (kept, running) = match kept {
        Some(k) => (Some(k.kv), k.running),
        None => (None, Vec::new()),
    };
    let queues = Queues { waiting, running };
    let scheduler = Scheduler::new(opts.policy.build(), queues, max_rows);
    let caching = cfg.enable_prefix_caching && scheduler.prefix_caching();
    // The runner's fused projections first, so that a cache sized by the free
    // memory leaves room for them.
    let runner = ModelRunner::new(model, Sampler::new(params))?;
    let mut kv = match kept {
        Some(kv) => kv,
        None => KvCacheManager::new(model, &cfg, prompts, params, max_rows, caching)?,
    };
    kv.pool.reset_peak();
    let evictions = kv.pool.evictions();
    let stats = EngineStats {
        block_size: cfg.block_size,
        pool_blocks: kv.pool.num_blocks(),
        bytes_per_token: kv.bytes_per_token(),
        ..EngineStats::default()
    };
    let mut e = Engine {
        reqs,
        scheduler,
        kv,
        runner,
        stops: StopRules::new(params, eos),
        decode,
        opts,
        out: Vec::with_capacity(prompts.len() * params.n),
        stats,
    };
    while !e.scheduler.is_done(&e.reqs) {
        e.step()?;
        if let Some(progress) = opts.progress {
            progress(e.stats.tokens);
        }
        let busy = !e.scheduler.is_done(&e.reqs);
        if busy && opts.cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            return Err(Error::invalid(format!("generate: cancelled after {} tokens", e.stats.tokens)));
        }
    }
    e.stats.peak_blocks = e.kv.pool.peak_used();
    e.stats.decode_path = e.runner.path().to_string();
    e.stats.prefix_cache_evictions = e.kv.pool.evictions() - evictions;
    e.stats.secs = start.elapsed().as_secs_f64();
    let running = std::mem::take(&mut e.scheduler.queues.running);
    Ok(CallEnd { out: e.out, stats: e.stats, rows: e.reqs.rows, cache: CacheState { kv: e.kv, running } })
}

impl Engine<'_> {
    /// One step: schedule, run the model once, draw, retire finished rows.
    fn step(&mut self) -> Result<()> {
        let t0 = Instant::now();
        let sched = self.scheduler.schedule(&mut self.kv, &self.reqs, &mut self.stats)?;
        let live: usize = self.scheduler.queues.running.iter().map(|u| u.table.len()).sum();
        self.stats.peak_live_tokens = self.stats.peak_live_tokens.max(live);
        self.stats.phases.schedule += t0.elapsed().as_secs_f64();
        let running = &self.scheduler.queues.running;
        let decode = sched.iter().all(|&(_, n)| n == 1);
        let context: usize = sched.iter().map(|&(i, _)| running[i].table.len()).sum();
        let (start, counts) = (Instant::now(), budget::snapshot());
        let logits = self.runner.forward(&sched, running, &self.reqs, self.kv.cache(), &mut self.stats)?;
        let t0 = Instant::now();
        let ready = self.scheduler.ready(&sched, &mut self.kv, &self.reqs);
        let draws = self.runner.sample(&logits, &ready.draws, &mut self.reqs.rows)?;
        let drew = self.reqs.params.temperature != 0.0;
        for (&(_, id), d) in ready.draws.iter().zip(draws) {
            self.reqs.rows[id].push(d, drew, self.opts.version);
            self.stats.tokens += 1;
            self.check_finish(id);
        }
        self.scheduler.retire(ready, &mut self.kv, &self.reqs);
        self.stats.phases.draw += t0.elapsed().as_secs_f64();
        if decode {
            let m = self.runner.model();
            let s = &mut self.stats;
            s.decode_steps += 1;
            s.decode_rows.push(sched.len() as u32);
            s.decode_secs += start.elapsed().as_secs_f64();
            s.decode_counts.add(&budget::snapshot().since(&counts));
            s.decode_bytes += budget::decode_step_bytes(
                m.config(),
                m.dtype(),
                self.kv.cache().dtype(),
                sched.len(),
                context,
            );
        }
        Ok(())
    }

    /// Ends row `id` if its last token stops it or it reached its length.
    fn check_finish(&mut self, id: usize) {
        let (n, max_new) = (self.reqs.n(), self.reqs.params.max_new_tokens);
        let row = &self.reqs.rows[id];
        let cap = match self.opts.lengths {
            Some(f) => f(self.reqs.global[id / n], id % n).clamp(1, max_new),
            None => max_new,
        };
        let finish = self
            .stops
            .check(&row.ids, self.decode)
            .or_else(|| (row.ids.len() >= cap).then_some(Finish::Length));
        if let Some(finish) = finish {
            let prompts = self.reqs.prompts;
            let s = self.reqs.rows[id].finish(finish, &prompts[id / n], self.decode);
            self.out.push(s);
            if self.reqs.group_done(id) {
                self.reqs.groups_done += 1;
            }
        }
    }
}
