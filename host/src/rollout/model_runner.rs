//! The model runner (vLLM v1's `gpu_model_runner.py`): lays a step's
//! scheduled tokens out for one call of [`model::decode_paged`] (prefill
//! chunks and decode rows together), and draws the next token of every unit
//! that is ready from the call's logits, each from its own response's
//! generator.

use std::time::Instant;

use super::device::StepLogits;
use super::request::{Requests, Unit};
use super::row::Row;
use super::sampler::{Sampler, TokenDraw};
use super::stats::EngineStats;
use crate::model::{self, DecodeWeights, Kernels, PagedKvCache, PagedSeq, Qwen3};
use crate::Result;

/// The sampling model, its projections fused for decoding, and its sampling
/// transform.
pub(super) struct ModelRunner<'a> {
    model: &'a Qwen3,
    /// `model`'s projections fused ([`DecodeWeights`]), taken from its
    /// weights when the runner is made, i.e. when a generation starts: the
    /// weights do not change while it runs. `None` under `--kernels composed`.
    weights: Option<DecodeWeights>,
    sampler: Sampler,
}

impl<'a> ModelRunner<'a> {
    /// The model it runs.
    pub(super) fn model(&self) -> &'a Qwen3 {
        self.model
    }

    pub(super) fn new(model: &'a Qwen3, sampler: Sampler) -> Result<Self> {
        let weights = match Kernels::current() {
            Kernels::Fused => Some(DecodeWeights::new(model)?),
            Kernels::Composed => None,
        };
        Ok(Self { model, weights, sampler })
    }

    /// The decode path it runs (see [`super::EngineStats::decode_path`]).
    pub(super) fn path(&self) -> &'static str {
        if self.weights.is_some() {
            "kernels, fused projections"
        } else {
            "composed"
        }
    }

    /// One model call over the scheduled `(running index, tokens)` pairs;
    /// logits `(units, vocab)`.
    pub(super) fn forward(
        &self,
        sched: &[(usize, usize)],
        running: &[Unit],
        reqs: &Requests,
        cache: &PagedKvCache,
        stats: &mut EngineStats,
    ) -> Result<StepLogits> {
        let mut tokens = Vec::new();
        let mut seqs = Vec::with_capacity(sched.len());
        for &(i, n) in sched {
            let u = &running[i];
            let len = u.table.len();
            tokens.extend((len - n..len).map(|p| reqs.token(u.kind, p)));
            seqs.push(PagedSeq { blocks: u.table.blocks().to_vec(), len, new: n });
            if u.prefill {
                stats.prefill_tokens += n;
            }
        }
        stats.model_calls += 1;
        stats.rows_fed += sched.len();
        let t0 = Instant::now();
        let logits = model::decode_paged(self.model, self.weights.as_ref(), &tokens, &seqs, cache)?;
        let t1 = Instant::now();
        let step = StepLogits::new(&logits, &self.sampler)?;
        stats.phases.model += (t1 - t0).as_secs_f64();
        stats.phases.logits += t1.elapsed().as_secs_f64();
        Ok(step)
    }

    /// Draws one token for each `(logits row, row id)` of `draws` (sorted by
    /// row id), from that row's generator.
    pub(super) fn sample(
        &self,
        logits: &StepLogits,
        draws: &[(usize, usize)],
        rows: &mut [Row],
    ) -> Result<Vec<TokenDraw>> {
        let mut it = draws.iter().peekable();
        let mut pairs = Vec::with_capacity(draws.len());
        for (id, row) in rows.iter_mut().enumerate() {
            if let Some(&(k, _)) = it.next_if(|&&(_, w)| w == id) {
                pairs.push((k, &mut row.rng));
            }
        }
        logits.draw(&self.sampler, pairs)
    }
}
