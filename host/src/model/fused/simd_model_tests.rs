//! The bf16-weight model on the CPU (bf16 weights, f32 activations, see
//! [`super::simd`]) against an f64 model holding the same bf16 values: the
//! prefill (gemm on widened weights) and the decode steps (the bf16 gemv),
//! and the greedy tokens, equal except near ties, which are counted.

use candle_core::{DType, Device, Tensor, D};

use crate::model::{init, Config, KvCache, Qwen3, RolloutCopy, TokenBatch};

fn tiny() -> Qwen3 {
    let text = r#"{"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "tie_word_embeddings": true}"#;
    let cfg = Config::from_json_str(text, "tiny").expect("config");
    init(&cfg, 11, 0.2, DType::F32, &Device::Cpu).expect("init")
}

fn rows(t: &Tensor) -> Vec<Vec<f64>> {
    t.to_dtype(DType::F64).and_then(|t| t.to_vec2::<f64>()).expect("rows")
}

/// Largest |a - b| over all entries, and the largest |b| (the logit scale).
fn diff_scale(a: &[Vec<f64>], b: &[Vec<f64>]) -> (f64, f64) {
    let d = a.iter().flatten().zip(b.iter().flatten()).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    (d, b.iter().flatten().map(|v| v.abs()).fold(0.0, f64::max))
}

/// The logits' tolerance relative to their scale on this CPU's path. With f32
/// activations (AVX2, portable) only f32 rounding of the activations differs from the
/// f64 model: 1e-4. The bf16 dot-product paths (AMX, AVX-512 BF16) round the
/// activations to bf16 at every large product, as PyTorch's autocast does (2^-8
/// relative to the product's `Σ|x w|` each, `mm_bf16::tolerance`): over two layers and
/// the head that stays within 2e-2 of the scale (0.7% measured on AMX).
fn logit_tol() -> f64 {
    if super::simd::cpu_path().bf16_dot() {
        2e-2
    } else {
        1e-4
    }
}

fn argmax(r: &[f64]) -> (usize, f64) {
    let mut s: Vec<(usize, f64)> = r.iter().copied().enumerate().collect();
    s.sort_by(|a, b| b.1.total_cmp(&a.1));
    (s[0].0, s[0].1 - s[1].1)
}

/// Prefill then 12 greedy decode steps of 3 sequences in both models; the
/// f32-accumulated logits stay within [`logit_tol`] of the logit scale of the f64
/// ones (the weights are the same bf16 values, so only the rounding of the
/// activations differs), and the greedy tokens agree except where the f64
/// top-2 margin is under 10x that tolerance (counted; none expected with f32
/// activations).
#[test]
fn bf16_simd_model_decode_matches_f64() {
    let master = tiny();
    let copy = RolloutCopy::new(&master, DType::BF16).expect("bf16 copy");
    let (m16, m64) = (copy.model(), RolloutCopy::new(copy.model(), DType::F64).expect("f64 ref"));
    let m64 = m64.model();
    assert_eq!(m16.activation_dtype(), DType::F32, "bf16 weights on the CPU run f32 activations");
    let prompts = vec![vec![3u32, 14, 15, 92, 65], vec![35, 89, 79, 3, 2], vec![1, 2, 3, 4, 5]];
    let batch = TokenBatch::left_padded(&prompts, 0, &Device::Cpu).expect("batch");
    let (d, s) = diff_scale(
        &rows(&m16.forward(&batch).expect("fwd").flatten_to(1).expect("2d")),
        &rows(&m64.forward(&batch).expect("fwd").flatten_to(1).expect("2d")),
    );
    let tol = logit_tol();
    assert!(d <= tol * s, "prefill logits: {d} vs scale {s}");

    let (mut c16, mut c64) =
        (KvCache::new(m16, 3, 32).expect("cache"), KvCache::new(m64, 3, 32).expect("cache"));
    let ids = Tensor::new(prompts.clone(), &Device::Cpu).expect("ids");
    let (mut l16, mut l64) = (
        m16.decode(&ids, None, &mut c16).expect("prefill"),
        m64.decode(&ids, None, &mut c64).expect("prefill"),
    );
    let (mut flips, mut steps) = (0, 0);
    for _ in 0..12 {
        let (r16, r64) = (rows(&l16), rows(&l64));
        let (d, s) = diff_scale(&r16, &r64);
        assert!(d <= tol * s, "decode logits step {steps}: {d} vs scale {s}");
        let mut next = Vec::new();
        for (a, b) in r16.iter().zip(&r64) {
            let ((ta, _), (tb, margin)) = (argmax(a), argmax(b));
            if ta != tb {
                assert!(margin < 10.0 * tol * s, "greedy token differs at a clear margin {margin}");
                flips += 1;
            }
            // Both models continue with the reference's token.
            next.push(vec![tb as u32]);
        }
        let ids = Tensor::new(next, &Device::Cpu).expect("ids");
        l16 = m16.decode(&ids, None, &mut c16).expect("step");
        l64 = m64.decode(&ids, None, &mut c64).expect("step");
        steps += 1;
    }
    println!("bf16 greedy tokens vs f64: {flips} near-tie flips in {} tokens", steps * 3);
    if !super::simd::cpu_path().bf16_dot() {
        assert_eq!(flips, 0, "no near ties expected in this tiny model");
    }
}

/// The backward through bf16 weights under f32 activations: the weight
/// gradient has the weight's dtype and matches the f64 model's (same bf16
/// weights) within bf16 rounding of the gradient (2^-8 relative) plus f32 noise:
/// 1e-2 of the largest; on the bf16 dot-product paths, which also round the
/// activations and output gradients to bf16 in every product, 5e-2 (1.3% measured on
/// AMX).
#[test]
fn bf16_simd_weight_grads_match_f64() {
    let copy = RolloutCopy::new(&tiny(), DType::BF16).expect("bf16 copy");
    let m64 = RolloutCopy::new(copy.model(), DType::F64).expect("f64 ref");
    let batch =
        TokenBatch::left_padded(&[vec![3, 14, 15, 92], vec![35, 89, 79, 3]], 0, &Device::Cpu).expect("b");
    let grads = |m: &Qwen3| {
        let logits = m
            .forward_hidden(&batch, crate::model::Grad::Track)
            .and_then(|h| m.lm_head(&h, crate::model::Grad::Track))
            .expect("fwd");
        let loss = crate::model::ops::log_softmax(&logits.to_dtype(DType::F64).expect("f64"))
            .and_then(|l| Ok(l.narrow(D::Minus1, 5, 1)?.sum_all()?))
            .expect("loss");
        let g = loss.backward().expect("backward");
        m.params()
            .into_iter()
            .map(|(n, v)| {
                let t = g.get(v.as_tensor()).unwrap_or_else(|| panic!("no gradient for {n}"));
                (
                    n,
                    t.dtype(),
                    t.to_dtype(DType::F64).and_then(|t| t.flatten_all()?.to_vec1::<f64>()).expect("g"),
                )
            })
            .collect::<Vec<_>>()
    };
    let tol = if super::simd::cpu_path().bf16_dot() { 5e-2 } else { 1e-2 };
    for ((n, dt, a), (_, _, b)) in grads(copy.model()).into_iter().zip(grads(m64.model())) {
        assert_eq!(dt, DType::BF16, "{n}: gradient dtype");
        let scale = b.iter().map(|v| v.abs()).fold(0.0, f64::max);
        let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        assert!(d <= tol * scale + 1e-6, "{n}: gradient differs by {d} (scale {scale})");
    }
}
