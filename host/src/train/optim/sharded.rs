//! [`ShardedAdamW`]: AdamW with its state split over the ranks of a data-parallel
//! run, DeepSpeed's ZeRO stages 1 and 2 (Rajbhandari et al., "ZeRO: Memory
//! Optimizations Toward Training Trillion Parameter Models", SC 2020) in the
//! layout of DeepSpeed's `DeepSpeedZeroOptimizer` and PyTorch FSDP's flat
//! parameter:
//!
//! - the trainable parameters, in order, form one flat index space of `total`
//!   elements, padded to `size * chunk` (`chunk = ceil(total / size)`); rank `r`
//!   owns the contiguous range `[r * chunk, (r + 1) * chunk)` of it, clipped to
//!   `total` ([`FlatLayout`]). Equal blocks are what NCCL's reduce-scatter and
//!   all-gather need, and why FSDP pads its flat parameter the same way;
//! - each rank holds the f32 moments of its range, and f32 master weights of it
//!   when the model's weights are not f32 (mixed precision);
//! - after the micro-batches, the gradients are summed over ranks: all-reduced
//!   with ZeRO-1 ([`ShardMode::Optimizer`]), each rank then reading its range;
//!   reduce-scattered with ZeRO-2 ([`ShardMode::Gradients`]) in rounds of one
//!   bucket, each round taking the same sub-block of every rank's range, and each
//!   full gradient dropped after the last round that reads it, so a rank ends
//!   with its range's summed gradient alone;
//! - the global gradient norm is the square root of the ranks' summed squares,
//!   and clipping, per-parameter step counts, weight decay and skipping a
//!   non-finite step are those of [`AdamW`](super::AdamW), element for element
//!   (the same fused kernel runs over each parameter's segment of the range);
//! - the updated ranges are all-gathered, round by round, straight into every
//!   rank's weights (in the weights' dtype), so all ranks hold the same full model.
//!
//! With one rank the range is everything and the result is that of [`AdamW`](super::AdamW)
//! (with f32 master weights for a bf16 model). Parameters without a gradient on
//! any rank are left alone, as [`AdamW`](super::AdamW) leaves them.

use std::ops::Range;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use super::adamw::{check_lr, clip_coef, generic_new_values, update_stays_finite};
use super::config::{AdamWConfig, ShardMode};
use super::kernels::{fused_supported, grad_sum_sq, update_fused_tensors};
use super::state::{hyper, Hyper};
use super::{Optimizer, StepReport};
use crate::dist::{self, Comm, BUCKET_ELEMS};
use crate::{Error, Result};

/// Where each parameter sits in the flat index space and which range each rank owns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatLayout {
    /// Start of every parameter, and the total at the end (`numels.len() + 1` entries).
    offsets: Vec<usize>,
    size: usize,
    chunk: usize,
}

/// The part of one parameter inside a flat range: elements `at..at + len` of the
/// parameter (flattened), at flat position `flat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Index of the parameter.
    pub param: usize,
    /// First element of the piece within the flattened parameter.
    pub at: usize,
    /// Elements in the piece.
    pub len: usize,
    /// Position of the piece's first element in the flat range.
    pub flat: usize,
}

impl FlatLayout {
    /// Parameters of `numels` elements, in order, over `size` ranks.
    pub fn new(numels: impl IntoIterator<Item = usize>, size: usize) -> Self {
        let mut offsets = vec![0];
        for n in numels {
            offsets.push(offsets[offsets.len() - 1] + n);
        }
        let size = size.max(1);
        let total = offsets[offsets.len() - 1];
        Self { offsets, size, chunk: total.div_ceil(size) }
    }

    /// Elements of all parameters.
    pub fn total(&self) -> usize {
        self.offsets[self.offsets.len() - 1]
    }

    /// Ranks the space is split over.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Elements per rank block (the last ranks' ranges may be shorter).
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Parameter `i`'s elements `offset..offset + numel` in the flat space.
    pub fn param(&self, i: usize) -> Range<usize> {
        self.offsets[i]..self.offsets[i + 1]
    }

    /// Number of parameters.
    pub fn n_params(&self) -> usize {
        self.offsets.len() - 1
    }

    /// The flat range rank `rank` owns.
    pub fn range(&self, rank: usize) -> Range<usize> {
        let total = self.total();
        (rank * self.chunk).min(total)..((rank + 1) * self.chunk).min(total)
    }

