//! Tests of the sharded optimizer against the unsharded [`AdamW`] (itself proven
//! against hand-computed steps and PyTorch's formula in `adamw.rs`): ranks on
//! threads, each with its own gradients, must give the weights that one AdamW
//! gives the summed gradients; checkpoints re-shard to other world sizes.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use super::sharded::Piece;
use super::*;
use crate::dist::ThreadComm;

const SHAPES: [&[usize]; 4] = [&[7, 13], &[64], &[3, 5, 4], &[33]];
const STEPS: usize = 3;

fn on_ranks<T: Send>(n: usize, f: impl Fn(&ThreadComm) -> T + Sync) -> Vec<T> {
    let comms = ThreadComm::group(n);
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Deterministic values in [-1, 1) (a 64-bit LCG), rounded to bf16 so that f32 and
/// bf16 runs start from and add the same numbers.
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let u = (x >> 40) as f32 / (1u64 << 24) as f32;
            half::bf16::from_f32(2.0 * u - 1.0).to_f32()
        })
        .collect()
}

fn names() -> Vec<String> {
    // The second is a norm weight: no decay.
    vec!["a".into(), "b.norm.weight".into(), "c".into(), "d".into()]
}

fn make_vars(dtype: DType, init: &[Vec<f32>]) -> Vec<Var> {
    SHAPES
        .iter()
        .zip(init)
        .map(|(s, v)| {
            Var::from_tensor(&Tensor::from_slice(v, *s, &Device::Cpu).unwrap().to_dtype(dtype).unwrap())
                .unwrap()
        })
        .collect()
}

fn initial() -> Vec<Vec<f32>> {
    SHAPES.iter().enumerate().map(|(i, s)| values(100 + i as u64, s.iter().product())).collect()
}

/// Rank `rank`'s gradient of parameter `i` at `step`; `None` where the tests leave one
/// out: parameter 1 has none anywhere at step 1, parameter 2 only on rank 0 at step 2.
fn grad(step: usize, rank: usize, i: usize) -> Option<Vec<f32>> {
    if (step == 1 && i == 1) || (step == 2 && i == 2 && rank != 0) {
        return None;
    }
    let n = SHAPES[i].iter().product();
    Some(values((step * 31 + rank * 7 + i) as u64 * 977, n).iter().map(|x| 3.0 * x).collect())
}

fn store(vars: &[Var], dtype: DType, g: impl Fn(usize) -> Option<Vec<f32>>) -> GradStore {
    let mut gs = GradStore::default();
    for (i, v) in vars.iter().enumerate() {
        if let Some(x) = g(i) {
            gs.insert(
                v.as_tensor(),
                Tensor::from_slice(&x, SHAPES[i], &Device::Cpu).unwrap().to_dtype(dtype).unwrap(),
            );
        }
    }
    gs
}

/// The sum over `ranks` ranks, in rank order, as the collectives take it.
fn summed(step: usize, ranks: usize, i: usize) -> Option<Vec<f32>> {
    let parts: Vec<Vec<f32>> = (0..ranks).filter_map(|r| grad(step, r, i)).collect();
    let first = parts.first()?;
    let mut s = vec![0f32; first.len()];
    for p in &parts {
        s.iter_mut().zip(p).for_each(|(a, b)| *a += b);
    }
    Some(s)
}

fn cfg() -> AdamWConfig {
    AdamWConfig { lr: 1e-2, weight_decay: 0.1, max_grad_norm: Some(1.0), ..AdamWConfig::default() }
}

