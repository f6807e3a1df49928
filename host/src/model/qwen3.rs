//! A differentiable Qwen3 causal language model on the Hugging Face tensor names.
//!
//! Follows `transformers/models/qwen3/modeling_qwen3.py` (eager attention):
//! pre-norm decoder layers with grouped-query attention, per-head RMSNorm on q
//! and k, rotary position embeddings (rotate-half form), SwiGLU MLP, final
//! RMSNorm, and an LM head that may be tied to the embedding.
//!
//! Unlike candle-transformers' Qwen3 (inference only: its rms_norm, softmax,
//! rope and KV cache have no backward), every op here has a gradient, the
//! forward takes an attention mask (left padding) and position ids, and it
//! returns hidden states for every position. The KV cache lives outside the
//! weights ([`KvCache`]) so one model serves many batches of sequences.
//!
//! Parameters are candle [`Var`]s so the optimizer can update them in place.
//! A forward with `Grad::Track` records the graph for backprop; `Grad::Off`
//! uses detached views of the same storage, so inference keeps no graph alive.

use candle_core::{DType, Device, Tensor, Var};
use rand::SeedableRng;

use super::config::Config;
use super::head::TokenStats;
use super::layer::{Layer, LayerCtx};
use super::lora::{Adapter, LayerLora, LoraConfig, Target};
pub use super::ops::Grad;
use super::ops::{self, weight};
use super::options::ModelOptions;
use super::recompute::{Recompute, RecomputeCell};
use crate::{Error, Result};

/// Keys and values of the positions seen so far, for incremental decoding:
/// the dense cache, one tensor per layer reserved for `capacity` positions.
/// Rollouts use the paged cache ([`super::paged`]); this one serves
/// [`Qwen3::decode`], the dense path the paged one is tested against.
///
/// Preallocated per layer as `(B, H_kv, capacity, D)`; `len` positions are
/// filled. `key_bias` holds the additive mask over cached keys (0 for a real
/// token, a large negative number for left padding), `next_pos` each row's
/// next position id.
pub struct KvCache {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    len: usize,
    capacity: usize,
    batch: usize,
    key_bias: Vec<f32>,
    next_pos: Vec<u32>,
}

impl KvCache {
    /// An empty cache for `batch` sequences of up to `capacity` positions.
    pub fn new(model: &Qwen3, batch: usize, capacity: usize) -> Result<Self> {
        let c = &model.cfg;
        let shape = (batch, c.num_key_value_heads, capacity, c.head_dim);
        let mut k = Vec::with_capacity(c.num_hidden_layers);
        let mut v = Vec::with_capacity(c.num_hidden_layers);
        for _ in 0..c.num_hidden_layers {
            k.push(Tensor::zeros(shape, model.activation_dtype(), &model.device)?);
            v.push(Tensor::zeros(shape, model.activation_dtype(), &model.device)?);
        }
        Ok(Self {
            k,
            v,
            len: 0,
            capacity,
            batch,
            key_bias: vec![ops::MASKED; batch * capacity],
            next_pos: vec![0; batch],
        })
    }

    /// Number of positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no position has been added.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Maximum number of positions.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Number of sequences.
    pub fn batch(&self) -> usize {
        self.batch
    }
}

/// A batch of token rows, left-padded to one length, with the attention mask
/// and position ids Hugging Face would use (`cumsum(mask) - 1`, 0 on padding).
#[derive(Debug, Clone)]
pub struct TokenBatch {
    /// `(B, L)` u32 token ids.
    pub ids: Tensor,
    /// `(B, L)` 1 for real tokens, 0 for padding (host copy).
    pub mask: Vec<Vec<u8>>,
    /// `(B, L)` u32 position ids.
    pub positions: Tensor,
}

impl TokenBatch {
    /// Left-pads `rows` with `pad_id` to the longest row.
    pub fn left_padded(rows: &[Vec<u32>], pad_id: u32, device: &Device) -> Result<Self> {
        let len = rows.iter().map(Vec::len).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(rows.len() * len);
        let mut mask = Vec::with_capacity(rows.len());
        for r in rows {
            let pad = len - r.len();
            ids.extend(std::iter::repeat_n(pad_id, pad).chain(r.iter().copied()));
            mask.push(std::iter::repeat_n(0u8, pad).chain(std::iter::repeat_n(1u8, r.len())).collect());
        }
        Self::from_parts(ids, mask, device)
    }