    /// The parameters' pieces inside `lo..hi`, in flat order.
    pub fn pieces(&self, lo: usize, hi: usize) -> Vec<Piece> {
        let hi = hi.min(self.total());
        let mut out = Vec::new();
        if lo >= hi {
            return out;
        }
        let mut i = self.offsets.partition_point(|&o| o <= lo) - 1;
        while i < self.n_params() && self.offsets[i] < hi {
            let (a, b) = (self.offsets[i].max(lo), self.offsets[i + 1].min(hi));
            if a < b {
                out.push(Piece { param: i, at: a - self.offsets[i], len: b - a, flat: a });
            }
            i += 1;
        }
        out
    }
}

/// One parameter of the sharded optimizer.
struct Slot {
    name: String,
    var: Var,
    /// Steps in which this parameter had a gradient on some rank (the same on every rank).
    steps: u64,
    decay: bool,
}

/// AdamW over a contiguous range of the flattened parameters (ZeRO-1/2). See the module docs.
pub struct ShardedAdamW {
    slots: Vec<Slot>,
    cfg: AdamWConfig,
    step: u64,
    mode: ShardMode,
    layout: FlatLayout,
    rank: usize,
    /// f32 moments of this rank's range (private storage).
    m: Tensor,
    v: Tensor,
    /// f32 master weights of this rank's range when the weights are not f32.
    master: Option<Tensor>,
    dtype: DType,
    device: Device,
    /// Elements of one reduce-scatter or all-gather round, over all ranks.
    bucket_elems: usize,
}

impl std::fmt::Debug for ShardedAdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedAdamW")
            .field("mode", &self.mode)
            .field("rank", &self.rank)
            .field("size", &self.layout.size)
            .field("range", &self.range())
            .field("step", &self.step)
            .finish()
    }
}

impl ShardedAdamW {
    /// The optimizer of rank `rank` of `size` over `params` (same dtype and device,
    /// unique names), with zeroed moments for its range. `mode` is
    /// [`ShardMode::Optimizer`] or [`ShardMode::Gradients`].
    pub fn new(
        params: Vec<(String, Var)>,
        cfg: AdamWConfig,
        mode: ShardMode,
        rank: usize,
        size: usize,
    ) -> Result<Self> {
        cfg.validate()?;
        if mode == ShardMode::None {
            return Err(Error::invalid("sharded adamw: shard mode `none` is the plain AdamW"));
        }
        if rank >= size.max(1) {
            return Err(Error::invalid(format!("sharded adamw: rank {rank} of {size} ranks")));
        }
        let (dtype, device) = match params.first() {
            Some((_, v)) => (v.dtype(), v.device().clone()),
            None => (DType::F32, Device::Cpu),
        };
        let mut seen = std::collections::HashSet::new();
        for (name, var) in &params {
            if !seen.insert(name.clone()) {
                return Err(Error::invalid(format!("sharded adamw: parameter name `{name}` appears twice")));
            }
            if !var.dtype().is_float() || var.dtype() != dtype || !var.device().same_device(&device) {
                return Err(Error::invalid(format!(
                    "sharded adamw: parameter `{name}` is {:?} on {:?}; every parameter must be {dtype:?} on {:?}",
                    var.dtype(),
                    var.device(),
                    device
                )));
            }
        }
        let layout = FlatLayout::new(params.iter().map(|(_, v)| v.elem_count()), size);
        let slots: Vec<Slot> =
            params.into_iter().map(|(name, var)| Slot { name, var, steps: 0, decay: true }).collect();
        let n = layout.range(rank).len();
        let mut opt = Self {
            m: Tensor::zeros(n, DType::F32, &device)?,
            v: Tensor::zeros(n, DType::F32, &device)?,
            master: None,
            slots,
            cfg,
            step: 0,
            mode,
            layout,
            rank,
            dtype,
            device,
            bucket_elems: BUCKET_ELEMS,
        };
        if dtype != DType::F32 {
            opt.master = Some(opt.own_weights()?);
        }
        Ok(opt)
    }

    /// Excludes from weight decay every parameter whose name satisfies `no_decay`.
    pub fn with_no_decay(mut self, no_decay: impl Fn(&str) -> bool) -> Self {
        for s in &mut self.slots {
            s.decay = !no_decay(&s.name);
        }
        self
    }

    /// Sets the elements of one communication round (over all ranks); tests use
    /// small buckets to exercise several rounds.
    pub fn with_bucket_elems(mut self, elems: usize) -> Self {
        self.bucket_elems = elems.max(1);
        self
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.cfg
    }

    /// Optimizer steps taken (skipped steps are not counted).
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// ZeRO-1 or ZeRO-2.
    pub fn mode(&self) -> ShardMode {
        self.mode
    }

