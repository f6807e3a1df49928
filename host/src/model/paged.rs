//! Decoding over a paged KV cache: keys and values live in one pool of
//! fixed-size blocks per layer, and each sequence reads its own through a
//! block table (vLLM's PagedAttention, Kwon et al. 2023; mistral.rs's
//! `paged_attention` module is the candle-based example this follows).
//!
//! One call ([`decode_paged`]) runs any mix of sequences, each with
//! any number of new tokens (a decode step adds one, a prefill chunk many):
//! the new tokens of all sequences are laid end to end as one row of `T`
//! positions, so the projections and the MLP run on exactly `T` positions
//! with no padding, and only attention looks at which sequence a token
//! belongs to. Each layer writes the new keys and values into their slots,
//! then attends over the sequence's slots up to the token's position:
//!
//! - on the CPU in f32/f64, [`super::paged_attention`] reads the pool in place
//!   through the block tables (online softmax, no copy of the cache);
//! - on CUDA in f32/bf16, `model::paged_cuda` (built with `--features cuda`) does the same in one kernel
//!   per layer (compiled by NVRTC at run time);
//! - elsewhere (other dtypes or devices, or `--kernels composed`), the
//!   composed path gathers each sequence's slots into a dense `(R, Hkv, S, D)`
//!   tensor, padded to the longest, and runs the existing attention
//!   ([`ops::attention_composed`]).
//!
//! The allocation of blocks (reference counts, copy on write) is the
//! caller's: see `rollout::blocks`.

use candle_core::{DType, Device, Tensor};

use super::config::Config;
use super::decode::{self, DecodeWeights, FusedLayer};
use super::layer::{mlp_block, o_proj, qkv, Layer};
use super::ops::Grad;
pub use super::paged_attention::PagedSeq;
use super::qwen3::Qwen3;
use super::{budget, fused, ops};
use crate::{Error, Result};

/// The key and value pools of every layer: `(blocks * block_size, Hkv, D)`
/// each, one slot per token, in the model's dtype and device.
pub struct PagedKvCache {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    block_size: usize,
    num_blocks: usize,
}

impl PagedKvCache {
    /// A pool of `num_blocks` blocks of `block_size` tokens for `model`, in
    /// its activation dtype.
    pub fn new(model: &Qwen3, num_blocks: usize, block_size: usize) -> Result<Self> {
        Self::with_dtype(model, num_blocks, block_size, None)
    }

    /// [`PagedKvCache::new`] with the pools in `dtype` (`None`: the model's
    /// activation dtype). A bf16 pool under an f32 model halves the cache's
    /// bytes (and the bytes attention reads per step); keys and values are
    /// rounded to bf16 as they are written, and attention widens them back.
    pub fn with_dtype(
        model: &Qwen3,
        num_blocks: usize,
        block_size: usize,
        dtype: Option<DType>,
    ) -> Result<Self> {
        let c = model.config();
        let dtype = Self::pool_dtype(model, dtype);
        let shape = (num_blocks * block_size, c.num_key_value_heads, c.head_dim);
        let mut k = Vec::with_capacity(c.num_hidden_layers);
        let mut v = Vec::with_capacity(c.num_hidden_layers);
        for _ in 0..c.num_hidden_layers {
            k.push(Tensor::zeros(shape, dtype, model.device())?);
            v.push(Tensor::zeros(shape, dtype, model.device())?);
        }
        Ok(Self { k, v, block_size, num_blocks })
    }

    /// The dtype of `model`'s pools when asked for `dtype` (`None`: its
    /// activation dtype).
    pub fn pool_dtype(model: &Qwen3, dtype: Option<DType>) -> DType {
        dtype.unwrap_or_else(|| model.activation_dtype())
    }

    /// Bytes one token takes in the cache of a model of `cfg` in `dtype`:
    /// keys and values of every layer.
    pub fn bytes_per_token(cfg: &Config, dtype: DType) -> usize {
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype.size_in_bytes()
    }

    /// Whether these pools can serve `model` with pools in `dtype` (`None`: its
    /// activation dtype): the same layers, key/value heads, head size, dtype and
    /// device. A pool kept from one generation to the next is used again only then.
    pub fn serves(&self, model: &Qwen3, dtype: Option<DType>) -> bool {
        let c = model.config();
        let want = (self.num_blocks * self.block_size, c.num_key_value_heads, c.head_dim);
        self.k.len() == c.num_hidden_layers
            && self.k.iter().chain(&self.v).all(|t| t.dims3().is_ok_and(|d| d == want))
            && self.dtype() == Self::pool_dtype(model, dtype)
            && self.k[0].device().same_device(model.device())
    }

