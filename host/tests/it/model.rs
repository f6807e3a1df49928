//! The Qwen3 model against references: candle-transformers' inference model,
//! padded vs unpadded rows, cached vs full decode, finite differences, and
//! checkpoints written and read back.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use stapo::model::{self, Config, Grad, KvCache, TokenBatch};

use crate::common::{max_abs_diff, tempdir, tiny_config, tiny_model};

fn ids(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + seed * 11 + 5) % 97).collect()
}

#[test]
fn logits_match_candle_transformers_qwen3() {
    for tied in [true, false] {
        let m = tiny_model(tied, DType::F32, 3);
        let tensors: HashMap<String, Tensor> =
            m.params().into_iter().map(|(n, v)| (n, v.as_tensor().detach())).collect();
        let c = m.config();
        let ref_cfg = candle_transformers::models::qwen3::Config {
            vocab_size: c.vocab_size,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            num_hidden_layers: c.num_hidden_layers,
            num_attention_heads: c.num_attention_heads,
            head_dim: c.head_dim,
            attention_bias: false,
            num_key_value_heads: c.num_key_value_heads,
            max_position_embeddings: c.max_position_embeddings,
            sliding_window: None,
            max_window_layers: c.num_hidden_layers,
            tie_word_embeddings: c.tie_word_embeddings,
            rope_theta: c.rope_theta,
            rms_norm_eps: c.rms_norm_eps,
            use_sliding_window: false,
            hidden_act: candle_nn::Activation::Silu,
        };
        let vb = candle_nn::VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
        let mut reference = candle_transformers::models::qwen3::ModelForCausalLM::new(&ref_cfg, vb).unwrap();
        let seq = ids(11, 1);
        // The reference returns last-position logits only: compare every prefix.
        let batch = TokenBatch::left_padded(std::slice::from_ref(&seq), 0, &Device::Cpu).unwrap();
        let ours = m.forward(&batch).unwrap().squeeze(0).unwrap();
        for len in [1, 5, 11] {
            reference.clear_kv_cache();
            let input = Tensor::new(&seq[..len], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
            let theirs = reference.forward(&input, 0).unwrap().flatten_all().unwrap();
            let d = max_abs_diff(&ours.get(len - 1).unwrap(), &theirs);
            assert!(d < 1e-4, "tied={tied} prefix {len}: max |diff| {d}");
        }
    }
}

#[test]
fn left_padded_row_equals_unpadded_row() {
    let m = tiny_model(true, DType::F32, 5);
    let short = ids(6, 2);
    let long = ids(13, 3);
    let padded = TokenBatch::left_padded(&[short.clone(), long.clone()], 0, &Device::Cpu).unwrap();
    let logits = m.forward(&padded).unwrap();
    let alone =
        m.forward(&TokenBatch::left_padded(std::slice::from_ref(&short), 0, &Device::Cpu).unwrap()).unwrap();
    let row = logits.get(0).unwrap().narrow(0, 13 - 6, 6).unwrap();
    let d = max_abs_diff(&row, &alone.get(0).unwrap());
    assert!(d < 1e-5, "padded vs unpadded: {d}");
    assert!(logits.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().all(|x| x.is_finite()));
}

#[test]
fn cached_decode_equals_full_recompute() {
    let m = tiny_model(false, DType::F32, 7);
    let prompts = [ids(4, 1), ids(9, 2), ids(6, 3)];
    let cont = [ids(5, 7), ids(5, 8), ids(5, 9)];
    let mut cache = KvCache::new(&m, 3, 9 + 5).unwrap();
    let prefill = TokenBatch::left_padded(&prompts, 0, &Device::Cpu).unwrap();
    let mut step_logits = vec![m.decode(&prefill.ids, Some(&prefill.mask), &mut cache).unwrap()];
    for t in 0..5 {
        let next: Vec<u32> = cont.iter().map(|c| c[t]).collect();
        let next = Tensor::from_vec(next, (3, 1), &Device::Cpu).unwrap();
        step_logits.push(m.decode(&next, None, &mut cache).unwrap());
    }
    for r in 0..3 {
        let full: Vec<u32> = prompts[r].iter().chain(&cont[r]).copied().collect();
        let logits = m
            .forward(&TokenBatch::left_padded(&[full], 0, &Device::Cpu).unwrap())
            .unwrap()
            .squeeze(0)
            .unwrap();
        let p = prompts[r].len();
        for (t, sl) in step_logits.iter().enumerate() {
            let d = max_abs_diff(&sl.get(r).unwrap(), &logits.get(p - 1 + t).unwrap());
            assert!(d < 1e-4, "row {r} step {t}: {d}");
        }
    }
    assert_eq!(cache.batch(), 3);
}

/// Negative log-likelihood of `targets` over the real (non-padding) positions.
/// Padding rows are excluded as in training: their all-masked attention rows sit
/// at -1e9, where f64 rounding would swamp a finite difference.
fn loss_of(m: &model::Qwen3, batch: &TokenBatch, targets: &Tensor) -> Tensor {
    let logits = m.forward(batch).unwrap();
    let (logp, _) = model::logprob_entropy(&logits, targets).unwrap();
    let mask: Vec<f32> = batch.mask.iter().flatten().map(|&x| x as f32).collect();
    let mask = Tensor::from_vec(mask, logp.shape(), &Device::Cpu).unwrap().to_dtype(logp.dtype()).unwrap();
    (logp * mask).unwrap().sum_all().unwrap().neg().unwrap()
}

#[test]
fn every_parameter_gets_a_nonzero_gradient() {
    for tied in [true, false] {
        let m = tiny_model(tied, DType::F32, 11);
        let batch = TokenBatch::left_padded(&[ids(7, 1), ids(10, 4)], 0, &Device::Cpu).unwrap();
        let targets = Tensor::from_vec(ids(20, 9), (2, 10), &Device::Cpu).unwrap();
        let grads = loss_of(&m, &batch, &targets).backward().unwrap();
        for (name, var) in m.params() {
            let g = grads.get(var.as_tensor()).unwrap_or_else(|| panic!("no gradient for {name}"));
            let norm = g.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(norm > 0.0 && norm.is_finite(), "{name}: |grad|^2 = {norm}");
        }
    }
}

#[test]
fn gradients_match_finite_differences() {
    // f64 so central differences are accurate to ~1e-8.
    let m = tiny_model(false, DType::F64, 13);
    let batch = TokenBatch::left_padded(&[ids(5, 1), ids(8, 2)], 0, &Device::Cpu).unwrap();
    let targets = Tensor::from_vec(ids(16, 5), (2, 8), &Device::Cpu).unwrap();
    let grads = loss_of(&m, &batch, &targets).backward().unwrap();
    let params: HashMap<String, candle_core::Var> = m.params().into_iter().collect();
    let probes = [
        ("model.embed_tokens.weight", 53 * 64 + 3),
        ("model.layers.0.self_attn.q_proj.weight", 17),
        ("model.layers.1.self_attn.q_proj.weight", 17),
        ("model.layers.0.self_attn.k_proj.weight", 17),
        ("model.layers.0.self_attn.q_norm.weight", 3),
        ("model.layers.0.self_attn.o_proj.weight", 17),
        ("model.layers.1.self_attn.k_norm.weight", 4),
        ("model.layers.0.self_attn.v_proj.weight", 100),
        ("model.layers.1.mlp.down_proj.weight", 250),
        ("model.layers.0.input_layernorm.weight", 9),
        ("model.norm.weight", 31),
        ("lm_head.weight", 64 * 7 + 2),
    ];
    let h = 1e-5;
    for (name, idx) in probes {
        let var = &params[name];
        let orig = var.as_tensor().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let analytic =
            grads.get(var.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()[idx];
        let eval = |delta: f64| {
            let mut w = orig.clone();
            w[idx] += delta;
            var.set(&Tensor::from_vec(w, var.shape(), &Device::Cpu).unwrap()).unwrap();
            loss_of(&m, &batch, &targets).to_scalar::<f64>().unwrap()
        };
        let numeric = (eval(h) - eval(-h)) / (2.0 * h);
        eval(0.0);
        let err = (analytic - numeric).abs() / analytic.abs().max(1e-3);
        assert!(err < 1e-5, "{name}[{idx}]: analytic {analytic} numeric {numeric}");
    }
}

fn logits_of(m: &model::Qwen3) -> Tensor {
    let batch = TokenBatch::left_padded(&[ids(9, 4)], 0, &Device::Cpu).unwrap();
    let h = m.forward_hidden(&batch, Grad::Off).unwrap();
    m.lm_head(&h, Grad::Off).unwrap().to_dtype(DType::F32).unwrap()
}

#[test]
fn save_then_load_gives_identical_logits() {
    let dir = tempdir();
    for tied in [true, false] {
        let m = tiny_model(tied, DType::F32, 17);
        let out = dir.path().join(format!("f32-{tied}"));
        model::save(&m, &out, DType::F32, None).unwrap();
        let back = model::load(&out, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(max_abs_diff(&logits_of(&m), &logits_of(&back)), 0.0);
        let names: Vec<String> = back.params().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names.contains(&"lm_head.weight".to_string()), !tied);

        // bf16 on disk: loading it twice (as bf16, and as f32 after a round trip) agrees exactly,
        // and stays close to the f32 original.
        let out16 = dir.path().join(format!("bf16-{tied}"));
        model::save(&m, &out16, DType::BF16, None).unwrap();
        let cfg = model::Config::from_file(&out16.join("config.json")).unwrap();
        assert_eq!(cfg.torch_dtype, "bfloat16");
        let as_bf16 = model::load(&out16, DType::BF16, &Device::Cpu).unwrap();
        let again = dir.path().join(format!("bf16-again-{tied}"));
        model::save(&as_bf16, &again, DType::BF16, None).unwrap();
        let as_bf16_again = model::load(&again, DType::BF16, &Device::Cpu).unwrap();
        assert_eq!(max_abs_diff(&logits_of(&as_bf16), &logits_of(&as_bf16_again)), 0.0);
        let as_f32 = model::load(&out16, DType::F32, &Device::Cpu).unwrap();
        let d = max_abs_diff(&logits_of(&m), &logits_of(&as_f32));
        assert!(d > 0.0 && d < 0.1, "bf16 rounding moved logits by {d}");
    }
}

#[test]
fn saving_over_an_existing_folder_replaces_it_atomically() {
    let dir = tempdir();
    let out = dir.path().join("m");
    model::save(&tiny_model(true, DType::F32, 1), &out, DType::F32, None).unwrap();
    let m2 = tiny_model(true, DType::F32, 2);
    model::save(&m2, &out, DType::F32, None).unwrap();
    let back = model::load(&out, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(max_abs_diff(&logits_of(&m2), &logits_of(&back)), 0.0);
    let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(leftovers.len(), 1, "temporary folders left behind: {leftovers:?}");
}

#[test]
fn sharded_folder_loads() {
    let dir = tempdir();
    let m = tiny_model(false, DType::F32, 19);
    let out = dir.path().join("sharded");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::copy(
        {
            let single = dir.path().join("single");
            model::save(&m, &single, DType::F32, None).unwrap();
            single.join("config.json")
        },
        out.join("config.json"),
    )
    .unwrap();
    let params = m.params();
    let (a, b) = params.split_at(params.len() / 2);
    let mut weight_map = serde_json::Map::new();
    for (file, part) in [("model-00001-of-00002.safetensors", a), ("model-00002-of-00002.safetensors", b)] {
        let tensors: HashMap<String, Tensor> = part
            .iter()
            .map(|(n, v)| {
                weight_map.insert(n.clone(), file.into());
                (n.clone(), v.as_tensor().to_dtype(DType::BF16).unwrap())
            })
            .collect();
        candle_core::safetensors::save(&tensors, out.join(file)).unwrap();
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(out.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let back = model::load(&out, DType::F32, &Device::Cpu).unwrap();
    let d = max_abs_diff(&logits_of(&m), &logits_of(&back));
    assert!(d < 0.1, "sharded bf16 load: {d}");
}

#[test]
fn bad_checkpoints_give_errors_that_name_the_problem() {
    let dir = tempdir();
    let m = tiny_model(true, DType::F32, 23);
    let good = dir.path().join("good");
    model::save(&m, &good, DType::F32, None).unwrap();
    let st = good.join("model.safetensors");
    let all: HashMap<String, Tensor> = candle_core::safetensors::load(&st, &Device::Cpu).unwrap();

    // Missing tensor: its name.
    let missing = dir.path().join("missing");
    std::fs::create_dir_all(&missing).unwrap();
    std::fs::copy(good.join("config.json"), missing.join("config.json")).unwrap();
    let mut t = all.clone();
    t.remove("model.layers.1.mlp.up_proj.weight");
    candle_core::safetensors::save(&t, missing.join("model.safetensors")).unwrap();
    let err = model::load(&missing, DType::F32, &Device::Cpu).err().unwrap().to_string();
    assert!(err.contains("missing tensor") && err.contains("model.layers.1.mlp.up_proj.weight"), "{err}");

    // Wrong shape: name, expected, found.
    let wrong = dir.path().join("wrong");
    std::fs::create_dir_all(&wrong).unwrap();
    std::fs::copy(good.join("config.json"), wrong.join("config.json")).unwrap();
    let mut t = all.clone();
    t.insert("model.norm.weight".into(), Tensor::ones(65, DType::F32, &Device::Cpu).unwrap());
    candle_core::safetensors::save(&t, wrong.join("model.safetensors")).unwrap();
    let err = model::load(&wrong, DType::F32, &Device::Cpu).err().unwrap().to_string();
    assert!(err.contains("model.norm.weight") && err.contains("[65]") && err.contains("[64]"), "{err}");

    // Unreadable file.
    let broken = dir.path().join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::copy(good.join("config.json"), broken.join("config.json")).unwrap();
    std::fs::write(broken.join("model.safetensors"), b"not a safetensors file").unwrap();
    let err = model::load(&broken, DType::F32, &Device::Cpu).err().unwrap().to_string();
    assert!(err.contains("model.safetensors") && err.contains("unreadable"), "{err}");

    // No weights at all, and no config.
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let err = model::load(&empty, DType::F32, &Device::Cpu).err().unwrap().to_string();
    assert!(err.contains("config.json"), "{err}");
    std::fs::copy(good.join("config.json"), empty.join("config.json")).unwrap();
    let err = model::load(&empty, DType::F32, &Device::Cpu).err().unwrap().to_string();
    assert!(err.contains("no model.safetensors"), "{err}");
}

#[test]
fn logprob_entropy_matches_hand_computation() {
    // logits [0, ln 2, ln 3]: p = [1, 2, 3] / 6.
    let logits = Tensor::new(&[[0.0f32, 2f32.ln(), 3f32.ln()]], &Device::Cpu).unwrap();
    let targets = Tensor::new(&[2u32], &Device::Cpu).unwrap();
    let (logp, h) = model::logprob_entropy(&logits, &targets).unwrap();
    let logp = logp.to_vec1::<f32>().unwrap()[0] as f64;
    let h = h.to_vec1::<f32>().unwrap()[0] as f64;
    let p = [1.0 / 6.0, 2.0 / 6.0, 3.0 / 6.0];
    let expected_h: f64 = -p.iter().map(|p: &f64| p * p.ln()).sum::<f64>();
    assert!((logp - 0.5f64.ln()).abs() < 1e-6);
    assert!((h - expected_h).abs() < 1e-6);
}

/// A loss over every statistic of the chunked head, masked to real positions.
fn stats_loss(m: &model::Qwen3, batch: &TokenBatch, targets: &Tensor, chunked: bool) -> Tensor {
    let hidden = m.forward_hidden(batch, Grad::Track).unwrap();
    let (logp, ent, coll) = if chunked {
        let s = m.token_stats(&hidden, targets, Grad::Track).unwrap();
        (s.logp, s.entropy, s.collision)
    } else {
        // The composed path on full (B, T, V) logits.
        let logits = m.lm_head(&hidden, Grad::Track).unwrap();
        let (lp, h) = model::ops::logprob_entropy_composed(&logits, targets).unwrap();
        let coll = model::ops::softmax(&logits).unwrap().sqr().unwrap().sum(2).unwrap();
        (lp, h, coll)
    };
    let mask: Vec<f32> = batch.mask.iter().flatten().map(|&x| x as f32).collect();
    let mask = Tensor::from_vec(mask, logp.shape(), &Device::Cpu).unwrap().to_dtype(logp.dtype()).unwrap();
    let mix = ((logp + ent.affine(0.3, 0.0).unwrap()).unwrap() + coll.affine(2.0, 0.0).unwrap()).unwrap();
    (mix * mask).unwrap().sum_all().unwrap()
}

/// Max |a - b| over max |b| across every parameter's gradient.
fn grad_rel_diff(
    m: &model::Qwen3,
    a: &candle_core::backprop::GradStore,
    b: &candle_core::backprop::GradStore,
) -> f64 {
    let (mut num, mut den) = (0f64, 1e-30f64);
    for (name, var) in m.params() {
        let ga = a.get(var.as_tensor()).unwrap_or_else(|| panic!("no gradient for {name}"));
        let gb = b.get(var.as_tensor()).unwrap_or_else(|| panic!("no reference gradient for {name}"));
        num = num.max(max_abs_diff(ga, gb));
        den = den.max(
            gb.abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .to_scalar::<f64>()
                .unwrap(),
        );
    }
    num / den
}

#[test]
fn chunked_head_matches_full_logits_tied_and_untied() {
    for tied in [true, false] {
        let m = tiny_model(tied, DType::F64, 12);
        let batch = TokenBatch::left_padded(&[ids(7, 1), ids(10, 4)], 0, &Device::Cpu).unwrap();
        let targets = Tensor::from_vec(ids(20, 9), (2, 10), &Device::Cpu).unwrap();
        let (a, b) = (stats_loss(&m, &batch, &targets, true), stats_loss(&m, &batch, &targets, false));
        assert!(max_abs_diff(&a, &b) < 1e-9 * b.abs().unwrap().to_scalar::<f64>().unwrap().max(1.0));
        let e = grad_rel_diff(&m, &a.backward().unwrap(), &b.backward().unwrap());
        assert!(e < 1e-10, "tied={tied}: gradient error {e:e}");
    }
}

#[test]
fn recomputed_layers_give_the_same_gradients() {
    for tied in [true, false] {
        let m = tiny_model(tied, DType::F32, 13);
        let batch = TokenBatch::left_padded(&[ids(7, 1), ids(10, 4)], 0, &Device::Cpu).unwrap();
        let targets = Tensor::from_vec(ids(20, 9), (2, 10), &Device::Cpu).unwrap();
        m.set_recompute(model::Recompute::Off);
        let la = stats_loss(&m, &batch, &targets, true);
        let plain = la.backward().unwrap();
        m.set_recompute(model::Recompute::On);
        let lb = stats_loss(&m, &batch, &targets, true);
        let recomputed = lb.backward().unwrap();
        assert_eq!(max_abs_diff(&la, &lb), 0.0, "same loss");
        let e = grad_rel_diff(&m, &recomputed, &plain);
        assert!(e < 1e-6, "tied={tied}: gradient difference {e:e}");
        // Auto recomputes from 4 GiB of kept activations: 2.87 MB per token
        // in f32 at the Qwen3-0.6B shape (28 layers of 6 x 1024 + 3 x 2048 +
        // 4 x 1024 + 3 x 3072 values), so from 1498 tokens there.
        let c = Config {
            hidden_size: 1024,
            intermediate_size: 3072,
            num_hidden_layers: 28,
            num_attention_heads: 16,
            num_key_value_heads: 8,
            head_dim: 128,
            ..tiny_config(false)
        };
        assert_eq!(model::recompute::activation_bytes(&c, 4), 28 * 25_600 * 4);
        assert!(!model::Recompute::Auto.active(1497, &c, 4));
        assert!(model::Recompute::Auto.active(1498, &c, 4));
        assert!(!model::Recompute::Auto.active(2 * 1496, &c, 2), "bf16 keeps half the bytes");
        assert!(!model::Recompute::Off.active(1 << 20, &c, 4));
        assert!(model::Recompute::On.active(1, &c, 4));
    }
}

/// `stapo parity` on the CPU with a bf16 rollout copy: the copy's log-probs stay
/// within bf16 tolerance of the f32 model before and after an update (the copy
/// refreshed from the f32 master), and the device-side sampler draws what the
/// host sampler draws.
#[test]
fn parity_command_passes_for_a_bf16_rollout_copy_on_the_cpu() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_stapo"))
        .args(["parity", "--device", "cpu", "--dtype", "bfloat16", "--layers", "2", "--hidden", "128"])
        .args(["--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--intermediate", "256"])
        .args(["--vocab", "1000", "--batch", "4", "--seq", "32"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("log-probs after the update (bfloat16 copy)"), "{stdout}");
    assert!(stdout.contains("parity: all checks passed"), "{stdout}");
    assert!(!stdout.contains("FAIL"), "{stdout}");
}
