//! Supervised fine-tuning: next-token cross-entropy on response tokens only.
//!
//! The standard SFT objective of instruction tuning (Ouyang et al. 2022,
//! "Training language models to follow instructions", §3.5; TRL's
//! `SFTTrainer` with completion-only loss): prompt positions are masked, and
//! the loss is the mean negative log-likelihood over all response tokens of the
//! batch (token-mean, so long and short responses weigh by their tokens).
//!
//! The layout is the RL update's ([`crate::train::update`](mod@crate::train::update)):
//! `[left pad | prompt | response | right pad]`, prompts left-padded to the
//! batch's longest prompt `P`, responses right-padded to its longest response
//! `T`; response token `j` sits at `P + j` and is predicted by the hidden state
//! at `P + j - 1`, so only `T` positions go through the LM head.
//!
//! [`tiny`] builds the committed `models/tiny-qwen3` from scratch with this step.

pub mod tiny;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use crate::model::{Grad, Qwen3, TokenBatch};
use crate::train::optim::AdamW;
use crate::{Error, Result};

pub use tiny::{
    evaluate, is_correct, pretrain_tiny, pretrain_tiny_until, tiny_template, EvalReport, SftStop, TinyConfig,
    TinyReport,
};

/// What one SFT step did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SftMetrics {
    /// Mean negative log-likelihood per response token (before the update).
    pub loss: f32,
    /// Response tokens the loss averaged over.
    pub tokens: usize,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    /// True when the loss or gradient was not finite and the weights were left alone.
    pub skipped: bool,
}

/// A `(prompt, response)` pair of token ids, borrowed.
type Pair<'a> = (&'a [u32], &'a [u32]);

/// An owned example, borrowed as a [`Pair`].
fn pair((prompt, response): &(Vec<u32>, Vec<u32>)) -> Pair<'_> {
    (prompt, response)
}

/// The layout of a batch of `(prompt, response)` pairs: tokens, `(B, T)` targets
/// and `(B, T)` response mask, and the longest prompt `P` and response `T`.
struct Layout {
    tokens: TokenBatch,
    targets: Tensor,
    mask: Tensor,
    p: usize,
    t: usize,
    n_tokens: usize,
}

fn layout(batch: &[Pair], pad_id: u32, model: &Qwen3) -> Result<Layout> {
    if batch.is_empty() {
        return Err(Error::invalid("sft: empty batch"));
    }
    let vocab = model.config().vocab_size;
    let p = batch.iter().map(|(pr, _)| pr.len()).max().unwrap_or(0);
    let t = batch.iter().map(|(_, r)| r.len()).max().unwrap_or(0);
    if t == 0 {
        return Err(Error::invalid("sft: every response in the batch is empty"));
    }
    let b = batch.len();
    let mut ids = Vec::with_capacity(b * (p + t));
    let mut mask = Vec::with_capacity(b);
    let mut targets = Vec::with_capacity(b * t);
    let mut resp = Vec::with_capacity(b * t);
    for (i, (prompt, response)) in batch.iter().enumerate() {
        if prompt.is_empty() {
            return Err(Error::invalid(format!(
                "sft: example {i} has an empty prompt (the first response token needs a context)"
            )));
        }
        if let Some(bad) = prompt.iter().chain(*response).find(|&&id| id as usize >= vocab) {
            return Err(Error::invalid(format!(
                "sft: example {i} has token id {bad}, outside the model's vocabulary of {vocab}"
            )));
        }
        let (pl, rl) = (prompt.len(), response.len());
        ids.extend(std::iter::repeat_n(pad_id, p - pl));
        ids.extend_from_slice(prompt);
        ids.extend_from_slice(response);
        ids.extend(std::iter::repeat_n(pad_id, t - rl));
        let mut row = vec![0u8; p - pl];
        row.extend(std::iter::repeat_n(1u8, pl + rl));
        row.extend(std::iter::repeat_n(0u8, t - rl));
        mask.push(row);
        targets.extend_from_slice(response);
        targets.extend(std::iter::repeat_n(0u32, t - rl));
        resp.extend(std::iter::repeat_n(1f32, rl));
        resp.extend(std::iter::repeat_n(0f32, t - rl));
    }
    let device = model.device();
    Ok(Layout {
        tokens: TokenBatch::from_parts(ids, mask, device)?,
        targets: Tensor::from_vec(targets, (b, t), device)?,
        mask: Tensor::from_vec(resp, (b, t), device)?,
        p,
        t,
        n_tokens: batch.iter().map(|(_, r)| r.len()).sum(),
    })
}