fn flat(vars: &[Var]) -> Vec<f32> {
    vars.iter()
        .flat_map(|v| {
            v.as_tensor().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
        })
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// One AdamW over f32 weights fed the summed gradients of `ranks` ranks: the reference.
fn reference(ranks: usize, steps: std::ops::Range<usize>) -> (Vec<f32>, Vec<StepReport>) {
    let vars = make_vars(DType::F32, &initial());
    let named = names().into_iter().zip(vars.iter().cloned()).collect();
    let mut opt = AdamW::new(named, cfg()).unwrap().with_no_decay(is_norm_or_bias);
    let reports =
        steps.map(|s| opt.step(&store(&vars, DType::F32, |i| summed(s, ranks, i)), 1e-2).unwrap()).collect();
    (flat(&vars), reports)
}

fn sharded(c: &ThreadComm, vars: &[Var], mode: ShardMode, bucket: usize) -> ShardedAdamW {
    let named = names().into_iter().zip(vars.iter().cloned()).collect();
    ShardedAdamW::new(named, cfg(), mode, c.rank(), c.size())
        .unwrap()
        .with_no_decay(is_norm_or_bias)
        .with_bucket_elems(bucket)
}

#[test]
fn layout_ranges_and_pieces_by_hand() {
    // Parameters of 5, 3 and 4 elements over 3 ranks: chunk 4.
    let l = FlatLayout::new([5, 3, 4], 3);
    assert_eq!((l.total(), l.chunk()), (12, 4));
    assert_eq!([l.range(0), l.range(1), l.range(2)], [0..4, 4..8, 8..12]);
    assert_eq!(
        l.pieces(4, 8),
        vec![Piece { param: 0, at: 4, len: 1, flat: 4 }, Piece { param: 1, at: 0, len: 3, flat: 5 }]
    );
    // 10 elements over 4 ranks: chunk 3, the last rank's range is short.
    let l = FlatLayout::new([10], 4);
    assert_eq!([l.range(2), l.range(3)], [6..9, 9..10]);
    // Fewer elements than ranks: the last ranks own nothing.
    let l = FlatLayout::new([1, 1], 3);
    assert_eq!([l.range(0), l.range(1), l.range(2)], [0..1, 1..2, 2..2]);
    assert!(l.pieces(2, 2).is_empty());
}

/// 1, 2 and 3 ranks, ZeRO-1 and ZeRO-2, rounds of 30 elements (several per range):
/// after three steps, with clipping, decay exclusion, a parameter without any
/// gradient and one with a gradient on one rank only, every rank holds the weights
/// of one AdamW fed the summed gradients, and the moments are split by the ranks.
#[test]
fn sharded_steps_equal_adamw_on_summed_gradients() {
    for ranks in 1..=3 {
        let (want, want_reports) = reference(ranks, 0..STEPS);
        for mode in [ShardMode::Optimizer, ShardMode::Gradients] {
            let out = on_ranks(ranks, |c| {
                let vars = make_vars(DType::F32, &initial());
                let mut opt = sharded(c, &vars, mode, 30);
                let mut reports = Vec::new();
                for s in 0..STEPS {
                    let mut gs = store(&vars, DType::F32, |i| grad(s, c.rank(), i));
                    reports.push(opt.step(c, &mut gs, 1e-2).unwrap());
                }
                (flat(&vars), reports, opt.state_bytes())
            });
            let mut bytes = 0;
            for (r, (w, reports, b)) in out.iter().enumerate() {
                let d = max_diff(w, &want);
                assert!(d <= 1e-6, "{ranks} ranks {mode:?} rank {r}: weights differ by {d}");
                for (x, y) in reports.iter().zip(&want_reports) {
                    assert!((x.grad_norm - y.grad_norm).abs() <= 1e-9 * y.grad_norm, "{x:?} vs {y:?}");
                    assert_eq!(x.n_params_without_grad, y.n_params_without_grad);
                    assert!(y.clip_coef < 1.0, "clipping is exercised");
                }
                bytes += b;
            }
            // Two f32 moments per element, split over the ranks.
            assert_eq!(bytes, 8 * want.len(), "{ranks} ranks {mode:?}");
            assert_eq!(out[0].1[1].n_params_without_grad, 1);
        }
    }
}

/// Weights in bf16 with f32 master shards (mixed precision): the master follows the
/// f32 reference, so the bf16 weights stay within one bf16 rounding of it, where
/// bf16 weights updated in place lose every update below half an ulp.
#[test]
fn bf16_weights_with_master_shards_track_f32() {
    let (want, _) = reference(2, 0..STEPS);
    for mode in [ShardMode::Optimizer, ShardMode::Gradients] {
        let out = on_ranks(2, |c| {
            let vars = make_vars(DType::BF16, &initial());
            let mut opt = sharded(c, &vars, mode, 64);
            for s in 0..STEPS {
                let mut gs = store(&vars, DType::BF16, |i| grad(s, c.rank(), i));
                opt.step(c, &mut gs, 1e-2).unwrap();
            }
            assert_eq!(opt.state_bytes(), 12 * opt.range().len(), "moments and master");
            assert_eq!(vars[0].dtype(), DType::BF16);
            flat(&vars)
        });
        for w in &out {
            for (x, y) in w.iter().zip(&want) {
                // One rounding to bf16 (half an ulp, 2^-9 relative), and for ZeRO-1 the
                // summed gradient rounded to bf16 as the unsharded all-reduce rounds it.
                let tol = y.abs() * 2f32.powi(-8) + STEPS as f32 * 1e-2 * 2f32.powi(-7);
                assert!((x - y).abs() <= tol, "{mode:?}: {x} vs {y}");
            }
        }
    }
}

/// Master weights move between the sharded and the unsharded optimizer: a one-rank
/// ZeRO-1 run of bf16 weights saves after two steps, and the unsharded AdamW resumed
/// from it (its master weights read from the shards) takes the third step as the
/// uninterrupted run did; the unsharded state saved then resumes the sharded one again.
#[test]
fn bf16_master_weights_cross_between_sharded_and_unsharded() {
    let dir = tempfile::tempdir().unwrap();
    let shapes: Vec<(String, Vec<usize>)> =
        names().into_iter().zip(SHAPES.iter().map(|s| s.to_vec())).collect();
    let (saved, uninterrupted) = on_ranks(1, |c| {
        let vars = make_vars(DType::BF16, &initial());
        let mut opt = sharded(c, &vars, ShardMode::Optimizer, 40);
        let mut saved = Vec::new();
        for s in 0..STEPS {
            if s == 2 {
                opt.save_shard(dir.path()).unwrap();
                std::fs::write(dir.path().join(INDEX_FILE), serde_json::to_string(&opt.index()).unwrap())
                    .unwrap();
                saved = vars.iter().map(|v| v.as_tensor().copy().unwrap()).collect::<Vec<_>>();
            }
            opt.step(c, &mut store(&vars, DType::BF16, |i| grad(s, 0, i)), 1e-2).unwrap();
        }
        (saved, flat(&vars))
    })
    .remove(0);
    let state = FlatState::open(dir.path(), 0).unwrap();
    let tensors: HashMap<String, Tensor> = state.per_param(&shapes).unwrap();
    assert!(names().iter().all(|n| tensors.contains_key(&format!("{n}.master"))), "master weights read");
    let vars: Vec<Var> = saved.iter().map(|t| Var::from_tensor(&t.copy().unwrap()).unwrap()).collect();
    let named = names().into_iter().zip(vars.iter().cloned()).collect();
    let mut one = AdamW::new(named, cfg()).unwrap().with_no_decay(is_norm_or_bias);
    one.load_state(&tensors, state.step(), "index").unwrap();
    one.step(&store(&vars, DType::BF16, |i| grad(2, 0, i)), 1e-2).unwrap();
    assert_eq!(max_diff(&flat(&vars), &uninterrupted), 0.0, "unsharded resume of a sharded bf16 run");

    // Back: the unsharded state (with `.master`) resumes a sharded run.
    let plain = tempfile::tempdir().unwrap();
    let back: Vec<Var> = saved.iter().map(|t| Var::from_tensor(&t.copy().unwrap()).unwrap()).collect();
    let named = names().into_iter().zip(back.iter().cloned()).collect();
    let mut one = AdamW::new(named, cfg()).unwrap().with_no_decay(is_norm_or_bias);
    one.load_state(&tensors, state.step(), "index").unwrap();
    let st: HashMap<String, Tensor> = one.state_tensors().unwrap().into_iter().collect();
    crate::model::checkpoint::save_safetensors(&st, &plain.path().join(PLAIN_FILE)).unwrap();
    let again = on_ranks(1, |c| {
        let vars: Vec<Var> = saved.iter().map(|t| Var::from_tensor(&t.copy().unwrap()).unwrap()).collect();
        let mut opt = sharded(c, &vars, ShardMode::Optimizer, 40);
        opt.load_from(&FlatState::open(plain.path(), 2).unwrap()).unwrap();
        opt.step(c, &mut store(&vars, DType::BF16, |i| grad(2, 0, i)), 1e-2).unwrap();
        flat(&vars)
    });
    assert_eq!(max_diff(&again[0], &uninterrupted), 0.0, "sharded resume of the unsharded state");
}

/// Two ranks (ZeRO-2) save after two steps; the state resumes on two ranks exactly,
/// and re-cut for three ranks (sharded) and one (the unsharded AdamW) gives the
/// third step of the uninterrupted run.
#[test]
fn checkpoints_reshard_to_other_world_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let uninterrupted = on_ranks(2, |c| {
        let vars = make_vars(DType::F32, &initial());
        let mut opt = sharded(c, &vars, ShardMode::Gradients, 40);
        for s in 0..STEPS {
            if s == 2 {
                opt.save_shard(dir.path()).unwrap();
                if c.rank() == 0 {
                    let text = serde_json::to_string(&opt.index()).unwrap();
                    std::fs::write(dir.path().join(INDEX_FILE), text).unwrap();
                    std::fs::write(
                        dir.path().join("weights.json"),
                        serde_json::to_string(&flat(&vars)).unwrap(),
                    )
                    .unwrap();
                }
            }
            opt.step(c, &mut store(&vars, DType::F32, |i| grad(s, c.rank(), i)), 1e-2).unwrap();
        }
        flat(&vars)
    });
    let saved: Vec<f32> =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("weights.json")).unwrap()).unwrap();
    let split = |w: &[f32]| -> Vec<Vec<f32>> {
        let mut at = 0;
        SHAPES
            .iter()
            .map(|s| {
                let n: usize = s.iter().product();
                at += n;
                w[at - n..at].to_vec()
            })
            .collect()
    };
    let state = FlatState::open(dir.path(), 0).unwrap();
    // The third step's gradients are those of the two-rank run, whatever the new ranks.
    let third = |vars: &[Var]| store(vars, DType::F32, |i| summed(2, 2, i));
    for ranks in [2, 3] {
        let out = on_ranks(ranks, |c| {
            let vars = make_vars(DType::F32, &split(&saved));
            let mut opt = sharded(c, &vars, ShardMode::Gradients, 40);
            opt.load_from(&state).unwrap();
            assert_eq!(opt.step_count(), 2);
            // Rank 0 brings the summed gradient, the others zeros: the same sum.
            let mut gs = if c.rank() == 0 {
                third(&vars)
            } else {
                store(&vars, DType::F32, |i| summed(2, 2, i).map(|g| vec![0.0; g.len()]))
            };
            opt.step(c, &mut gs, 1e-2).unwrap();
            flat(&vars)
        });
        for w in &out {
            let d = max_diff(w, &uninterrupted[0]);
            assert!(d <= if ranks == 2 { 0.0 } else { 1e-6 }, "{ranks} ranks: {d}");
        }
    }
    let vars = make_vars(DType::F32, &split(&saved));
    let shapes: Vec<(String, Vec<usize>)> =
        names().into_iter().zip(SHAPES.iter().map(|s| s.to_vec())).collect();
    let named = names().into_iter().zip(vars.iter().cloned()).collect();
    let mut one = AdamW::new(named, cfg()).unwrap().with_no_decay(is_norm_or_bias);
    let tensors: HashMap<String, Tensor> = state.per_param(&shapes).unwrap();
    one.load_state(&tensors, state.step(), "index").unwrap();
    one.step(&third(&vars), 1e-2).unwrap();
    let d = max_diff(&flat(&vars), &uninterrupted[0]);
    assert!(d <= 1e-6, "one unsharded rank: {d}");
}