    /// Builds a batch from flat ids and a per-row mask (any padding layout).
    pub fn from_parts(ids: Vec<u32>, mask: Vec<Vec<u8>>, device: &Device) -> Result<Self> {
        let b = mask.len();
        let l = mask.first().map_or(0, Vec::len);
        if ids.len() != b * l || mask.iter().any(|m| m.len() != l) {
            return Err(Error::invalid(format!(
                "token batch: {} ids do not fill {b} rows of {l}",
                ids.len()
            )));
        }
        let positions: Vec<u32> = mask
            .iter()
            .flat_map(|m| {
                let mut c = 0u32;
                m.iter()
                    .map(move |&x| {
                        c += x as u32;
                        c.saturating_sub(1)
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        Ok(Self {
            ids: Tensor::from_vec(ids, (b, l), device)?,
            positions: Tensor::from_vec(positions, (b, l), device)?,
            mask,
        })
    }

    /// `(batch, length)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.mask.len(), self.mask.first().map_or(0, Vec::len))
    }
}

/// The Qwen3 model: configuration, parameters, device and compute dtype.
pub struct Qwen3 {
    cfg: Config,
    dtype: DType,
    device: Device,
    embed_tokens: Var,
    pub(super) layers: Vec<Layer>,
    norm: Var,
    /// `None` when the LM head is tied to the embedding.
    lm_head: Option<Var>,
    inv_freq: Tensor,
    /// When decoder layers are recomputed in the backward pass.
    recompute: RecomputeCell,
    /// The settings of the LoRA adapters the layers carry (`None`: none).
    pub(super) lora: Option<LoraConfig>,
}

/// Where the model reads its named weights from when it is built.
pub trait WeightSource {
    /// The tensor called `name`, with exactly `shape`, in the model dtype and device.
    fn get(&mut self, name: &str, shape: &[usize]) -> Result<Tensor>;
    /// True if the source has a tensor called `name`.
    fn contains(&self, name: &str) -> bool;
}

impl Qwen3 {
    /// Builds the model, taking every weight from `src` by its Hugging Face name.
    pub fn new(cfg: &Config, src: &mut dyn WeightSource, dtype: DType, device: &Device) -> Result<Self> {
        cfg.validate("config")?;
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let (q_dim, kv_dim, d) =
            (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.head_dim);
        let mut var = |name: &str, shape: &[usize]| -> Result<Var> {
            let t = src.get(name, shape)?;
            Ok(Var::from_tensor(&t.to_dtype(dtype)?.to_device(device)?)?)
        };
        let embed_tokens = var("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            let biases = if cfg.attention_bias {
                Some([
                    var(&p("self_attn.q_proj.bias"), &[q_dim])?,
                    var(&p("self_attn.k_proj.bias"), &[kv_dim])?,
                    var(&p("self_attn.v_proj.bias"), &[kv_dim])?,
                    var(&p("self_attn.o_proj.bias"), &[h])?,
                ])
            } else {
                None
            };
            layers.push(Layer {
                q_proj: var(&p("self_attn.q_proj.weight"), &[q_dim, h])?,
                k_proj: var(&p("self_attn.k_proj.weight"), &[kv_dim, h])?,
                v_proj: var(&p("self_attn.v_proj.weight"), &[kv_dim, h])?,
                o_proj: var(&p("self_attn.o_proj.weight"), &[h, q_dim])?,
                biases,
                q_norm: var(&p("self_attn.q_norm.weight"), &[d])?,
                k_norm: var(&p("self_attn.k_norm.weight"), &[d])?,
                input_layernorm: var(&p("input_layernorm.weight"), &[h])?,
                post_attention_layernorm: var(&p("post_attention_layernorm.weight"), &[h])?,
                gate_proj: var(&p("mlp.gate_proj.weight"), &[i, h])?,
                up_proj: var(&p("mlp.up_proj.weight"), &[i, h])?,
                down_proj: var(&p("mlp.down_proj.weight"), &[h, i])?,
                lora: Default::default(),
            });
        }
        let norm = var("model.norm.weight", &[h])?;
        let lm_head =
            if cfg.tie_word_embeddings { None } else { Some(var("lm_head.weight", &[cfg.vocab_size, h])?) };
        // inv_freq_j = theta^(-2j/D), as HF's default rope init (computed in f32 there).
        let inv_freq: Vec<f32> =
            (0..d / 2).map(|j| (1.0 / cfg.rope_theta.powf((2 * j) as f64 / d as f64)) as f32).collect();
        let inv_freq = Tensor::from_vec(inv_freq, (1, 1, d / 2), device)?;
        Ok(Self {
            cfg: cfg.clone(),
            dtype,
            device: device.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
            inv_freq,
            recompute: RecomputeCell::new(ModelOptions::process_default().recompute),
            lora: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The compute dtype of the weights.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The dtype of the activations (and of the KV cache): the weights' dtype,
    /// except bf16 weights on the CPU under the fused kernels, which run with
    /// f32 activations (the projections read the bf16 weights and accumulate
    /// in f32, see [`super::fused::simd`]; norms, rotary, attention and the
    /// sampling statistics run in f32).
    pub fn activation_dtype(&self) -> DType {
        if self.dtype == DType::BF16 && super::fused::supported_on(&self.device, DType::F32) {
            DType::F32
        } else {
            self.dtype
        }
    }

    /// The device holding the weights.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// When decoder layers are recomputed in the backward pass (activation
    /// checkpointing; see [`super::recompute`]).
    pub fn recompute(&self) -> Recompute {
        self.recompute.get()
    }

    /// Sets when decoder layers are recomputed in the backward pass; gradients
    /// are the same either way, memory and time are not.
    pub fn set_recompute(&self, r: Recompute) {
        self.recompute.set(r)
    }

    /// Every trainable parameter with its Hugging Face name, in a fixed order.
    pub fn params(&self) -> Vec<(String, Var)> {
        let mut out = vec![("model.embed_tokens.weight".to_string(), self.embed_tokens.clone())];
        for (l, layer) in self.layers.iter().enumerate() {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            let mut push = |name: &str, v: &Var| out.push((p(name), v.clone()));
            push("self_attn.q_proj.weight", &layer.q_proj);
            push("self_attn.k_proj.weight", &layer.k_proj);
            push("self_attn.v_proj.weight", &layer.v_proj);
            push("self_attn.o_proj.weight", &layer.o_proj);
            if let Some([qb, kb, vb, ob]) = &layer.biases {
                push("self_attn.q_proj.bias", qb);
                push("self_attn.k_proj.bias", kb);
                push("self_attn.v_proj.bias", vb);
                push("self_attn.o_proj.bias", ob);
            }
            push("self_attn.q_norm.weight", &layer.q_norm);
            push("self_attn.k_norm.weight", &layer.k_norm);
            push("input_layernorm.weight", &layer.input_layernorm);
            push("post_attention_layernorm.weight", &layer.post_attention_layernorm);
            push("mlp.gate_proj.weight", &layer.gate_proj);
            push("mlp.up_proj.weight", &layer.up_proj);
            push("mlp.down_proj.weight", &layer.down_proj);
        }
        out.push(("model.norm.weight".to_string(), self.norm.clone()));
        if let Some(head) = &self.lm_head {
            out.push(("lm_head.weight".to_string(), head.clone()));
        }
        out
    }

    /// Hidden states after the final norm, `(B, L, hidden)`, for a whole batch
    /// (training and scoring). Padding positions produce finite garbage that
    /// callers mask out.
    pub fn forward_hidden(&self, batch: &TokenBatch, grad: Grad) -> Result<Tensor> {
        self.forward_hidden_from(batch, 0, grad)
    }

    /// [`Qwen3::forward_hidden`] at positions `from..L` only, `(B, L - from,
    /// hidden)`: what an update's head reads (from the last prompt position
    /// on). The last decoder layer computes its queries, attention output
    /// and MLP at those positions alone (keys and values at every one), so
    /// the prompt's share of that layer is skipped; the values equal the
    /// whole forward's, narrowed.
    pub fn forward_hidden_from(&self, batch: &TokenBatch, from: usize, grad: Grad) -> Result<Tensor> {
        let (b, l) = batch.dims();
        if from >= l {
            return Err(Error::invalid(format!("forward: output from position {from} of {l}")));
        }
        let pad_bias: Vec<f32> = batch
            .mask
            .iter()
            .flat_map(|m| m.iter().map(|&x| if x == 1 { 0.0 } else { ops::MASKED }))
            .collect();
        let pad_bias = Tensor::from_vec(pad_bias, (b, 1, 1, batch.dims().1), &self.device)?;
        self.run(&batch.ids, &batch.positions, &pad_bias, (0, None), from, grad)
    }

    /// Logits for every position, `(B, L, vocab)`, with the graph recorded.
    pub fn forward(&self, batch: &TokenBatch) -> Result<Tensor> {
        let h = self.forward_hidden(batch, Grad::Track)?;
        self.lm_head(&h, Grad::Track)
    }

    /// Projects hidden states `(.., hidden)` to vocabulary logits `(.., vocab)`.
    pub fn lm_head(&self, hidden: &Tensor, grad: Grad) -> Result<Tensor> {
        let w = self.w(self.lm_head.as_ref().unwrap_or(&self.embed_tokens), self.base_grad(grad));
        ops::linear(hidden, &w, None)
    }

    /// Log-prob of `targets`, entropy and collision probability at every
    /// position of `hidden` (`(.., hidden)`, targets shaped like it without the
    /// last dimension), through the LM head without materialising the
    /// `(.., vocab)` logits (see [`super::head`]).
    pub fn token_stats(&self, hidden: &Tensor, targets: &Tensor, grad: Grad) -> Result<TokenStats> {
        let w = self.w(self.lm_head.as_ref().unwrap_or(&self.embed_tokens), self.base_grad(grad));
        super::head::token_stats(hidden, &w, targets)
    }

    /// Appends `ids` (`(B, T)`, e.g. the left-padded prompts, then one token at a
    /// time) to `cache` and returns the logits at the last new position, `(B, vocab)`.
    /// `mask` marks the real tokens of this chunk (None = all real).
    pub fn decode(&self, ids: &Tensor, mask: Option<&[Vec<u8>]>, cache: &mut KvCache) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        if b != cache.batch {
            return Err(Error::invalid(format!("decode: batch of {b} rows, cache holds {}", cache.batch)));
        }
        if cache.len + t > cache.capacity {
            return Err(Error::invalid(format!(
                "decode: cache capacity {} exceeded ({} cached + {t} new)",
                cache.capacity, cache.len
            )));
        }
        // Positions continue each row's count of real tokens; padding gets 0
        // (its output is never used and its key is masked).
        let mut positions = Vec::with_capacity(b * t);
        for r in 0..b {
            for j in 0..t {
                let real = mask.is_none_or(|m| m[r][j] == 1);
                cache.key_bias[r * cache.capacity + cache.len + j] = if real { 0.0 } else { ops::MASKED };
                positions.push(if real { cache.next_pos[r] } else { 0 });
                cache.next_pos[r] += u32::from(real);
            }
        }
        let positions = Tensor::from_vec(positions, (b, t), &self.device)?;
        let s = cache.len + t;
        let bias: Vec<f32> = (0..b)
            .flat_map(|r| cache.key_bias[r * cache.capacity..r * cache.capacity + s].to_vec())
            .collect();
        let bias = Tensor::from_vec(bias, (b, 1, 1, s), &self.device)?;
        let offset = cache.len;
        let h = self.run(ids, &positions, &bias, (offset, Some(cache)), 0, Grad::Off)?;
        cache.len = s;
        let last = h.narrow(1, t - 1, 1)?.squeeze(1)?;
        self.lm_head(&last, Grad::Off)
    }

    fn w(&self, v: &Var, grad: Grad) -> Tensor {
        weight(v, grad)
    }

    /// The base model under the adapters, sharing its weight storage (a `Var` clone is
    /// the same tensor): the reference policy of a LoRA run's KL penalty without a
    /// second copy of the weights. Valid while the base stays frozen.
    pub fn base_view(&self) -> Qwen3 {
        let layers = self.layers.iter().map(|l| Layer { lora: Default::default(), ..l.clone() }).collect();
        Qwen3 {
            cfg: self.cfg.clone(),
            dtype: self.dtype,
            device: self.device.clone(),
            embed_tokens: self.embed_tokens.clone(),
            layers,
            norm: self.norm.clone(),
            lm_head: self.lm_head.clone(),
            inv_freq: self.inv_freq.clone(),
            recompute: RecomputeCell::new(self.recompute()),
            lora: None,
        }
    }

    /// True when the base weights are frozen (LoRA: only the adapters train).
    pub fn base_frozen(&self) -> bool {
        self.layers.first().is_some_and(|l| l.lora.frozen())
    }

    /// How the base weights outside the layers (embedding, final norm, head)
    /// are read: never tracked when the base is frozen.
    fn base_grad(&self, grad: Grad) -> Grad {
        if self.base_frozen() {
            Grad::Off
        } else {
            grad
        }
    }

    /// The parameters the optimizer trains, with their names: the adapters
    /// (peft's names) when the base is frozen, else [`Qwen3::params`].
    pub fn trainable_params(&self) -> Vec<(String, Var)> {
        if self.base_frozen() {
            self.lora_params()
        } else {
            self.params()
        }
    }

    /// The decoder stack. `pad_bias` is `(B, 1, 1, S)` over all keys (cached and
    /// new); `offset` is the number of cached keys before this chunk. The
    /// output holds positions `from..L` of the chunk (`from > 0` only without
    /// a cache).
    fn run(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        pad_bias: &Tensor,
        (offset, mut cache): (usize, Option<&mut KvCache>),
        from: usize,
        grad: Grad,
    ) -> Result<Tensor> {
        let (b, l) = ids.dims2()?;
        // (B, L) -> (B, L, hidden)
        let mut x = self
            .w(&self.embed_tokens, self.base_grad(grad))
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((b, l, self.cfg.hidden_size))?
            .to_dtype(self.activation_dtype())?;
        let ctx = self.layer_ctx(positions, pad_bias, offset, l)?;
        // Activation checkpointing: keep only each layer's input, rerun the
        // layer in the backward pass (model::recompute).
        let recompute = grad == Grad::Track
            && cache.is_none()
            && self.recompute().active(b * l, &self.cfg, x.dtype().size_in_bytes());
        let last = self.layers.len().saturating_sub(1);
        // The head reads positions `from..L` alone: the last layer computes its
        // queries and what follows them only there (`layer::layer_from`).
        let tail = if from > 0 && cache.is_none() {
            Some(self.layer_ctx(&positions.narrow(1, from, l - from)?, pad_bias, from, l - from)?)
        } else {
            None
        };
        for (i, layer) in self.layers.iter().enumerate() {
            let (q_ctx, from) = match &tail {
                Some(t) if i == last => (t, from),
                _ => (&ctx, 0),
            };
            x = if recompute {
                // A recomputed layer runs whole and is narrowed.
                let y = super::recompute::layer(layer, &ctx, &x)?;
                if from > 0 {
                    y.narrow(1, from, l - from)?
                } else {
                    y
                }
            } else if grad == Grad::Track && cache.is_none() && super::layer_grad::serves(layer, &x) {
                super::layer_grad::layer_from(layer, (&ctx, q_ctx), from, &x)?
            } else {
                let kv = cache.as_deref_mut().map(|c| (&c.k[i], &c.v[i]));
                super::layer::layer_from(layer, (&ctx, q_ctx), &x, from, offset, kv, grad)?
            };
        }
        if from > 0 && x.dim(1)? == l {
            x = x.narrow(1, from, l - from)?; // a model without layers
        }
        ops::rms_norm(&x, &self.w(&self.norm, self.base_grad(grad)), self.cfg.rms_norm_eps)
    }

    /// The rotary tables `(cos, sin)`, each `(B, 1, L, D/2)` in the model dtype,
    /// of position ids `(B, L)`: computed in f32 then cast, as HF does.
    pub(super) fn rotary(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        // The positions' cast, the product, cos, sin; the casts to the
        // compute and activation dtypes (see `model::budget`).
        let cd = ops::compute_dtype(self.dtype);
        let act = self.activation_dtype();
        super::budget::launch(4 + usize::from(cd != DType::F32) + 2 * usize::from(act != cd));
        let freqs = positions
            .to_dtype(DType::F32)?
            .unsqueeze(2)?
            .broadcast_mul(&self.inv_freq)?
            .to_dtype(ops::compute_dtype(self.dtype))?;
        let cos = freqs.cos()?.unsqueeze(1)?.to_dtype(self.activation_dtype())?;
        let sin = freqs.sin()?.unsqueeze(1)?.to_dtype(self.activation_dtype())?;
        Ok((cos, sin))
    }

    /// The embeddings of token ids `(B, L)`, `(B, L, hidden)`, for inference.
    pub(super) fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, l) = ids.dims2()?;
        let table = self.w(&self.embed_tokens, Grad::Off);
        super::budget::launch(1 + super::budget::cast_of(&table, self.activation_dtype()));
        let x = table.index_select(&ids.flatten_all()?, 0)?.reshape((b, l, self.cfg.hidden_size))?;
        Ok(x.to_dtype(self.activation_dtype())?)
    }

    /// The final RMSNorm's weight and the LM head's matrix (the embedding
    /// table when tied), detached, for inference.
    pub(super) fn head_weights(&self) -> (Tensor, Tensor) {
        (
            self.w(&self.norm, Grad::Off),
            self.w(self.lm_head.as_ref().unwrap_or(&self.embed_tokens), Grad::Off),
        )
    }

    /// The final RMSNorm, for inference.
    pub(super) fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        ops::rms_norm(x, &self.w(&self.norm, Grad::Off), self.cfg.rms_norm_eps)
    }

    /// The rotary tables and attention mask of `l` positions after `offset`
    /// cached keys, shared by every layer.
    pub(super) fn layer_ctx(
        &self,
        positions: &Tensor,
        pad_bias: &Tensor,
        offset: usize,
        l: usize,
    ) -> Result<LayerCtx> {
        let (cos, sin) = self.rotary(positions)?;
        // Causal within the chunk plus key padding; dense (B, 1, L, S) only for
        // short chunks (ops::AttnMask).
        let mask = ops::AttnMask::new(l, offset, pad_bias, self.activation_dtype(), &self.device)?;
        Ok(LayerCtx { cfg: self.cfg.clone(), cos, sin, mask })
    }
}

/// Log-probabilities of `targets` and full-vocabulary entropies from logits
/// `(.., V)`: returns `(logp, entropy)`, each shaped like `targets`. Computed in
/// f32 (f64 for f64 logits).
pub fn logprob_entropy(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let logits = logits.to_dtype(ops::compute_dtype(logits.dtype()))?;
    if super::fused::supported(&logits) {
        return super::fused::logprob_entropy(&logits, targets);
    }
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda()
        && logits.dtype() == DType::F32
        && super::fused::Kernels::current() == super::fused::Kernels::Fused
    {
        return super::cuda_ops::logprob_entropy(&logits, targets);
    }
    ops::logprob_entropy_composed(&logits, targets)
}

/// LoRA adapters on the decoder layers' projections (see `lora.rs`).
impl Qwen3 {
    /// Puts fresh adapters (f32, f64 on an f64 model; on the model's device) on the `cfg.targets`
    /// of every block: `A` as `nn.init.kaiming_uniform_(A, a=sqrt(5))`
    /// (uniform in `±1/sqrt(in)`), `B` zero. Replaces any adapters there were.
    pub fn add_lora(&mut self, cfg: &LoraConfig, seed: u64) -> Result<()> {
        cfg.validate()?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let device = self.device().clone();
        let scale = cfg.scale();
        let dtype = if self.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
        for layer in &mut self.layers {
            let mut lora = LayerLora::frozen_base();
            for &t in &cfg.targets {
                let shape = layer.base(t).dims2()?;
                lora.insert(t, Adapter::kaiming(&mut rng, shape, cfg.rank, scale, dtype, &device)?);
            }
            layer.lora = lora;
        }
        self.lora = Some(cfg.clone());
        Ok(())
    }