/// The token-mean cross-entropy (a scalar f32 tensor) of the response tokens
/// of `batch`, and the number of response tokens.
pub fn sft_loss(
    model: &Qwen3,
    batch: &[(Vec<u32>, Vec<u32>)],
    pad_id: u32,
    grad: Grad,
) -> Result<(Tensor, usize)> {
    let pairs: Vec<Pair> = batch.iter().map(pair).collect();
    loss_of(model, &pairs, pad_id, grad)
}

/// [`sft_loss`] over borrowed pairs.
fn loss_of(model: &Qwen3, batch: &[Pair], pad_id: u32, grad: Grad) -> Result<(Tensor, usize)> {
    let l = layout(batch, pad_id, model)?;
    // (B, P+T, hidden) from the last prompt position on: the T positions that
    // predict response tokens (and the last, which predicts none).
    let hidden = model.forward_hidden_from(&l.tokens, l.p - 1, grad)?;
    let h = hidden.narrow(1, 0, l.t)?;
    // Through the head in tiles: no (B, T, V) logits (model::head).
    let logp = model.token_stats(&h, &l.targets, grad)?.logp.to_dtype(DType::F32)?;
    let nll = (logp * &l.mask)?.sum_all()?.neg()?;
    let loss = (nll / l.n_tokens as f64)?;
    Ok((loss, l.n_tokens))
}

/// Padded tokens (rows x (longest prompt + longest response)) of one SFT forward by
/// default: [`sft_step`] cuts a batch into micro-batches of similar lengths up to this size.
pub const SFT_MICRO_TOKENS: usize = 4096;

/// One SFT step: cross-entropy on the response tokens of `batch` (prompt
/// masked, token-mean over the batch), backward, and an AdamW step at `lr`
/// (gradient clipping as configured in `opt`; the caller applies the LR
/// schedule). A non-finite loss or gradient skips the update. The batch runs in
/// micro-batches of at most [`SFT_MICRO_TOKENS`] padded tokens ([`sft_step_in`]).
pub fn sft_step(
    model: &Qwen3,
    opt: &mut AdamW,
    batch: &[(Vec<u32>, Vec<u32>)],
    lr: f64,
    pad_id: u32,
) -> Result<SftMetrics> {
    sft_step_in(model, opt, batch, lr, pad_id, SFT_MICRO_TOKENS)
}

/// [`sft_step`] with the micro-batch size given: the examples, ordered by length, are
/// grouped into micro-batches of at most `max_tokens` padded tokens (one example alone
/// when it is longer), each padded to its own longest prompt and response rather than to
/// the batch's, and their gradients summed. Each micro-batch's loss is weighted by its
/// share of the batch's response tokens, so the loss and the gradient are those of the
/// whole batch at once (up to rounding); only the padding, which carries neither loss nor
/// attention, is not computed.
pub fn sft_step_in(
    model: &Qwen3,
    opt: &mut AdamW,
    batch: &[(Vec<u32>, Vec<u32>)],
    lr: f64,
    pad_id: u32,
    max_tokens: usize,
) -> Result<SftMetrics> {
    let (value, tokens, grads) = match sft_grads(model, batch, pad_id, max_tokens)? {
        (value, tokens, None) => {
            // The caller sees `skipped` (pretrain_tiny reports it in its log).
            return Ok(SftMetrics { loss: value, tokens, grad_norm: f32::NAN, skipped: true });
        }
        (value, tokens, Some(grads)) => (value, tokens, grads),
    };
    let report = opt.step(&grads, lr)?;
    Ok(SftMetrics { loss: value, tokens, grad_norm: report.grad_norm as f32, skipped: report.skipped })
}

/// The batch's token-mean loss, its response tokens and the summed gradients of its
/// micro-batches (`None` as soon as a micro-batch's loss is not finite).
fn sft_grads(
    model: &Qwen3,
    batch: &[(Vec<u32>, Vec<u32>)],
    pad_id: u32,
    max_tokens: usize,
) -> Result<(f32, usize, Option<GradStore>)> {
    if batch.is_empty() {
        return Err(Error::invalid("sft: empty batch"));
    }
    let total: usize = batch.iter().map(|(_, r)| r.len()).sum();
    if total == 0 {
        return Err(Error::invalid("sft: every response in the batch is empty"));
    }
    let mut order: Vec<usize> = (0..batch.len()).collect();
    order.sort_by_key(|&i| (batch[i].0.len() + batch[i].1.len(), i));
    let params = model.params();
    let mut acc = GradStore::default();
    let mut value = 0f64;
    for group in micro_batches(batch, &order, max_tokens) {
        let micro: Vec<Pair> = group.iter().map(|&i| pair(&batch[i])).collect();
        let n: usize = micro.iter().map(|(_, r)| r.len()).sum();
        if n == 0 {
            continue;
        }
        let (loss, _) = loss_of(model, &micro, pad_id, Grad::Track)?;
        let loss = (loss * (n as f64 / total as f64))?;
        let part = loss.to_scalar::<f32>()?;
        value += part as f64;
        if !part.is_finite() {
            return Ok((part, total, None));
        }
        let mut grads = loss.backward()?;
        for (_, var) in &params {
            if let Some(g) = grads.remove(var.as_tensor()) {
                let g = match acc.remove(var.as_tensor()) {
                    Some(prev) => (prev + g)?,
                    None => g,
                };
                acc.insert(var.as_tensor(), g);
            }
        }
    }
    Ok((value as f32, total, Some(acc)))
}