    /// The pools' dtype.
    pub fn dtype(&self) -> DType {
        self.k[0].dtype()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Copies block `from` into block `to` in every layer (copy on write of a
    /// shared last block).
    pub fn copy_block(&self, from: u32, to: u32) -> Result<()> {
        let bs = self.block_size;
        for t in self.k.iter().chain(&self.v) {
            // A copy: a narrowed view shares the pool's storage, which slice_set refuses.
            let src = t.narrow(0, from as usize * bs, bs)?.copy()?;
            t.slice_set(&src, 0, to as usize * bs)?;
        }
        Ok(())
    }
}

/// Where every new token of a call sits: its sequence, position and slot.
pub(super) struct Layout {
    /// Per token: the index of its sequence in the call.
    pub row: Vec<u32>,
    /// Per token: its position in its sequence.
    pub pos: Vec<u32>,
    /// Per token: its slot in the pools.
    slot: Vec<u32>,
    /// Per sequence: the index of its last new token.
    last: Vec<u32>,
}

impl Layout {
    fn new(seqs: &[PagedSeq], block_size: usize, slots_in_pool: usize) -> Result<Self> {
        let t: usize = seqs.iter().map(|s| s.new).sum();
        let mut l = Layout {
            row: Vec::with_capacity(t),
            pos: Vec::with_capacity(t),
            slot: Vec::with_capacity(t),
            last: Vec::with_capacity(seqs.len()),
        };
        for (r, s) in seqs.iter().enumerate() {
            if s.new == 0 || s.new > s.len || s.blocks.len() * block_size < s.len {
                return Err(Error::invalid(format!(
                    "decode_paged: sequence {r} adds {} tokens to reach {} with {} blocks of {block_size}",
                    s.new,
                    s.len,
                    s.blocks.len()
                )));
            }
            for p in s.len - s.new..s.len {
                let slot = s.blocks[p / block_size] as usize * block_size + p % block_size;
                if slot >= slots_in_pool {
                    return Err(Error::invalid(format!(
                        "decode_paged: sequence {r} position {p} maps to slot {slot}, past the pool's {slots_in_pool}"
                    )));
                }
                l.row.push(r as u32);
                l.pos.push(p as u32);
                l.slot.push(slot as u32);
            }
            l.last.push(l.row.len() as u32 - 1);
        }
        Ok(l)
    }
}

/// Runs the new tokens of `seqs` (`tokens`: each sequence's new tokens, in
/// order, end to end) through `model`, writing their keys and values
/// into `cache`, and returns the logits at each sequence's last new
/// token, `(seqs, vocab)`. The slots of the new tokens must be free for
/// them (the caller's block tables say which).
///
/// With `weights` (`model`'s projections fused, [`DecodeWeights`]), the
/// layers run on the fused CPU kernels or the project's CUDA kernels with
/// two products fewer per layer (`fused_layer`); without them, or where
/// neither serves (`--kernels composed`, other dtypes), each projection runs
/// on its own.
pub fn decode_paged(
    model: &Qwen3,
    weights: Option<&DecodeWeights>,
    tokens: &[u32],
    seqs: &[PagedSeq],
    cache: &PagedKvCache,
) -> Result<Tensor> {
    if let Some(w) = weights {
        w.check(model)?;
    }
    let layout = Layout::new(seqs, cache.block_size, cache.num_blocks * cache.block_size)?;
    if tokens.len() != layout.row.len() {
        return Err(Error::invalid(format!(
            "decode_paged: {} tokens given for {} new positions",
            tokens.len(),
            layout.row.len()
        )));
    }
    let (t, dev) = (tokens.len(), model.device());
    let attn = PagedAttn::new(seqs, &layout, cache, model.activation_dtype(), dev)?;
    let shape = if attn.per_row { (t, 1) } else { (1, t) };
    let ids = Tensor::from_vec(tokens.to_vec(), shape, dev)?;
    let positions = Tensor::from_vec(layout.pos.clone(), shape, dev)?;
    let (cos, sin) = model.rotary(&positions)?;
    let mut x = model.embed(&ids)?;
    let before = budget::snapshot().launches;
    for (i, layer) in model.layers.iter().enumerate() {
        let pools = (&cache.k[i], &cache.v[i]);
        x = match weights.map(|w| &w.layers[i]).filter(|_| attn.kernels()) {
            Some(fused) => fused_layer(layer, fused, model.config(), &x, (&cos, &sin), pools, &attn)?,
            None => paged_layer(layer, model.config(), &x, (&cos, &sin), pools, &attn)?,
        };
    }
    budget::layers(model.layers.len(), budget::snapshot().launches - before);
    let last = Tensor::from_vec(layout.last.clone(), seqs.len(), dev)?;
    if weights.is_some() && attn.kernels() {
        // The final norm and the head by the kernels' ops, counted as on CUDA.
        let (norm, head) = model.head_weights();
        let h = decode::rms_norm(&x, &norm, model.config().rms_norm_eps)?;
        budget::launch(1); // the last tokens' rows
        let h = h.reshape((t, model.config().hidden_size))?.index_select(&last, 0)?;
        return decode::linear(&h, &head, None);
    }
    let h = model.final_norm(&x)?.reshape((t, model.config().hidden_size))?;
    budget::launch(1); // the last tokens' rows
    model.lm_head(&h.index_select(&last, 0)?, Grad::Off)
}

/// One decoder layer over the new tokens of a paged call, `(1, T, hidden)`
/// (or `(T, 1, hidden)`, see [`PagedAttn::per_row`]), each projection on its own.
fn paged_layer(
    layer: &Layer,
    cfg: &Config,
    x: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    (pool_k, pool_v): (&Tensor, &Tensor),
    attn: &PagedAttn,
) -> Result<Tensor> {
    let (q, k, v) = qkv(layer, cfg, x, cos, sin, Grad::Off)?;
    attn.write(pool_k, &k, true)?;
    attn.write(pool_v, &v, true)?;
    let o = attn.attend(&q, pool_k, pool_v, cfg.num_key_value_heads)?;
    budget::launch(1); // the residual add
    let x = (x + o_proj(layer, &o, Grad::Off)?)?;
    mlp_block(layer, cfg, &x, Grad::Off)
}

/// [`paged_layer`] over the fused projections of `fused`, on the fused CPU
/// kernels or the project's CUDA kernels (`model/cuda/*.cu`), as
/// [`decode`]'s ops choose by device: the input norm; one product over
/// `[Wq; Wk; Wv]`; the queries' norm + rope, and the keys' fused with the
/// write of keys and values into their slots, each reading its heads from
/// the product's rows in place; paged attention; the output projection; the
/// residual add fused with the MLP's norm; one product over `[Wgate; Wup]`;
/// SwiGLU over its rows; the down projection; the residual add. On CUDA
/// each of these is one kernel launch (a bias adds one to its product), and
/// the CPU counts the same ([`decode`], `model::budget`).
fn fused_layer(
    layer: &Layer,
    fused: &FusedLayer,
    cfg: &Config,
    x: &Tensor,
    rotary: (&Tensor, &Tensor),
    pools: (&Tensor, &Tensor),
    attn: &PagedAttn,
) -> Result<Tensor> {
    let eps = cfg.rms_norm_eps;
    let (nq, nkv, d) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
    let w = |v: &candle_core::Var| ops::weight(v, Grad::Off);
    let h = decode::rms_norm(x, &w(&layer.input_layernorm), eps)?;
    let qkv = decode::linear(&h, &fused.qkv, fused.qkv_bias.as_ref())?;
    let q = decode::norm_rope_rows(&qkv, 0, nq, &w(&layer.q_norm), rotary, eps)?;
    attn.write_kv_rows(&qkv, (nq * d, (nq + nkv) * d), (nkv, &w(&layer.k_norm), eps), rotary, pools)?;
    let o = attn.attend_kernel(&q, pools, nkv)?;
    let o_bias = layer.biases.as_ref().map(|bs| w(&bs[3]));
    let o = decode::linear(&o, &fused.o, o_bias.as_ref())?;
    let (x, h) = decode::add_rms_norm(x, &o, &w(&layer.post_attention_layernorm), eps)?;
    let gate_up = decode::linear(&h, &fused.gate_up, None)?;
    let a = decode::swiglu_rows(&gate_up, cfg.intermediate_size)?;
    let mlp = decode::linear(&a, &fused.down, None)?;
    budget::launch(1); // the residual add
    Ok((x + mlp)?)
}

/// What attention over the pools needs, built once per call and shared by
/// every layer.
struct PagedAttn<'a> {
    seqs: &'a [PagedSeq],
    layout: &'a Layout,
    block_size: usize,
    /// Runs of consecutive slots: `(first token, first slot, tokens)`.
    runs: Vec<(usize, usize, usize)>,
    /// Off the CPU, `(T)` the pool slot of each new token's key and value.
    token_slots: Option<Tensor>,
    /// Which attention serves the call.
    path: Attend,
    /// The call's tokens run as `T` rows of one position, `(T, 1, hidden)`,
    /// instead of one sequence of `T`, `(1, T, hidden)`: when every sequence
    /// adds one token (a decoding step) and the fused CPU kernels serve it.
    /// The projections then take their decoding kernels
    /// ([`super::fused::gemv`]: each weight row streamed once for all rows,
    /// each output one dot product in a fixed order, so a row's result does
    /// not depend on the others) instead of gemm, whose packing costs more
    /// than the product at decode shapes, and bf16 weights are read as bf16
    /// instead of widened whole every step (`stapo bench rollout` at the
    /// 0.6B shape: 1.25x the tokens/s in f32, 2.1x in bf16).
    per_row: bool,
}

/// The three ways attention reads the pools.
enum Attend {
    /// The fused CPU kernel, [`super::paged_attention`].
    Cpu,
    /// The CUDA kernel over the block tables, [`super::paged_cuda`].
    #[cfg(feature = "cuda")]
    Cuda(super::paged_cuda::Meta),
    /// The composed ops over gathered rows (other devices and dtypes, or `--kernels composed`).
    Composed(Gathers),
}

/// Index tensors and mask of the composed path: sequences padded to `l`
/// queries and `s` keys.
struct Gathers {
    /// `(R * s)` slots of each sequence's keys (padding reads slot 0).
    key_slots: Tensor,
    /// `(R * l)` token of each padded query (padding reads token 0).
    query_tokens: Tensor,
    /// `(T)` the padded query of each token.
    token_queries: Tensor,
    /// `(R, 1, l, s)` additive mask in the compute dtype.
    mask: Tensor,
    l: usize,
    s: usize,
}

impl<'a> PagedAttn<'a> {
    fn new(
        seqs: &'a [PagedSeq],
        layout: &'a Layout,
        cache: &PagedKvCache,
        dtype: DType,
        dev: &Device,
    ) -> Result<Self> {
        let mut runs: Vec<(usize, usize, usize)> = Vec::new();
        for (i, &slot) in layout.slot.iter().enumerate() {
            match runs.last_mut() {
                Some((t0, s0, n)) if *t0 + *n == i && *s0 + *n == slot as usize => *n += 1,
                _ => runs.push((i, slot as usize, 1)),
            }
        }
        let path = if fused::supported_on(dev, dtype) {
            Attend::Cpu
        } else {
            Self::device_path(seqs, layout, cache, dtype, dev)?
        };
        let token_slots = match path {
            Attend::Cpu => None,
            _ => Some(Tensor::from_slice(&layout.slot, layout.slot.len(), dev)?),
        };
        let per_row = matches!(path, Attend::Cpu) && layout.row.len() == seqs.len();
        Ok(Self { seqs, layout, block_size: cache.block_size, runs, token_slots, path, per_row })
    }