    /// The settings of the adapters the model carries (`None` without adapters).
    pub fn lora_config(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
    }

    /// The adapters' parameters under peft's names
    /// (`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`,
    /// `...lora_B.weight`): what the optimizer trains with LoRA on.
    pub fn lora_params(&self) -> Vec<(String, Var)> {
        let mut out = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            for t in Target::ALL {
                if let Some(ad) = layer.lora.get(t) {
                    let p = format!("base_model.model.model.layers.{i}.{}", t.module());
                    out.push((format!("{p}.lora_A.weight"), ad.a.clone()));
                    out.push((format!("{p}.lora_B.weight"), ad.b.clone()));
                }
            }
        }
        out
    }

    /// Every base parameter under its Hugging Face name, detached, with the
    /// adapted projections merged (`W + scale B A`, in the base dtype): the
    /// weights of the same function without adapters, which the rollout copy
    /// samples from. Without adapters, [`Qwen3::params`] detached.
    pub fn merged_params(&self) -> Result<Vec<(String, Tensor)>> {
        let mut merged = std::collections::HashMap::new();
        for (i, layer) in self.layers.iter().enumerate() {
            for t in Target::ALL {
                if layer.lora.get(t).is_some() {
                    merged.insert(format!("model.layers.{i}.{}.weight", t.module()), layer.merged_weight(t)?);
                }
            }
        }
        Ok(self
            .params()
            .into_iter()
            .map(|(n, v)| {
                let t = merged.remove(&n).unwrap_or_else(|| v.as_tensor().detach());
                (n, t)
            })
            .collect())
    }