/// A checkpoint of other parameters is refused, naming the first difference.
#[test]
fn foreign_checkpoint_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    on_ranks(1, |c| {
        let vars = make_vars(DType::F32, &initial());
        let opt = sharded(c, &vars, ShardMode::Optimizer, 40);
        opt.save_shard(dir.path()).unwrap();
        let mut index = opt.index();
        index.params[2].numel += 1;
        std::fs::write(dir.path().join(INDEX_FILE), serde_json::to_string(&index).unwrap()).unwrap();
        let mut fresh = sharded(c, &vars, ShardMode::Optimizer, 40);
        let err = fresh.load_from(&FlatState::open(dir.path(), 0).unwrap()).unwrap_err().to_string();
        assert!(err.contains("first difference at position 2"), "{err}");
    });
}

/// AdamW's guards hold over shards: a learning rate whose decay would flip every weight
/// is an error, and an update that would leave a weight non-finite in one rank's range
/// only (parameter `d`, which lies in rank 1's half) skips the step on every rank, names
/// the parameter on every rank, and changes nothing anywhere.
#[test]
fn nonfinite_update_in_one_range_skips_every_rank() {
    for mode in [ShardMode::Optimizer, ShardMode::Gradients] {
        let reports = on_ranks(2, |c| {
            let mut init = initial();
            init[3][0] = f32::INFINITY;
            let vars = make_vars(DType::F32, &init);
            let mut opt = sharded(c, &vars, mode, 1 << 20);
            let err = opt.step(c, &mut store(&vars, DType::F32, |i| grad(0, c.rank(), i)), 20.0).unwrap_err();
            assert!(err.to_string().contains("weight_decay"), "{err}");
            let before = flat(&vars);
            let r = opt.step(c, &mut store(&vars, DType::F32, |i| grad(0, c.rank(), i)), 1e-2).unwrap();
            let after = flat(&vars);
            let unchanged = before.iter().zip(&after).all(|(a, b)| a == b || (a.is_nan() && b.is_nan()));
            (r, unchanged, opt.step_count())
        });
        for (rank, (r, unchanged, steps)) in reports.iter().enumerate() {
            assert!(r.skipped && r.grad_norm.is_finite(), "{mode:?} rank {rank}: {r:?}");
            assert_eq!(r.nonfinite_param.as_deref(), Some("d"), "{mode:?} rank {rank}");
            assert!(*unchanged && *steps == 0, "{mode:?} rank {rank}: weights changed or step counted");
        }
    }
}