    /// Off the fused CPU path: the CUDA kernel where it serves the pools'
    /// dtype and head size (unless `--kernels composed` asks for the composed
    /// ops), else the composed gathers.
    fn device_path(
        seqs: &[PagedSeq],
        layout: &Layout,
        cache: &PagedKvCache,
        dtype: DType,
        dev: &Device,
    ) -> Result<Attend> {
        #[cfg(feature = "cuda")]
        if dev.is_cuda()
            && fused::Kernels::current() == fused::Kernels::Fused
            && super::paged_cuda::supports(dtype, cache.dtype(), cache.k[0].dim(2)?)
        {
            let tables: Vec<&[u32]> = seqs.iter().map(|s| s.blocks.as_slice()).collect();
            let meta =
                super::paged_cuda::Meta::new(&layout.row, &layout.pos, &tables, cache.block_size, dev)?;
            return Ok(Attend::Cuda(meta));
        }
        Ok(Attend::Composed(Gathers::new(seqs, layout, cache.block_size, dtype, dev)?))
    }

    /// Whether the fused CPU kernels or the project's CUDA kernels serve the
    /// call (then [`fused_layer`] runs it when the projections are fused).
    fn kernels(&self) -> bool {
        match self.path {
            Attend::Cpu => true,
            #[cfg(feature = "cuda")]
            Attend::Cuda(_) => true,
            Attend::Composed(_) => false,
        }
    }

