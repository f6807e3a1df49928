//! The whole model on its three paths, against each other:
//!
//! - **fused**: [`Kernels::Fused`], the CPU kernels of [`super::fused`];
//! - **composed**: [`Kernels::Composed`], what CUDA and bf16 run — candle ops,
//!   query-block attention from 512 queries ([`ops::attention_blocks`]), the
//!   recomputed head tiles ([`super::head::token_stats_recomputed`]);
//! - **plain graph**: composed ops with the dense causal mask, no layer
//!   recomputation and the head over full logits in one piece
//!   ([`super::head::token_stats_composed`]): candle's own autograd, nothing
//!   recomputed, the reference.
//!
//! In f64 the three agree to 1e-9 (relative to the largest element) on values
//! and on the gradient of every weight, with left padding, grouped-query
//! attention (4 query heads over 2), ragged head tiles, the blockwise
//! attention at 520 queries, layer recomputation on and off, and cached
//! decoding in chunks after an offset. In bf16 the composed path is checked
//! against the f64 model of the same (bf16-rounded) weights.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};

use super::fused::test_util::{randn, rel_err};
use super::fused::Kernels;
use super::head::{token_stats_composed, token_stats_tiled};
use super::layer::layer_forward;
use super::ops::Grad;
use super::{ops, Config, KvCache, Qwen3, Recompute, RolloutCopy, TokenBatch};

/// A random model with 2 layers, hidden 64, 4 query heads over 2 key/value
/// heads of 16, tied head, vocabulary 97.
fn model(dtype: DType, seed: u64) -> Qwen3 {
    let cfg = Config::from_json_str(
        r#"{"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": true}"#,
        "kernels test",
    )
    .unwrap();
    super::init(&cfg, seed, 0.2, dtype, &Device::Cpu).unwrap()
}

fn params(m: &Qwen3) -> HashMap<String, Var> {
    m.params().into_iter().collect()
}

/// Rows of `lens` real tokens, left-padded to the longest.
fn rows(lens: &[usize], seed: u32) -> Vec<Vec<u32>> {
    lens.iter()
        .enumerate()
        .map(|(r, &n)| (0..n as u32).map(|t| (t * 31 + r as u32 * 17 + seed) % 97).collect())
        .collect()
}

/// Hidden states of the plain graph: embedding, the decoder layers with the
/// dense mask, the final norm, all composed and recorded, nothing recomputed.
fn plain_hidden(m: &Qwen3, batch: &TokenBatch) -> Tensor {
    Kernels::Composed.scope(|| {
        let p = params(m);
        let (b, l) = batch.dims();
        let bias: Vec<f32> =
            batch.mask.iter().flatten().map(|&x| if x == 1 { 0.0 } else { ops::MASKED }).collect();
        let bias = Tensor::from_vec(bias, (b, 1, 1, l), &Device::Cpu).unwrap();
        let mut ctx = m.layer_ctx(&batch.positions, &bias, 0, l).unwrap();
        ctx.mask = ops::AttnMask::with_kernel(l, 0, &bias, m.dtype(), false).unwrap();
        let embed = p["model.embed_tokens.weight"].as_tensor();
        let ids = batch.ids.flatten_all().unwrap();
        let mut x = embed.index_select(&ids, 0).unwrap().reshape((b, l, 64)).unwrap();
        for layer in &m.layers {
            x = layer_forward(layer, &ctx, &x, 0, None, Grad::Track).unwrap();
        }
        ops::rms_norm_composed(&x, p["model.norm.weight"].as_tensor(), 1e-6).unwrap()
    })
}

/// Which path computes the statistics.
#[derive(Debug, Clone, Copy)]
enum Path {
    Fused(Recompute),
    Composed(Recompute),
    Plain,
}