    /// The flat layout of the parameters over the ranks.
    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    /// This optimizer's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The flat range this rank owns.
    pub fn range(&self) -> Range<usize> {
        self.layout.range(self.rank)
    }

    /// The parameters by name, in order.
    pub fn params(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.slots.iter().map(|s| (s.name.as_str(), &s.var))
    }

    /// Total number of parameter elements (all ranks' ranges).
    pub fn n_elements(&self) -> usize {
        self.layout.total()
    }

    /// Elements of `lo..hi` (flat) of `value(param)` as one fresh f32 tensor on the
    /// optimizer's device; a parameter for which `value` gives `None` reads as zeros,
    /// and so does the padding past the last parameter.
    fn gather_flat(&self, lo: usize, hi: usize, value: impl Fn(usize) -> Option<Tensor>) -> Result<Tensor> {
        let mut parts = Vec::new();
        let mut at = lo;
        for p in self.layout.pieces(lo, hi) {
            parts.push(match value(p.param) {
                Some(t) => t.flatten_all()?.narrow(0, p.at, p.len)?.to_dtype(DType::F32)?,
                None => Tensor::zeros(p.len, DType::F32, &self.device)?,
            });
            at = p.flat + p.len;
        }
        if hi > at {
            parts.push(Tensor::zeros(hi - at, DType::F32, &self.device)?);
        }
        // `cat` (or `copy` of a single part) gives storage of its own.
        Ok(match parts.len() {
            0 => Tensor::zeros(0, DType::F32, &self.device)?,
            1 => parts[0].copy()?,
            _ => Tensor::cat(&parts, 0)?,
        })
    }

    /// This rank's range of the weights, as a fresh f32 tensor.
    fn own_weights(&self) -> Result<Tensor> {
        let r = self.range();
        self.gather_flat(r.start, r.end, |i| Some(self.slots[i].var.as_tensor().clone()))
    }

    /// Which parameters have a gradient on some rank (one collective); a gradient of
    /// the wrong shape is an error naming its parameter.
    fn presence(&self, comm: &dyn Comm, grads: &GradStore) -> Result<Vec<bool>> {
        let mut present = Vec::with_capacity(self.slots.len());
        for s in &self.slots {
            let g = grads.get(s.var.as_tensor());
            if let Some(g) = g {
                if g.dims() != s.var.dims() {
                    return Err(Error::Shape {
                        file: "gradients".into(),
                        name: s.name.clone(),
                        expected: s.var.dims().to_vec(),
                        found: g.dims().to_vec(),
                    });
                }
            }
            present.push(if g.is_some() { 1.0 } else { 0.0 });
        }
        comm.all_reduce_f32(&mut present)?;
        Ok(present.into_iter().map(|p| p > 0.0).collect())
    }

    /// Elements per rank block of one round, and the number of rounds.
    fn rounds(&self) -> (usize, usize) {
        let per = (self.bucket_elems / self.layout.size).max(1);
        (per, self.layout.chunk.div_ceil(per))
    }

    /// ZeRO-2: this rank's range of the gradients summed over ranks, reduce-scattered
    /// in rounds; every gradient leaves `grads` after the last round that reads it.
    fn reduce_scatter_grads(&self, comm: &dyn Comm, grads: &mut GradStore) -> Result<Tensor> {
        let (per, rounds) = self.rounds();
        let chunk = self.layout.chunk;
        let last_round: Vec<usize> = (0..self.slots.len())
            .map(|i| {
                let r = self.layout.param(i);
                let wraps = r.len() >= chunk || (r.start % chunk) + r.len() > chunk;
                let max_off = if wraps { chunk - 1 } else { (r.end - 1) % chunk };
                if r.is_empty() {
                    0
                } else {
                    max_off / per
                }
            })
            .collect();
        let mut mine = Vec::with_capacity(rounds);
        for k in 0..rounds {
            let (lo, hi) = (k * per, ((k + 1) * per).min(chunk));
            let mut parts = Vec::with_capacity(self.layout.size);
            for r in 0..self.layout.size {
                let base = r * chunk;
                let value = |i: usize| grads.get(self.slots[i].var.as_tensor()).cloned();
                parts.push(self.gather_flat(base + lo, base + hi, value)?);
            }
            let buf = Tensor::cat(&parts, 0)?;
            drop(parts);
            mine.push(comm.reduce_scatter_tensor(&buf)?);
            for (i, s) in self.slots.iter().enumerate() {
                if last_round[i] == k {
                    grads.remove(s.var.as_tensor());
                }
            }
        }
        let n = self.range().len();
        let all = if mine.is_empty() {
            Tensor::zeros(0, DType::F32, &self.device)?
        } else {
            Tensor::cat(&mine, 0)?
        };
        Ok(all.narrow(0, 0, n)?)
    }