    /// Whether any layer carries adapters.
    pub fn has_lora(&self) -> bool {
        self.layers.iter().any(|l| l.lora.vars().next().is_some())
    }

    /// Folds every adapter into its base weight (`W <- W + scale B A`) and
    /// drops the adapters: the same function, one matmul per projection.
    pub fn merge_lora(&mut self) -> Result<()> {
        for layer in &mut self.layers {
            for t in Target::ALL {
                if layer.lora.get(t).is_some() {
                    let merged = layer.merged_weight(t)?;
                    layer.base(t).set(&merged)?;
                }
            }
            layer.lora = LayerLora::default();
        }
        self.lora = None;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fused::test_util::{randn, rel_err};
    use crate::model::fused::Kernels;
    use crate::model::layer::layer_forward;
    use crate::model::recompute::CHUNK_TOKENS;

    /// A tiny f32 model with `layers` decoder layers (hidden 64, 4/2 heads).
    fn tiny_model(layers: usize, seed: u64) -> Qwen3 {
        let cfg = Config::from_json_str(
            &format!(
                r#"{{"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": {layers},
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0,
                "rms_norm_eps": 1e-6, "max_position_embeddings": 128, "tie_word_embeddings": true}}"#
            ),
            "tiny",
        )
        .unwrap();
        crate::model::init(&cfg, seed, 0.2, DType::F32, &Device::Cpu).unwrap()
    }

    /// The whole decoder stack on left-padded rows with the blockwise and the
    /// dense attention kernels: same hidden states on real positions, same
    /// gradients for the input and every weight.
    #[test]
    fn blockwise_and_dense_attention_give_the_same_stack() {
        let m = tiny_model(2, 5);
        let (b, l, pad) = (2, 40, 7);
        let mask: Vec<Vec<u8>> =
            (0..b).map(|r| (0..l).map(|j| u8::from(r == 0 || j >= pad)).collect()).collect();
        let batch = TokenBatch::from_parts(vec![3; b * l], mask.clone(), &Device::Cpu).unwrap();
        let bias: Vec<f32> = mask.iter().flatten().map(|&x| if x == 1 { 0.0 } else { ops::MASKED }).collect();
        let bias = Tensor::from_vec(bias, (b, 1, 1, l), &Device::Cpu).unwrap();
        let keep: Vec<f32> = mask.iter().flatten().map(|&x| f32::from(x)).collect();
        let keep = Tensor::from_vec(keep, (b, l, 1), &Device::Cpu).unwrap();
        let x = randn(&[b, l, 64], DType::F32, 9);
        let probe = randn(&[b, l, 64], DType::F32, 10);
        let run = |blockwise: bool| {
            let mut ctx = m.layer_ctx(&batch.positions, &bias, 0, l).unwrap();
            ctx.mask = ops::AttnMask::with_kernel(l, 0, &bias, DType::F32, blockwise).unwrap();
            assert_eq!(ctx.mask.blockwise(), blockwise);
            let mut h = x.as_tensor().clone();
            for layer in &m.layers {
                h = layer_forward(layer, &ctx, &h, 0, None, Grad::Track).unwrap();
            }
            let h = h.broadcast_mul(&keep).unwrap();
            let g = (&h * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
            (h, g)
        };
        let ((ha, ga), (hb, gb)) = (run(true), run(false));
        assert!(rel_err(&ha, &hb) < 1e-5, "hidden states: {:e}", rel_err(&ha, &hb));
        let mut vars: Vec<(String, Var)> = m.params();
        vars.push(("input".into(), x.clone()));
        for (name, v) in vars.iter().filter(|(n, _)| n.starts_with("model.layers") || n == "input") {
            let (a, b) = (ga.get(v.as_tensor()).unwrap(), gb.get(v.as_tensor()).unwrap());
            assert!(rel_err(a, b) < 1e-4, "{name}: gradient error {:e}", rel_err(a, b));
        }
    }

    /// The forward from a position on (the last layer's queries, attention
    /// and MLP at those positions only) against the whole forward narrowed,
    /// on left-padded rows of real ids, in f64 and f32: the hidden states
    /// and every parameter's gradient, with the kept layers' hand-written
    /// backward, the plain graph (candle's own ops), recomputed layers, and
    /// without a graph; with the dense kernel and (past 512 queries) the
    /// blockwise one.
    #[test]
    fn the_forward_from_a_position_is_the_whole_forward_narrowed() {
        let cfg = tiny_model(2, 0).cfg.clone();
        for (b, l, pad, from) in [(3, 20, 6, 9), (1, 530, 0, 12)] {
            let mask: Vec<Vec<u8>> =
                (0..b).map(|r| (0..l).map(|j| u8::from(r != 1 || j >= pad)).collect()).collect();
            let ids: Vec<u32> = (0..b * l).map(|i| (i * 37 % 97) as u32).collect();
            let batch = TokenBatch::from_parts(ids, mask, &Device::Cpu).unwrap();
            for dtype in [DType::F64, DType::F32] {
                let m = crate::model::init(&cfg, 23, 0.2, dtype, &Device::Cpu).unwrap();
                let probe = randn(&[b, l - from, 64], dtype, 41);
                let whole_then_narrow =
                    |grad: Grad| m.forward_hidden(&batch, grad).unwrap().narrow(1, from, l - from).unwrap();
                let grads = |h: &Tensor| {
                    let g = (h * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
                    let of = |(n, v): &(String, Var)| (n.clone(), g.get(v.as_tensor()).unwrap().clone());
                    m.params().iter().map(of).collect::<Vec<_>>()
                };
                let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
                let check = |what: &str, grad: Grad| {
                    let (h0, h1) =
                        (whole_then_narrow(grad), m.forward_hidden_from(&batch, from, grad).unwrap());
                    assert_eq!(h1.dims(), &[b, l - from, 64]);
                    assert!(
                        rel_err(&h1, &h0) < tol,
                        "{what} {dtype:?} L {l}: hidden {:e}",
                        rel_err(&h1, &h0)
                    );
                    if grad == Grad::Track {
                        for ((name, g0), (_, g1)) in grads(&h0).iter().zip(grads(&h1)) {
                            let e = rel_err(&g1, g0);
                            assert!(e < tol, "{what} {dtype:?} L {l}: {name} gradient {e:e}");
                        }
                    }
                };
                check("kept layers", Grad::Track);
                check("no graph", Grad::Off);
                Kernels::Composed.scope(|| check("candle's ops", Grad::Track));
                m.set_recompute(Recompute::On);
                check("recomputed layers", Grad::Track);
            }
        }
    }

    /// A decoder layer with its activations kept and its hand-written
    /// backward (`layer_grad`) against the plain graph, on left-padded rows
    /// with the dense and the blockwise attention kernels, in f64 and f32:
    /// the output, the input's gradient and every weight's. The plain graph
    /// runs the fused kernels op by op, and candle's own ops (composed
    /// kernels) in f64, an independent reference.
    #[test]
    fn kept_layer_backward_matches_the_plain_graph() {
        let cfg = tiny_model(1, 0).cfg.clone();
        let (b, l, pad) = (3, 20, 6);
        let mask: Vec<Vec<u8>> =
            (0..b).map(|r| (0..l).map(|j| u8::from(r != 1 || j >= pad)).collect()).collect();
        let batch = TokenBatch::from_parts(vec![3; b * l], mask.clone(), &Device::Cpu).unwrap();
        for dtype in [DType::F64, DType::F32] {
            let m = crate::model::init(&cfg, 21, 0.2, dtype, &Device::Cpu).unwrap();
            let bias: Vec<f64> =
                mask.iter().flatten().map(|&x| if x == 1 { 0.0 } else { ops::MASKED as f64 }).collect();
            let bias = Tensor::from_vec(bias, (b, 1, 1, l), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let x = randn(&[b, l, 64], dtype, 31);
            let dy = randn(&[b, l, 64], dtype, 32);
            let layer = &m.layers[0];
            assert!(super::super::layer_grad::serves(layer, x.as_tensor()));
            for blockwise in [false, true] {
                let mut ctx = m.layer_ctx(&batch.positions, &bias, 0, l).unwrap();
                ctx.mask = ops::AttnMask::with_kernel(l, 0, &bias, dtype, blockwise).unwrap();
                let run = |kept: bool| {
                    let y = if kept {
                        super::super::layer_grad::layer_from(layer, (&ctx, &ctx), 0, x.as_tensor()).unwrap()
                    } else {
                        layer_forward(layer, &ctx, x.as_tensor(), 0, None, Grad::Track).unwrap()
                    };
                    let g = (&y * dy.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
                    let mut grads = vec![g.get(x.as_tensor()).unwrap().clone()];
                    grads.extend(layer.vars().iter().map(|v| g.get(v.as_tensor()).unwrap().clone()));
                    (y, grads)
                };
                let (y0, g0) = run(false);
                let (y1, g1) = run(true);
                let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
                assert!(
                    rel_err(&y0, &y1) < tol,
                    "{dtype:?} blockwise {blockwise}: output {:e}",
                    rel_err(&y0, &y1)
                );
                for (i, (a, b)) in g0.iter().zip(&g1).enumerate() {
                    let e = rel_err(a, b);
                    assert!(e < tol, "{dtype:?} blockwise {blockwise}: gradient {i} (0 = input): {e:e}");
                }
                if dtype == DType::F64 && !blockwise {
                    let (y2, g2) = Kernels::Composed.scope(|| run(false));
                    assert!(rel_err(&y2, &y1) < 1e-10, "composed output {:e}", rel_err(&y2, &y1));
                    for (i, (a, b)) in g2.iter().zip(&g1).enumerate() {
                        let e = rel_err(a, b);
                        assert!(e < 1e-10, "against candle's ops: gradient {i} (0 = input): {e:e}");
                    }
                }
            }
        }
    }

    /// A recomputed layer's backward in pieces gives the gradients of the
    /// plain graph of the layer, for the input and every weight: pieces of
    /// positions (7 tokens: 3 positions of the 2 rows of 40, so the last
    /// piece is short; 5 rows of 12, chunk 7: one position a piece) and of
    /// rows (5 rows of 12, chunk 30: 2 rows a piece, the last piece one row),
    /// and one piece for all.
    #[test]
    fn chunked_layer_backward_matches_the_plain_graph() {
        let m = tiny_model(1, 6);
        for (b, l, chunks) in [(2, 40, vec![7, CHUNK_TOKENS]), (5, 12, vec![7, 30, CHUNK_TOKENS])] {
            let batch = TokenBatch::from_parts(vec![3; b * l], vec![vec![1; l]; b], &Device::Cpu).unwrap();
            let bias = Tensor::zeros((b, 1, 1, l), DType::F32, &Device::Cpu).unwrap();
            let ctx = m.layer_ctx(&batch.positions, &bias, 0, l).unwrap();
            let layer = &m.layers[0];
            let x = randn(&[b, l, 64], DType::F32, 11);
            let dy = randn(&[b, l, 64], DType::F32, 12);
            let y = layer_forward(layer, &ctx, x.as_tensor(), 0, None, Grad::Track).unwrap();
            let plain = (y * dy.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
            for chunk in chunks {
                let (dx, grads) = super::super::recompute::layer_backward(
                    layer,
                    &ctx,
                    x.as_tensor(),
                    dy.as_tensor(),
                    chunk,
                )
                .unwrap();
                let e = rel_err(&dx, plain.get(x.as_tensor()).unwrap());
                assert!(e < 1e-5, "{b} x {l}, chunk {chunk}: input gradient error {e:e}");
                for (i, (g, v)) in grads.iter().zip(layer.vars()).enumerate() {
                    let (g, r) = (g.as_ref().unwrap(), plain.get(v.as_tensor()).unwrap());
                    assert!(
                        rel_err(g, r) < 1e-5,
                        "{b} x {l}, chunk {chunk}: weight {i}: gradient error {:e}",
                        rel_err(g, r)
                    );
                }
            }
        }
    }
}