/// `[logp, entropy, Σp²]` `(B, R, 3)` of the last `r` positions of every row
/// (each predicting the next id; the last predicts id 0), and the gradient of
/// every weight under a fixed random functional of them. Head tiles of
/// `tile` logits: ragged over the `B × R` positions.
fn stats_and_grads(
    m: &Qwen3,
    batch: &TokenBatch,
    r: usize,
    tile: usize,
    path: Path,
) -> (Tensor, Vec<Tensor>) {
    let (b, l) = batch.dims();
    let ids = batch.ids.to_vec2::<u32>().unwrap();
    let targets: Vec<u32> =
        ids.iter().flat_map(|row| (l - r..l).map(|t| row.get(t + 1).copied().unwrap_or(0))).collect();
    let targets = Tensor::from_vec(targets, (b, r), &Device::Cpu).unwrap();
    let w = params(m)["model.embed_tokens.weight"].as_tensor().clone();
    let run = |kernels: Kernels, rc: Recompute| {
        kernels.scope(|| {
            m.set_recompute(rc);
            let h = m.forward_hidden(batch, Grad::Track).unwrap().narrow(1, l - r, r).unwrap();
            let s = token_stats_tiled(&h, &w, &targets, tile).unwrap();
            Tensor::stack(&[s.logp, s.entropy, s.collision], 2).unwrap()
        })
    };
    let y = match path {
        Path::Fused(rc) => run(Kernels::Fused, rc),
        Path::Composed(rc) => run(Kernels::Composed, rc),
        Path::Plain => Kernels::Composed.scope(|| {
            let h = plain_hidden(m, batch).narrow(1, l - r, r).unwrap().reshape((b * r, 64)).unwrap();
            token_stats_composed(&h, &w, &targets, b * r).unwrap().reshape((b, r, 3)).unwrap()
        }),
    };
    m.set_recompute(Recompute::Auto);
    let probe = randn(y.dims(), y.dtype(), 77);
    let g = (&y * probe.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
    let grads =
        m.params().into_iter().map(|(n, v)| g.get(v.as_tensor()).unwrap_or_else(|| panic!("{n}")).clone());
    (y, grads.collect())
}

/// Every path against the plain graph, values and every weight's gradient.
fn all_paths_agree(lens: &[usize], r: usize, tile: usize, tol: f64) {
    let m = model(DType::F64, 3);
    let batch = TokenBatch::left_padded(&rows(lens, 5), 0, &Device::Cpu).unwrap();
    let (y0, g0) = stats_and_grads(&m, &batch, r, tile, Path::Plain);
    let names: Vec<String> = m.params().into_iter().map(|(n, _)| n).collect();
    for path in [
        Path::Fused(Recompute::Off),
        Path::Fused(Recompute::On),
        Path::Composed(Recompute::Off),
        Path::Composed(Recompute::On),
    ] {
        let (y, g) = stats_and_grads(&m, &batch, r, tile, path);
        let e = rel_err(&y, &y0);
        assert!(e < tol, "{lens:?} {path:?}: statistics differ by {e:e}");
        for ((a, b), name) in g.iter().zip(&g0).zip(&names) {
            let e = rel_err(a, b);
            assert!(e < tol, "{lens:?} {path:?}: gradient of {name} differs by {e:e}");
        }
    }
}

/// Short rows (dense attention on every path), one left-padded by 9, the
/// head in ragged tiles (2 × 12 positions, 5 logit rows of 97 per tile).
#[test]
fn fused_composed_and_plain_graph_agree_on_short_padded_rows() {
    all_paths_agree(&[40, 31], 12, 5 * 97, 1e-9);
}

/// 520 queries: fused and composed run their blockwise attention (the plain
/// graph the dense one); one row left-padded by 23.
#[test]
fn fused_composed_and_plain_graph_agree_on_520_blockwise_queries() {
    all_paths_agree(&[520, 497], 40, 7 * 97, 1e-9);
}

/// Decoding with the KV cache: a left-padded prompt, then chunks of 520
/// (blockwise, after an offset of 300 cached keys), 3 and 1 tokens; the
/// logits at the end of each call against the plain graph's over the whole
/// sequence, on the fused and composed paths.
#[test]
fn cached_decoding_matches_the_plain_graph_on_both_paths() {
    let m = model(DType::F64, 4);
    let prompt = rows(&[300, 288], 9);
    let chunks = [520usize, 3, 1];
    let total = 300 + chunks.iter().sum::<usize>();
    let extra: Vec<Vec<u32>> =
        (0..2).map(|r| (0..total - 300).map(|t| ((t * 13 + r * 5) % 97) as u32).collect()).collect();
    let full: Vec<Vec<u32>> = (0..2)
        .map(|r| {
            let pad = 300 - prompt[r].len();
            let mut v = vec![0; pad];
            v.extend(&prompt[r]);
            v.extend(&extra[r]);
            v
        })
        .collect();
    let mask: Vec<Vec<u8>> =
        (0..2).map(|r| (0..total).map(|j| u8::from(j >= 300 - prompt[r].len())).collect()).collect();
    let batch = TokenBatch::from_parts(full.concat(), mask, &Device::Cpu).unwrap();
    let w = params(&m)["model.embed_tokens.weight"].as_tensor().clone();
    let plain = Kernels::Composed.scope(|| ops::linear(&plain_hidden(&m, &batch), &w, None).unwrap());
    let mut ends = vec![300];
    for c in chunks {
        ends.push(ends.last().unwrap() + c);
    }
    for kernels in [Kernels::Fused, Kernels::Composed] {
        kernels.scope(|| {
            let mut cache = KvCache::new(&m, 2, total).unwrap();
            let p = TokenBatch::left_padded(&prompt, 0, &Device::Cpu).unwrap();
            let mut got = vec![m.decode(&p.ids, Some(&p.mask), &mut cache).unwrap()];
            let mut at = 0;
            for c in chunks {
                let ids: Vec<u32> = extra.iter().flat_map(|r| r[at..at + c].to_vec()).collect();
                let ids = Tensor::from_vec(ids, (2, c), &Device::Cpu).unwrap();
                got.push(m.decode(&ids, None, &mut cache).unwrap());
                at += c;
            }
            for (logits, &end) in got.iter().zip(&ends) {
                let want = plain.narrow(1, end - 1, 1).unwrap().squeeze(1).unwrap();
                let e = rel_err(logits, &want);
                assert!(e < 1e-9, "{kernels:?}: logits after {end} tokens differ by {e:e}");
            }
        });
    }
}

/// The bf16 composed path (what a GPU user runs: recomputed layers, query
/// blocks at 520 queries, recomputed head tiles) against the f64 plain graph
/// of the same bf16-rounded weights: statistics in f32, gradients in bf16.
///
/// The bounds are in bf16's unit roundoff u = 2^-8: every op rounds its
/// output to bf16, about ten roundings per layer, so the statistics of this
/// 2-layer model measured 1.2–1.6 u (log-prob, entropy; relative to the
/// largest value) and up to 5.5 u (Σp²), the weights' gradients up to 16 u
/// (the q/k norm weights, whose gradient sums over every head). Asserted: 8 u
/// and 24 u; and, so that the memory-bounded path cannot lose accuracy
/// unnoticed within those, at most 2× the error of candle's plain graph in
/// bf16 (the same ops without blocks, tiles or recomputation) plus u.
#[test]
fn bf16_composed_path_matches_an_f64_reference() {
    const U: f64 = 1.0 / 256.0;
    let m16 = model(DType::BF16, 6);
    let copy = RolloutCopy::new(&m16, DType::F64).unwrap();
    let m64 = copy.model();
    let names: Vec<String> = m16.params().into_iter().map(|(n, _)| n).collect();
    for lens in [[40usize, 31], [520, 497]] {
        let batch = TokenBatch::left_padded(&rows(&lens, 8), 0, &Device::Cpu).unwrap();
        let (y, g) = stats_and_grads(&m16, &batch, 24, 5 * 97, Path::Composed(Recompute::On));
        assert_eq!(y.dtype(), DType::F32, "statistics are computed in f32");
        let (yp, gp) = stats_and_grads(&m16, &batch, 24, 5 * 97, Path::Plain);
        let (y0, g0) = stats_and_grads(m64, &batch, 24, 5 * 97, Path::Plain);
        for (i, what) in ["log-prob", "entropy", "collision"].iter().enumerate() {
            let col = |t: &Tensor| t.narrow(2, i, 1).unwrap();
            let (e, ep) = (rel_err(&col(&y), &col(&y0)), rel_err(&col(&yp), &col(&y0)));
            assert!(e < 8.0 * U && e <= 2.0 * ep + U, "{lens:?} {what}: error {e:e}, plain bf16 {ep:e}");
        }
        for (((a, p), r), name) in g.iter().zip(&gp).zip(&g0).zip(&names) {
            assert_eq!(a.dtype(), DType::BF16, "{name}: gradient dtype");
            let (e, ep) = (rel_err(a, r), rel_err(p, r));
            assert!(
                e < 24.0 * U && e <= 2.0 * ep + U,
                "{lens:?} {name}: gradient error {e:e}, plain bf16 {ep:e}"
            );
        }
    }
}