    /// The keys' per-head norm + rope and the write of keys and values into
    /// their slots, keys and values read from the rows of one product over
    /// `[Wq; Wk; Wv]` `qkv` (`(1, T, S)`, per row `(T, 1, S)`) at columns
    /// `cols`: one kernel on CUDA; on the CPU the fused norm + rope and the
    /// writes of [`PagedAttn::write`], counted as the kernel.
    fn write_kv_rows(
        &self,
        qkv: &Tensor,
        cols: (usize, usize),
        (n_kv, w, eps): (usize, &Tensor, f64),
        (cos, sin): (&Tensor, &Tensor),
        (pool_k, pool_v): (&Tensor, &Tensor),
    ) -> Result<()> {
        let casts = budget::cast_of(w, qkv.dtype()) + budget::rotary_of(cos, qkv);
        budget::launch(1 + budget::copy_of(qkv) + casts);
        #[cfg(feature = "cuda")]
        if let (Attend::Cuda(_), Some(slots)) = (&self.path, self.token_slots.as_ref()) {
            return super::cuda_ops::norm_rope_write_kv_rows(
                qkv,
                cols,
                (n_kv, w, eps),
                (cos, sin),
                slots,
                (pool_k, pool_v),
            );
        }
        let (b, l, _) = qkv.dims3()?;
        let d = w.elem_count();
        let k = qkv.narrow(2, cols.0, n_kv * d)?;
        let k = fused::norm_rope(&k, n_kv, &w.to_dtype(qkv.dtype())?, (cos, sin), eps)?;
        let v = qkv.narrow(2, cols.1, n_kv * d)?.reshape((b, l, n_kv, d))?.transpose(1, 2)?;
        self.write(pool_k, &k, false)?;
        self.write(pool_v, &v, false)
    }

    /// [`PagedAttn::attend`] on the kernels ([`PagedAttn::kernels`]), counting
    /// on the CPU what the CUDA kernel's call launches (its own count on CUDA).
    fn attend_kernel(&self, q: &Tensor, (pool_k, pool_v): (&Tensor, &Tensor), n_kv: usize) -> Result<Tensor> {
        if matches!(self.path, Attend::Cpu) {
            // The queries' copy when strided, the kernel (as `paged_cuda` counts them).
            budget::launch(budget::copy_of(q) + 1);
        }
        self.attend(q, pool_k, pool_v, n_kv)
    }

    /// Writes the new tokens' keys (or values) `(1, Hkv, T, D)` (per row:
    /// `(T, Hkv, 1, D)`) into `pool`:
    /// one copy per run of consecutive slots on the CPU, and on other devices one
    /// scatter when the runs are many (a decode step has one per sequence, and a
    /// launch per run made a 256-row CUDA step launch-bound). `count`: add
    /// the launches to [`budget`] (not when the write stands in for a kernel
    /// that counts itself).
    fn write(&self, pool: &Tensor, new: &Tensor, count: bool) -> Result<()> {
        let launch = |n: usize| {
            if count {
                budget::launch(n)
            }
        };
        let rows = if self.per_row { new.squeeze(2)? } else { new.squeeze(0)?.transpose(0, 1)? };
        launch(budget::cast_of(&rows, pool.dtype()));
        let rows = rows.to_dtype(pool.dtype())?;
        launch(budget::copy_of(&rows));
        let rows = rows.contiguous()?; // (T, Hkv, D)
        if let Some(slots) = self.token_slots.as_ref().filter(|_| self.runs.len() > 1) {
            let idx = slots.reshape((rows.dim(0)?, 1, 1))?.broadcast_as(rows.shape())?;
            // The index's copy (a broadcast is strided), the scatter.
            launch(budget::copy_of(&idx) + 1);
            pool.scatter_set(&idx.contiguous()?, &rows, 0)?;
            return Ok(());
        }
        launch(self.runs.len());
        for &(t0, s0, n) in &self.runs {
            pool.slice_set(&rows.narrow(0, t0, n)?, 0, s0)?;
        }
        Ok(())
    }