/// Consecutive runs of `order` (examples sorted by length) whose padded size, rows x
/// (longest prompt + longest response), stays within `max_tokens`; an example longer
/// than that goes alone.
fn micro_batches(batch: &[(Vec<u32>, Vec<u32>)], order: &[usize], max_tokens: usize) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let (mut cur, mut p, mut t) = (Vec::new(), 0usize, 0usize);
    for &i in order {
        let (np, nt) = (p.max(batch[i].0.len()), t.max(batch[i].1.len()));
        if !cur.is_empty() && (cur.len() + 1) * (np + nt) > max_tokens {
            out.push(std::mem::take(&mut cur));
            (p, t) = (batch[i].0.len(), batch[i].1.len());
        } else {
            (p, t) = (np, nt);
        }
        cur.push(i);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{self, ops, Config};
    use crate::train::optim::AdamWConfig;
    use candle_core::Device;

    fn tiny(seed: u64) -> Qwen3 {
        let cfg = Config::from_json_str(
            r#"{"vocab_size": 50, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "max_position_embeddings": 128, "tie_word_embeddings": true, "torch_dtype": "float32"}"#,
            "tiny",
        )
        .expect("config");
        model::init(&cfg, seed, 0.1, DType::F32, &Device::Cpu).expect("init")
    }

    fn batch() -> Vec<(Vec<u32>, Vec<u32>)> {
        vec![
            (vec![3, 4, 5, 6], vec![7, 8, 9, 1]),
            (vec![10, 11], vec![12, 13, 14, 15, 16, 1]),
            (vec![20, 21, 22], vec![23, 1]),
        ]
    }

    /// The loss recomputed by hand from full-sequence logits of each example
    /// alone: sum over response positions only, divided by all response tokens.
    fn reference_loss(model: &Qwen3, batch: &[(Vec<u32>, Vec<u32>)]) -> f64 {
        let (mut nll, mut n) = (0f64, 0usize);
        for (p, r) in batch {
            let ids: Vec<u32> = p.iter().chain(r).copied().collect();
            let tb = TokenBatch::left_padded(std::slice::from_ref(&ids), 0, &Device::Cpu).expect("batch");
            let logits = model.forward(&tb).expect("forward").squeeze(0).expect("squeeze");
            let logp = ops::log_softmax(&logits).expect("lsm").to_vec2::<f32>().expect("vec");
            for j in 0..r.len() {
                let pos = p.len() + j - 1;
                nll -= logp[pos][ids[pos + 1] as usize] as f64;
                n += 1;
            }
        }
        nll / n as f64
    }

    #[test]
    fn loss_is_the_token_mean_over_response_tokens_only() {
        let m = tiny(1);
        let b = batch();
        let (loss, n) = sft_loss(&m, &b, 0, Grad::Off).expect("loss");
        assert_eq!(n, 12);
        let got = loss.to_scalar::<f32>().expect("scalar") as f64;
        let want = reference_loss(&m, &b);
        assert!((got - want).abs() < 1e-4, "batched {got} vs per-example {want}");
        // Same loss whatever the padding id (pad positions carry no loss or attention).
        let (loss2, _) = sft_loss(&m, &b, 42, Grad::Off).expect("loss");
        assert!((loss2.to_scalar::<f32>().expect("scalar") as f64 - got).abs() < 1e-5);
    }

    /// Micro-batches of any size give the whole batch's loss and gradient: each example
    /// alone, pairs of similar length, and the batch at once.
    #[test]
    fn micro_batches_sum_to_the_whole_batch() {
        let m = tiny(3);
        let mut b = batch();
        b.push((vec![30, 31, 32, 33, 34, 35], vec![36, 37, 38, 39, 40, 41, 42, 1]));
        let (whole, n, g) = sft_grads(&m, &b, 0, usize::MAX).expect("whole");
        let g = g.expect("finite");
        assert_eq!(n, 20);
        let want = reference_loss(&m, &b);
        assert!((whole as f64 - want).abs() < 1e-4, "{whole} vs {want}");
        let order: Vec<usize> = (0..b.len()).collect();
        assert_eq!(micro_batches(&b, &order, 1), vec![vec![0], vec![1], vec![2], vec![3]]);
        // Rows of (prompt, response) lengths (4, 4), (2, 6), (3, 2), (6, 8): the first two
        // pad to 2 x (4 + 6) = 20 tokens, the first three to 3 x 10 = 30, all four to 4 x 14.
        assert_eq!(micro_batches(&b, &order, 24), vec![vec![0, 1], vec![2], vec![3]]);
        assert_eq!(micro_batches(&b, &order, 40), vec![vec![0, 1, 2], vec![3]]);
        for max_tokens in [1, 24, 40] {
            let (loss, n2, g2) = sft_grads(&m, &b, 0, max_tokens).expect("micro");
            let g2 = g2.expect("finite");
            assert_eq!(n2, n);
            assert!((loss - whole).abs() < 1e-5, "{max_tokens}: {loss} vs {whole}");
            for (name, var) in m.params() {
                let (a, c) = (g.get(var.as_tensor()).expect("grad"), g2.get(var.as_tensor()).expect("grad"));
                let diff = (a - c).expect("sub").abs().expect("abs").max_all().expect("max");
                let scale = a.abs().expect("abs").max_all().expect("max").to_scalar::<f32>().expect("s");
                let diff = diff.to_scalar::<f32>().expect("s");
                assert!(diff <= 1e-5 * scale.max(1.0), "{max_tokens} {name}: {diff} (scale {scale})");
            }
        }
    }

    #[test]
    fn prompt_tokens_are_not_targets() {
        // Moving tokens from the response to the prompt removes exactly their terms:
        // with prompt [3,4,5,6,7] the token 7 is context, not a target.
        let m = tiny(2);
        let full = vec![(vec![3, 4, 5, 6], vec![7, 8, 9])];
        let short = vec![(vec![3, 4, 5, 6, 7], vec![8, 9])];
        let lf = sft_loss(&m, &full, 0, Grad::Off).expect("loss").0.to_scalar::<f32>().expect("s") as f64;
        let ls = sft_loss(&m, &short, 0, Grad::Off).expect("loss").0.to_scalar::<f32>().expect("s") as f64;
        assert!((ls - reference_loss(&m, &short)).abs() < 1e-4);
        // NLL(7 | 3..6) = 3 * lf - 2 * ls, computed independently:
        let tb = TokenBatch::left_padded(&[vec![3, 4, 5, 6]], 0, &Device::Cpu).expect("batch");
        let logits = m.forward(&tb).expect("fwd").squeeze(0).expect("sq");
        let lp = ops::log_softmax(&logits).expect("lsm").to_vec2::<f32>().expect("v");
        let nll7 = -(lp[3][7] as f64);
        assert!((3.0 * lf - 2.0 * ls - nll7).abs() < 1e-4, "{} vs {nll7}", 3.0 * lf - 2.0 * ls);
    }

    #[test]
    fn steps_decrease_the_loss() {
        let m = tiny(3);
        let cfg = AdamWConfig { lr: 1e-2, weight_decay: 0.0, ..AdamWConfig::default() };
        let mut opt = AdamW::new(m.params(), cfg).expect("adamw");
        let b = batch();
        let first = sft_step(&m, &mut opt, &b, 1e-2, 0).expect("step");
        assert_eq!(first.tokens, 12);
        assert!(first.grad_norm > 0.0 && !first.skipped);
        let mut last = first;
        for _ in 0..20 {
            last = sft_step(&m, &mut opt, &b, 1e-2, 0).expect("step");
        }
        assert!(last.loss < 0.5 * first.loss, "loss {} -> {}", first.loss, last.loss);
        assert_eq!(opt.step_count(), 21);
    }

    #[test]
    fn bad_batches_are_rejected() {
        let m = tiny(4);
        assert!(sft_loss(&m, &[], 0, Grad::Off).is_err());
        assert!(sft_loss(&m, &[(vec![], vec![1, 2])], 0, Grad::Off).is_err());
        assert!(sft_loss(&m, &[(vec![1], vec![])], 0, Grad::Off).is_err());
        let err = sft_loss(&m, &[(vec![1], vec![500])], 0, Grad::Off).expect_err("id out of range");
        assert!(err.to_string().contains("500"), "{err}");
    }
}