    /// This rank's range of the summed gradient: all-reduced (ZeRO-1) or
    /// reduce-scattered (ZeRO-2).
    fn summed_grad(&self, comm: &dyn Comm, grads: &mut GradStore) -> Result<Tensor> {
        match self.mode {
            ShardMode::Gradients if comm.size() > 1 => self.reduce_scatter_grads(comm, grads),
            _ => {
                let vars: Vec<&Var> = self.slots.iter().map(|s| &s.var).collect();
                dist::all_reduce_grads(comm, &vars, grads)?;
                let r = self.range();
                self.gather_flat(r.start, r.end, |i| grads.get(self.slots[i].var.as_tensor()).cloned())
            }
        }
    }

    /// Writes every rank's updated range of `p` (f32, this rank's range) into the
    /// weights of every rank, in rounds of one bucket, in the weights' dtype.
    fn all_gather_weights(&self, comm: &dyn Comm, p: &Tensor, present: &[bool]) -> Result<()> {
        let (per, rounds) = self.rounds();
        let (chunk, n) = (self.layout.chunk, self.range().len());
        let views: Vec<Tensor> =
            self.slots.iter().map(|s| s.var.as_tensor().flatten_all()).collect::<candle_core::Result<_>>()?;
        for k in 0..rounds {
            let (lo, hi) = (k * per, ((k + 1) * per).min(chunk));
            let len = hi - lo;
            // This rank's part of the round, padded past its range's end.
            let have = n.saturating_sub(lo).min(len);
            let mut mine = p.narrow(0, lo.min(n), have)?;
            if have < len {
                mine = Tensor::cat(&[mine, Tensor::zeros(len - have, DType::F32, &self.device)?], 0)?;
            }
            let all = comm.all_gather_tensor(&mine.to_dtype(self.dtype)?)?;
            for r in 0..self.layout.size {
                let base = r * chunk + lo;
                for pc in self.layout.pieces(base, base + len) {
                    if present[pc.param] {
                        let src = all.narrow(0, r * len + pc.flat - base, pc.len)?.contiguous()?;
                        views[pc.param].slice_set(&src, 0, pc.at)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// One step (see the module docs). Every rank calls it with the same `lr`. The
    /// checks are [`AdamW::step`](super::AdamW::step)'s, over the shards: a learning
    /// rate no step can use is an error; a non-finite global gradient norm, or an update
    /// that would leave a weight or moment of any rank's range non-finite, skips the
    /// step on every rank with nothing changed.
    pub fn step(&mut self, comm: &dyn Comm, grads: &mut GradStore, lr: f64) -> Result<StepReport> {
        check_lr(&self.cfg, lr)?;
        if comm.size() != self.layout.size || comm.rank() != self.rank {
            return Err(Error::invalid(format!(
                "sharded adamw: built for rank {} of {}, stepped by rank {} of {}",
                self.rank,
                self.layout.size,
                comm.rank(),
                comm.size()
            )));
        }
        let present = self.presence(comm, grads)?;
        let missing = present.iter().filter(|&&p| !p).count();
        let g = self.summed_grad(comm, grads)?;
        let [sum_sq] = dist::sum_f64(comm, [grad_sum_sq(&g)?])?;
        let grad_norm = sum_sq.sqrt();
        let Some(clip_coef) = clip_coef(&self.cfg, grad_norm) else {
            return Ok(StepReport::skipped(grad_norm, None, missing));
        };
        let p = match &self.master {
            Some(m) => m.clone(),
            None => self.own_weights()?,
        };
        // The hyper-parameters of each piece, at the step count the update will have.
        let start = self.range().start;
        let pieces: Vec<(Piece, Hyper)> = self
            .layout
            .pieces(start, self.range().end)
            .into_iter()
            .filter(|pc| present[pc.param])
            .map(|pc| {
                let s = &self.slots[pc.param];
                (pc, hyper(&self.cfg, lr, s.steps + 1, s.decay, clip_coef))
            })
            .collect();
        if let Some(name) = self.first_nonfinite_update(comm, &p, &g, &pieces)? {
            return Ok(StepReport::skipped(grad_norm, Some(name), missing));
        }
        for (s, &p) in self.slots.iter_mut().zip(&present) {
            s.steps += u64::from(p);
        }
        for (pc, h) in &pieces {
            self.update_segment(&p, &g, pc.flat - start, pc.len, h)?;
        }
        self.step += 1;
        self.all_gather_weights(comm, &p, &present)?;
        Ok(StepReport::applied(grad_norm, clip_coef, missing))
    }

    /// The first parameter (in flat order) whose update would leave a non-finite weight
    /// or moment on some rank: each rank checks its own pieces read-only, with the
    /// arithmetic of the path that will run them, and the flags are summed over ranks
    /// so that every rank names the same parameter (or none).
    fn first_nonfinite_update(
        &self,
        comm: &dyn Comm,
        p: &Tensor,
        g: &Tensor,
        pieces: &[(Piece, Hyper)],
    ) -> Result<Option<String>> {
        let start = self.range().start;
        let mut bad = vec![0.0f64; self.slots.len()];
        for (pc, h) in pieces {
            let [ps, gs, ms, vs] = [p, g, &self.m, &self.v].map(|t| t.narrow(0, pc.flat - start, pc.len));
            if !update_stays_finite(&ps?, &gs?, &ms?, &vs?, h, true)? {
                bad[pc.param] = 1.0;
            }
        }
        comm.all_reduce_f64(&mut bad)?;
        Ok(bad.iter().position(|&b| b > 0.0).map(|i| self.slots[i].name.clone()))
    }

    /// The AdamW update of elements `at..at + len` of this rank's range: the fused
    /// CPU kernel on views of the flat shards, or candle ops written back in place.
    fn update_segment(&self, p: &Tensor, g: &Tensor, at: usize, len: usize, h: &Hyper) -> Result<()> {
        let [ps, gs, ms, vs] = [p, g, &self.m, &self.v].map(|t| t.narrow(0, at, len));
        let (ps, gs, ms, vs) = (ps?, gs?, ms?, vs?);
        if fused_supported(&ps) {
            return update_fused_tensors(&ps, &gs, &ms, &vs, h);
        }
        let (m_new, v_new, p_new) = generic_new_values(&ps, &gs, &ms, &vs, h)?;
        self.m.slice_set(&m_new.contiguous()?, 0, at)?;
        self.v.slice_set(&v_new.contiguous()?, 0, at)?;
        p.slice_set(&p_new.contiguous()?, 0, at)?;
        Ok(())
    }
}

impl Optimizer for ShardedAdamW {
    fn trainable(&self) -> Vec<Var> {
        self.slots.iter().map(|s| s.var.clone()).collect()
    }
    fn step_on(&mut self, comm: &dyn Comm, grads: &mut GradStore, lr: f64) -> Result<StepReport> {
        self.step(comm, grads, lr)
    }
    fn state_bytes(&self) -> usize {
        let per = 2 + usize::from(self.master.is_some());
        4 * per * self.range().len()
    }
}

/// Accessors for the checkpoint code (`shard_files.rs`).
impl ShardedAdamW {
    /// This rank's state as named flat f32 tensors: `exp_avg`, `exp_avg_sq` and, with
    /// master weights, `master`.
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out =
            vec![("exp_avg".to_string(), self.m.clone()), ("exp_avg_sq".to_string(), self.v.clone())];
        if let Some(p) = &self.master {
            out.push(("master".into(), p.clone()));
        }
        out
    }

    /// Per-parameter (name, elements, steps), in order.
    pub fn param_steps(&self) -> Vec<(String, usize, u64)> {
        self.slots.iter().map(|s| (s.name.clone(), s.var.elem_count(), s.steps)).collect()
    }

    /// Replaces this rank's state: moments (and master weights, when kept) of its
    /// range, per-parameter step counts and the step counter. Checked by the caller.
    pub(super) fn set_state(
        &mut self,
        m: &Tensor,
        v: &Tensor,
        master: Option<&Tensor>,
        steps: &[u64],
        step: u64,
    ) -> Result<()> {
        let n = self.range().len();
        for (what, t) in [("exp_avg", Some(m)), ("exp_avg_sq", Some(v)), ("master", master)] {
            if let Some(t) = t {
                if t.dims() != [n] {
                    return Err(Error::invalid(format!(
                        "sharded adamw: `{what}` of {:?} elements for a range of {n}",
                        t.dims()
                    )));
                }
            }
        }
        self.m = m.to_device(&self.device)?.to_dtype(DType::F32)?.copy()?;
        self.v = v.to_device(&self.device)?.to_dtype(DType::F32)?.copy()?;
        if self.master.is_some() {
            self.master = Some(match master {
                Some(t) => t.to_device(&self.device)?.to_dtype(DType::F32)?.copy()?,
                None => self.own_weights()?,
            });
        }
        for (s, &k) in self.slots.iter_mut().zip(steps) {
            s.steps = k;
        }
        self.step = step;
        Ok(())
    }
}