    /// Attention of the new tokens' queries `(1, Hq, T, D)` over their
    /// sequences' slots; returns `(1, T, Hq * D)` (per row: from
    /// `(T, Hq, 1, D)` to `(T, 1, Hq * D)`).
    fn attend(&self, q: &Tensor, pool_k: &Tensor, pool_v: &Tensor, n_kv: usize) -> Result<Tensor> {
        let g = match &self.path {
            Attend::Cpu => {
                let tables = super::paged_attention::Tables {
                    seqs: self.seqs,
                    row: &self.layout.row,
                    pos: &self.layout.pos,
                    block_size: self.block_size,
                };
                if self.per_row {
                    let (t, nq, _, d) = q.dims4()?;
                    let o = super::paged_attention::attention(&q.transpose(0, 2)?, pool_k, pool_v, &tables)?;
                    return Ok(o.reshape((t, 1, nq * d))?);
                }
                return super::paged_attention::attention(q, pool_k, pool_v, &tables);
            }
            #[cfg(feature = "cuda")]
            Attend::Cuda(meta) => return meta.attention(q, pool_k, pool_v),
            Attend::Composed(g) => g,
        };
        let (_, nq, t, d) = q.dims4()?;
        let r = self.seqs.len();
        let (hkv, dk) = (pool_k.dim(1)?, pool_k.dim(2)?);
        let gather = |pool: &Tensor| -> Result<Tensor> {
            // The gather, and its cast to the queries' dtype.
            budget::launch(1 + budget::cast_of(pool, q.dtype()));
            let rows = pool.index_select(&g.key_slots, 0)?.to_dtype(q.dtype())?;
            Ok(rows.reshape((r, g.s, hkv, dk))?.transpose(1, 2)?)
        };
        let qt = q.squeeze(0)?.transpose(0, 1)?; // (T, Hq, D)
        budget::launch(budget::copy_of(&qt) + 1); // its copy, the queries' gather
        let qp =
            qt.contiguous()?.index_select(&g.query_tokens, 0)?.reshape((r, g.l, nq, d))?.transpose(1, 2)?;
        budget::launch(budget::copy_of(&qp));
        let o =
            ops::attention_composed(&qp.contiguous()?, &gather(pool_k)?, &gather(pool_v)?, &g.mask, n_kv)?;
        budget::launch(1); // the new tokens' rows
        let o = o.reshape((r * g.l, nq * d))?.index_select(&g.token_queries, 0)?;
        Ok(o.reshape((1, t, nq * d))?)
    }
}

impl Gathers {
    fn new(seqs: &[PagedSeq], layout: &Layout, bs: usize, dtype: DType, dev: &Device) -> Result<Self> {
        let r = seqs.len();
        let l = seqs.iter().map(|s| s.new).max().unwrap_or(1);
        let s = seqs.iter().map(|s| s.len).max().unwrap_or(1);
        let mut key_slots = vec![0u32; r * s];
        let mut query_tokens = vec![0u32; r * l];
        let mut mask = vec![ops::MASKED; r * l * s];
        let mut token_queries = Vec::with_capacity(layout.row.len());
        let mut first_token = 0usize;
        for (i, q) in seqs.iter().enumerate() {
            for p in 0..q.len {
                key_slots[i * s + p] = q.blocks[p / bs] * bs as u32 + (p % bs) as u32;
            }
            let ctx = q.len - q.new;
            for j in 0..l {
                // A padding query (j >= new) sees every real key: finite, unused.
                let sees = if j < q.new { ctx + j + 1 } else { q.len };
                mask[(i * l + j) * s..(i * l + j) * s + sees].fill(0.0);
                if j < q.new {
                    query_tokens[i * l + j] = (first_token + j) as u32;
                    token_queries.push((i * l + j) as u32);
                }
            }
            first_token += q.new;
        }
        let cd = ops::compute_dtype(dtype);
        Ok(Self {
            key_slots: Tensor::from_vec(key_slots, r * s, dev)?,
            query_tokens: Tensor::from_vec(query_tokens, r * l, dev)?,
            token_queries: Tensor::from_vec(token_queries, layout.row.len(), dev)?,
            mask: Tensor::from_vec(mask, (r, 1, l, s), dev)?.to_dtype(cd)?,
            l,
            s,
        })
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    use crate::model::fused::test_util::rel_err;
    use crate::model::{Kernels, TokenBatch};
    use crate::rollout::blocks::{BlockPool, BlockTable};

    /// A tiny f32 model: 2 layers, hidden 64, 4 query heads over 2 kv heads.
    fn tiny(seed: u64) -> Qwen3 {
        tiny_in(seed, DType::F32)
    }

    fn tiny_in(seed: u64, dtype: DType) -> Qwen3 {
        let cfg = Config::from_json_str(
            r#"{"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0,
                "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "tie_word_embeddings": true}"#,
            "tiny",
        )
        .expect("config");
        crate::model::init(&cfg, seed, 0.2, dtype, &Device::Cpu).expect("init")
    }

    /// The dense reference: the plain forward over the whole sequence, logits
    /// at its last position.
    fn reference(m: &Qwen3, ids: &[u32]) -> Tensor {
        let batch = TokenBatch::left_padded(&[ids.to_vec()], 0, &Device::Cpu).expect("batch");
        let h = m.forward_hidden(&batch, Grad::Off).expect("forward");
        let last = h.narrow(1, ids.len() - 1, 1).and_then(|t| t.squeeze(1)).expect("last");
        m.lm_head(&last, Grad::Off).expect("lm_head")
    }

    /// A sequence under test: its tokens so far and its block table.
    #[derive(Default)]
    struct Seq {
        ids: Vec<u32>,
        table: BlockTable,
    }

    /// One call adding `new[i]` to `seqs[i]` (blocks taken, a shared partial
    /// block copied on write), over the fused projections `w` when given;
    /// returns the logits `(seqs, vocab)`.
    fn feed(
        m: &Qwen3,
        w: Option<&DecodeWeights>,
        cache: &PagedKvCache,
        pool: &mut BlockPool,
        seqs: &mut [&mut Seq],
        new: &[Vec<u32>],
    ) -> Tensor {
        let mut paged = Vec::new();
        let mut tokens = Vec::new();
        for (s, add) in seqs.iter_mut().zip(new) {
            let a = s.table.append(pool, add.len()).expect("room");
            if let Some((from, to)) = a.copy {
                cache.copy_block(from, to).expect("copy");
            }
            s.ids.extend(add);
            tokens.extend(add);
            paged.push(PagedSeq { blocks: s.table.blocks().to_vec(), len: s.ids.len(), new: add.len() });
        }
        decode_paged(m, w, &tokens, &paged, cache).expect("decode_paged")
    }

    /// [`feed`], then checks every row's logits against the dense reference
    /// of the sequence so far.
    fn call(
        m: &Qwen3,
        w: Option<&DecodeWeights>,
        cache: &PagedKvCache,
        pool: &mut BlockPool,
        seqs: &mut [&mut Seq],
        new: &[Vec<u32>],
    ) {
        let logits = feed(m, w, cache, pool, seqs, new);
        for (r, s) in seqs.iter().enumerate() {
            let got = logits.narrow(0, r, 1).expect("row");
            let want = reference(m, &s.ids);
            let e = rel_err(&got, &want);
            let (k, fused) = (Kernels::current(), w.is_some());
            assert!(
                e < 1e-5,
                "{k:?} (fused projections {fused}): row {r} after {} tokens: error {e:e}",
                s.ids.len()
            );
        }
    }

    fn toks(seed: u32, n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| (seed * 31 + i * 17) % 97).collect()
    }

    /// Chunked prefill, decode, shared prompt blocks with copy on write, a
    /// freed sequence's blocks refilled by another, and a preempted sequence
    /// recomputed: every logits row equals the dense forward within 1e-5, on
    /// the fused kernel with and without the fused projections, and on the
    /// composed (gather) path.
    #[test]
    fn paged_decode_matches_the_dense_forward() {
        let m = tiny(3);
        let fw = DecodeWeights::new(&m).expect("fused projections");
        for (kernels, w) in [(Kernels::Fused, Some(&fw)), (Kernels::Fused, None), (Kernels::Composed, None)] {
            kernels.scope(|| {
                let cache = PagedKvCache::new(&m, 24, 4).expect("cache");
                let mut pool = BlockPool::new(24, 4).expect("pool");
                let (mut a, mut b) = (Seq::default(), Seq::default());
                let prompt_a = toks(1, 9);
                // A's prompt in two chunks; B's whole prompt with A's first chunk.
                call(&m, w, &cache, &mut pool, &mut [&mut a, &mut b], &[prompt_a[..5].to_vec(), toks(2, 3)]);
                call(&m, w, &cache, &mut pool, &mut [&mut a, &mut b], &[prompt_a[5..].to_vec(), vec![7]]);
                // Two samples of A share its blocks (the last one has 1 of 4 slots filled).
                let mut a1 = Seq { ids: a.ids.clone(), table: a.table.fork(&mut pool) };
                let mut a2 = Seq { ids: a.ids.clone(), table: a.table.fork(&mut pool) };
                a.table.release(&mut pool);
                for step in 0..6u32 {
                    let new = [vec![step + 40], vec![step + 60], vec![step + 80]];
                    call(&m, w, &cache, &mut pool, &mut [&mut a1, &mut a2, &mut b], &new);
                }
                assert_ne!(a1.table.blocks()[2], a2.table.blocks()[2], "the shared partial block was copied");
                assert_eq!(a1.table.blocks()[..2], a2.table.blocks()[..2], "full prompt blocks stay shared");
                // B ends; C reuses its blocks (stale keys and values in them).
                let freed = b.table.blocks().to_vec();
                b.table.release(&mut pool);
                let mut c = Seq::default();
                call(
                    &m,
                    w,
                    &cache,
                    &mut pool,
                    &mut [&mut a1, &mut c, &mut a2],
                    &[vec![5], toks(3, 11), vec![6]],
                );
                assert!(c.table.blocks().iter().any(|blk| freed.contains(blk)), "C refilled B's blocks");
                // A2 preempted and recomputed: all its tokens again, in one chunk.
                a2.table.release(&mut pool);
                let ids = std::mem::take(&mut a2.ids);
                call(&m, w, &cache, &mut pool, &mut [&mut c, &mut a2, &mut a1], &[vec![9], ids, vec![3]]);
            });
        }
    }

    /// A decoding step's rows are independent on the fused CPU path: a
    /// sequence's logits are the same bits whether it decodes alone or beside
    /// other sequences (each step runs as rows of one position, whose
    /// projections compute every output as one dot product in a fixed
    /// order), with f32 and with bf16 weights; and they match the dense
    /// forward. A step that mixes a prompt chunk into the call runs as one
    /// sequence of tokens (gemm), and matches the dense forward too.
    #[test]
    fn a_decoding_rows_logits_do_not_depend_on_the_other_rows() {
        for dtype in [DType::F32, DType::BF16] {
            let m = tiny_in(7, dtype);
            let fw = DecodeWeights::new(&m).expect("fused projections");
            let w = Some(&fw);
            let cache = PagedKvCache::new(&m, 32, 4).expect("cache");
            let mut pool = BlockPool::new(32, 4).expect("pool");
            let (mut a, mut b, mut c) = (Seq::default(), Seq::default(), Seq::default());
            feed(
                &m,
                w,
                &cache,
                &mut pool,
                &mut [&mut a, &mut b, &mut c],
                &[toks(1, 6), toks(2, 9), toks(3, 3)],
            );
            // Room for one more token each, then the same step three ways:
            // A alone, A between B and C, and A beside C's next prompt chunk.
            let mut next = |s: &mut Seq, t: u32| {
                s.table.append(&mut pool, 1).expect("room");
                s.ids.push(t);
                PagedSeq { blocks: s.table.blocks().to_vec(), len: s.ids.len(), new: 1 }
            };
            let (pa, pb, pc) = (next(&mut a, 11), next(&mut b, 12), next(&mut c, 13));
            let bits = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("logits");
            // Each projection on its own first (it writes the same keys and values).
            let unfused = decode_paged(&m, None, &[11], std::slice::from_ref(&pa), &cache).expect("unfused");
            let alone = decode_paged(&m, w, &[11], std::slice::from_ref(&pa), &cache).expect("alone");
            assert_eq!(bits(&alone), bits(&unfused), "{dtype:?}: fused projections moved A's logits");
            let among = decode_paged(&m, w, &[12, 11, 13], &[pb, pa.clone(), pc], &cache).expect("among");
            let row = |t: &Tensor, r: usize| t.narrow(0, r, 1).expect("row");
            assert_eq!(
                bits(&alone),
                bits(&row(&among, 1)),
                "{dtype:?}: A's logits moved with its neighbours"
            );
            let want = reference(&m, &a.ids).to_dtype(DType::F32).expect("f32");
            let e = rel_err(&alone.to_dtype(DType::F32).expect("f32"), &want);
            assert!(e < if dtype == DType::F32 { 1e-5 } else { 2e-2 }, "{dtype:?}: error {e:e}");
            let chunk = PagedSeq { new: 2, ..next(&mut c, 14) };
            let mixed = decode_paged(&m, w, &[11, 13, 14], &[pa, chunk], &cache).expect("mixed");
            let e = rel_err(&row(&mixed, 0).to_dtype(DType::F32).expect("f32"), &want);
            assert!(e < if dtype == DType::F32 { 1e-5 } else { 2e-2 }, "{dtype:?}: mixed call, error {e:e}");
        }
    }

    /// The budget of a decode step on the composed path (what CUDA runs
    /// without the project's kernels), counted on the CPU: three rows of
    /// the tiny f32 model (hidden 64, 4 query heads over 2 kv heads of 16)
    /// add one token each, over contexts of 7, 10 and 4 tokens in their own
    /// blocks. Per layer, by the counting rule of `model::budget`:
    ///
    /// - input RMSNorm: sqr, sum, scale, + eps, sqrt, div, mul = 7;
    /// - q, k, v projections: one matmul each = 3;
    /// - q and k norm + rope: RMSNorm 7, rope 4 products + sub + add + the
    ///   concatenation's 2 copies = 8; 15 each, 30;
    /// - writing K: `(1, Hkv, T, D)` to `(T, Hkv, D)` is strided: a copy, the
    ///   slot index's copy (a broadcast), the scatter = 3; V arrives as
    ///   `(T, Hkv, D)` contiguous: index copy and scatter = 2; 5;
    /// - attention: the queries' copy to `(T, Hq, D)` and their gather = 2;
    ///   K's and V's gathers = 2; the gathered K and V transposed to
    ///   `(R, Hkv, S, D)` are strided, a copy each = 2; q K^T, the scale, the
    ///   mask's add, softmax (max, sub, exp, sum, div) = 5, P V: 4 + 5 = 9;
    ///   the new tokens' rows = 1; 16;
    /// - the residual add, o projection = 2;
    /// - MLP: RMSNorm 7, gate and up 2, SwiGLU (silu, mul) 2, down 1, the
    ///   residual add 1 = 13.
    ///
    /// 7 + 3 + 30 + 5 + 16 + 2 + 13 = 76 per layer. Outside the layers: the
    /// embedding's gather 1, rotary tables (the positions' cast, a product,
    /// cos, sin) 4, the final RMSNorm 7, the last tokens' rows 1, the LM head 1 =
    /// 14; 2 x 76 + 14 = 166 a step. The device sampler at temperature 1
    /// copies to the host the per-block masses, the sums, the sums of e * d,
    /// the argmaxes and each row's chosen block: 5 copies a step.
    #[test]
    fn a_composed_decode_step_launches_a_hand_counted_number_of_kernels() {
        use crate::model::budget;
        use crate::rollout::device::Blocked;
        use crate::rollout::Sampler;
        use rand::SeedableRng;
        let m = tiny_in(3, DType::F32);
        Kernels::Composed.scope(|| {
            let cache = PagedKvCache::new(&m, 32, 4).expect("cache");
            let mut pool = BlockPool::new(32, 4).expect("pool");
            let (mut a, mut b, mut c) = (Seq::default(), Seq::default(), Seq::default());
            feed(
                &m,
                None,
                &cache,
                &mut pool,
                &mut [&mut a, &mut b, &mut c],
                &[toks(1, 6), toks(2, 9), toks(3, 3)],
            );
            let before = budget::snapshot();
            let logits = feed(
                &m,
                None,
                &cache,
                &mut pool,
                &mut [&mut a, &mut b, &mut c],
                &[vec![5], vec![6], vec![7]],
            );
            let sampler =
                Sampler::new(&crate::rollout::SamplingParams { temperature: 1.0, ..Default::default() });
            let blocked = Blocked::new(&logits, &sampler).expect("device pass");
            let mut rngs: Vec<rand::rngs::StdRng> = (0..3).map(rand::rngs::StdRng::seed_from_u64).collect();
            let rows = rngs.iter_mut().enumerate().collect();
            blocked.draw(&sampler, rows).expect("draw");
            let d = budget::snapshot().since(&before);
            assert_eq!(d.layers, 2);
            assert_eq!(d.layer_launches, 2 * 76, "launches in the layers");
            assert_eq!(d.launches, 2 * 76 + 14, "launches of the step");
            assert_eq!(d.host_copies, 5, "copies to the host");
        });
    }

    /// The budget of a decode step on the kernels' path over the fused
    /// projections (what CUDA runs with the project's kernels), counted on
    /// the CPU, where the same layer ([`fused_layer`]) runs the fused CPU
    /// kernels in their place and counts the launches of the CUDA ones
    /// (`model::decode`): three rows of the tiny f32 model add one token each.
    /// Per layer, by hand: the input norm 1, the product over `[Wq; Wk; Wv]`
    /// 1, the queries' norm + rope 1, the keys' norm + rope with the write of
    /// keys and values 1, paged attention 1, the output projection 1, the
    /// residual add with the MLP's norm 1, the product over `[Wgate; Wup]` 1,
    /// SwiGLU 1, the down projection 1, the residual add 1: 11 (the goal is
    /// at most 12). Outside the layers: the embedding 1, the rotary tables 4,
    /// the final norm 1, the last tokens' rows 1, the LM head 1: 8;
    /// 2 x 11 + 8 = 30 a step. The model call copies nothing to the host,
    /// the step's draws copy once (here the logits' read; on CUDA the four
    /// numbers per row of the sampling kernel, `cuda_ops::sample`). The
    /// logits match the dense forward and are the same bits as the step
    /// with each projection on its own, which draws the same tokens.
    #[test]
    fn a_kernel_decode_step_launches_at_most_12_kernels_per_layer_and_copies_once() {
        use crate::model::budget;
        use crate::rollout::device::StepLogits;
        use crate::rollout::{Sampler, SamplingParams};
        use rand::SeedableRng;
        let m = tiny_in(3, DType::F32);
        let fw = DecodeWeights::new(&m).expect("fused projections");
        let sampler = Sampler::new(&SamplingParams { temperature: 1.0, ..Default::default() });
        let run = |w: Option<&DecodeWeights>| {
            let cache = PagedKvCache::new(&m, 32, 4).expect("cache");
            let mut pool = BlockPool::new(32, 4).expect("pool");
            let (mut a, mut b, mut c) = (Seq::default(), Seq::default(), Seq::default());
            let prompts = [toks(1, 6), toks(2, 9), toks(3, 3)];
            feed(&m, w, &cache, &mut pool, &mut [&mut a, &mut b, &mut c], &prompts);
            let before = budget::snapshot();
            let next = [vec![5], vec![6], vec![7]];
            let logits = feed(&m, w, &cache, &mut pool, &mut [&mut a, &mut b, &mut c], &next);
            let call = budget::snapshot().since(&before);
            let step = StepLogits::new(&logits, &sampler).expect("step logits");
            let mut rngs: Vec<rand::rngs::StdRng> = (0..3).map(rand::rngs::StdRng::seed_from_u64).collect();
            let draws = step.draw(&sampler, rngs.iter_mut().enumerate().collect()).expect("draw");
            let ids: Vec<u32> = draws.iter().map(|d| d.id).collect();
            let logps: Vec<f32> = draws.iter().map(|d| d.logprob).collect();
            let seqs = [a.ids, b.ids, c.ids];
            (logits, call, budget::snapshot().since(&before), ids, logps, seqs)
        };
        let (logits, call, step, ids, logps, seqs) = Kernels::Fused.scope(|| run(Some(&fw)));
        assert_eq!(step.layers, 2);
        assert_eq!(step.layer_launches, 2 * 11, "launches in the layers");
        assert!(step.launches_per_layer() <= 12.0);
        assert_eq!(step.launches, 2 * 11 + 8, "launches of the step");
        assert_eq!(call.host_copies, 0, "copies to the host in the model call");
        assert_eq!(step.host_copies, 1, "copies to the host in the step");
        for (r, ids) in seqs.iter().enumerate() {
            let e = rel_err(&logits.narrow(0, r, 1).expect("row"), &reference(&m, ids));
            assert!(e < 1e-5, "row {r}: error {e:e} against the dense forward");
        }
        let (unfused, _, _, ids_unfused, logps_unfused, _) = Kernels::Fused.scope(|| run(None));
        let bits = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("logits");
        assert_eq!(bits(&logits), bits(&unfused), "fused projections moved the logits");
        assert_eq!(ids, ids_unfused, "fused projections drew other tokens");
        assert_eq!(logps, logps_unfused);
    }

    /// The fused projections of a model with LoRA adapters on every
    /// projection (merged into the stacked copies, `W + scale B A`): the
    /// logits of a prefill and of decode steps match each projection on its
    /// own with its adapter term within 1e-5. Copies built before the
    /// adapters change are stale, and copies built after match again: why a
    /// generation builds its own.
    #[test]
    fn fused_projections_hold_merged_adapters() {
        use crate::model::fused::test_util::randn;
        use crate::model::LoraConfig;
        let mut adapted = tiny(12);
        adapted.add_lora(&LoraConfig::new(3), 5).expect("lora");
        let randomize = |m: &Qwen3, seed: u64| {
            for (k, (_, v)) in m.lora_params().iter().enumerate() {
                let r = randn(v.dims(), v.dtype(), seed + k as u64);
                v.set(&(r.as_tensor() * 0.3).expect("scale")).expect("set");
            }
        };
        randomize(&adapted, 100);
        // Logits of a prefill of two sequences and three decode steps.
        let run = |m: &Qwen3, w: Option<&DecodeWeights>| {
            Kernels::Fused.scope(|| {
                let cache = PagedKvCache::new(m, 16, 4).expect("cache");
                let mut pool = BlockPool::new(16, 4).expect("pool");
                let (mut a, mut b) = (Seq::default(), Seq::default());
                let prompts = [toks(1, 7), toks(2, 4)];
                let mut out = vec![feed(m, w, &cache, &mut pool, &mut [&mut a, &mut b], &prompts)];
                for t in 0..3u32 {
                    let next = [vec![t + 3], vec![t + 9]];
                    out.push(feed(m, w, &cache, &mut pool, &mut [&mut a, &mut b], &next));
                }
                out
            })
        };
        let worst =
            |x: &[Tensor], y: &[Tensor]| x.iter().zip(y).map(|(x, y)| rel_err(x, y)).fold(0f64, f64::max);
        let fw = DecodeWeights::new(&adapted).expect("fused projections");
        let e = worst(&run(&adapted, Some(&fw)), &run(&adapted, None));
        assert!(e < 1e-5, "fused against separate projections with adapters: {e:e}");
        let stale = DecodeWeights::new(&adapted).expect("fused projections");
        randomize(&adapted, 200);
        let separate = run(&adapted, None);
        let e = worst(&run(&adapted, Some(&stale)), &separate);
        assert!(e > 1e-3, "copies built before the adapters changed should differ: {e:e}");
        let fresh = DecodeWeights::new(&adapted).expect("fused projections");
        let e = worst(&run(&adapted, Some(&fresh)), &separate);
        assert!(e < 1e-5, "copies built after the change: {e:e}");
    }

    /// A bf16 cache under an f32 model (`kv_cache_dtype = "bfloat16"`): the
    /// pools hold the keys and values rounded to bf16, and the fused kernel
    /// (widening them) equals the composed path over the same pools (which
    /// converts its gathers) within 1e-5, prefill and decode, shared blocks
    /// included; against the dense f32 forward the rounding moves logits by
    /// well under 1e-2 (relative).
    #[test]
    fn a_bf16_cache_reads_its_rounded_values() {
        let m = tiny(5);
        let fw = DecodeWeights::new(&m).expect("fused projections");
        let run = |kernels: Kernels| {
            let w = (kernels == Kernels::Fused).then_some(&fw);
            kernels.scope(|| {
                let cache = PagedKvCache::with_dtype(&m, 16, 4, Some(DType::BF16)).expect("cache");
                assert_eq!(cache.dtype(), DType::BF16);
                let mut pool = BlockPool::new(16, 4).expect("pool");
                let (mut a, mut b) = (Seq::default(), Seq::default());
                let mut out = Vec::new();
                let mut step = |pool: &mut BlockPool, seqs: &mut [&mut Seq], new: &[Vec<u32>]| {
                    let logits = feed(&m, w, &cache, pool, seqs, new);
                    for (r, s) in seqs.iter().enumerate() {
                        out.push((logits.narrow(0, r, 1).expect("row"), reference(&m, &s.ids)));
                    }
                };
                step(&mut pool, &mut [&mut a, &mut b], &[toks(1, 9), toks(2, 6)]);
                let mut a2 = Seq { ids: a.ids.clone(), table: a.table.fork(&mut pool) };
                for t in 0..5u32 {
                    let new = [vec![t + 10], vec![t + 20], vec![t + 30]];
                    step(&mut pool, &mut [&mut a, &mut a2, &mut b], &new);
                }
                out
            })
        };
        let (fused, composed) = (run(Kernels::Fused), run(Kernels::Composed));
        let mut worst_dense = 0f64;
        for ((f, dense), (c, _)) in fused.iter().zip(&composed) {
            let e = rel_err(f, c);
            assert!(e < 1e-5, "fused vs composed over the same bf16 pools: {e:e}");
            worst_dense = worst_dense.max(rel_err(f, dense));
        }
        assert!(worst_dense > 0.0, "the bf16 cache rounds something");
        assert!(worst_dense < 1e-2, "bf16 rounding of the cache moved logits by {worst_dense:e}");
    }

    #[test]
    fn bad_calls_are_errors() {
        let m = tiny(4);
        let cache = PagedKvCache::new(&m, 2, 4).expect("cache");
        let seq = |blocks: Vec<u32>, len, new| PagedSeq { blocks, len, new };
        let ok = decode_paged(&m, None, &[1, 2], &[seq(vec![0], 2, 2)], &cache).expect("a valid call");
        assert_eq!(ok.dims(), &[1, 97]);
        for (s, what) in [
            (seq(vec![0], 5, 2), "1 blocks of 4"),
            (seq(vec![0], 2, 0), "adds 0 tokens"),
            (seq(vec![7], 2, 2), "past the pool"),
        ] {
            let err = decode_paged(&m, None, &[1, 2], &[s], &cache).expect_err(what).to_string();
            assert!(err.contains(what), "{err}");
        }
        let err = decode_paged(&m, None, &[1], &[seq(vec![0], 2, 2)], &cache).expect_err("count").to_string();
        assert!(err.contains("1 tokens given for 2"), "{err}");
    }
}
