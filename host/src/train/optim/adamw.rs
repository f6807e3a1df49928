//! The optimizer: [`AdamW`] over named parameters, its step (global-norm clipping
//! folded into the update), saved state, and the device-generic update path.

use std::collections::{HashMap, HashSet};

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use serde::Serialize;

use super::config::AdamWConfig;
use super::kernels::{fused_stays_finite, fused_supported, grad_sum_sq, update_fused};
use super::state::{hyper, Hyper, ParamState};
use crate::{Error, Result};

/// What one call to [`AdamW::step`] did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepReport {
    /// Global L2 norm of all gradients, before clipping (may be NaN/inf).
    pub grad_norm: f64,
    /// True when the gradient norm, or the updated value of a parameter or moment, was
    /// not finite, and nothing was changed.
    pub skipped: bool,
    /// The first parameter whose update would have left a non-finite weight or moment
    /// (e.g. a learning rate so large that weight decay overflows); `None` otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nonfinite_param: Option<String>,
    /// The factor the gradients were scaled by (1 when not clipped, 0 when skipped).
    pub clip_coef: f64,
    /// Parameters that had no gradient in the store, and were left untouched.
    pub n_params_without_grad: usize,
}

/// AdamW over named parameters, updated in place. See the module docs.
pub struct AdamW {
    params: Vec<ParamState>,
    cfg: AdamWConfig,
    step: u64,
    /// Tests set this to run the device-generic path on the CPU.
    force_generic: bool,
}

impl std::fmt::Debug for AdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdamW")
            .field("n_params", &self.params.len())
            .field("n_elements", &self.n_elements())
            .field("cfg", &self.cfg)
            .field("step", &self.step)
            .finish()
    }
}

impl AdamW {
    /// Creates the optimizer with zeroed moments (f32, on each parameter's device).
    /// Names must be unique; they key the saved state.
    pub fn new(params: Vec<(String, Var)>, cfg: AdamWConfig) -> Result<Self> {
        cfg.validate()?;
        let mut seen = HashSet::new();
        let mut states = Vec::with_capacity(params.len());
        for (name, var) in params {
            if !seen.insert(name.clone()) {
                return Err(Error::invalid(format!("adamw: parameter name `{name}` appears twice")));
            }
            if !var.dtype().is_float() {
                return Err(Error::invalid(format!(
                    "adamw: parameter `{name}` has dtype {:?}, expected a float dtype",
                    var.dtype()
                )));
            }
            let m = Var::zeros(var.shape(), DType::F32, var.device())?;
            let v = Var::zeros(var.shape(), DType::F32, var.device())?;
            let master = master_of(&var)?;
            states.push(ParamState { name, var, master, m, v, steps: 0, decay: true });
        }
        Ok(Self { params: states, cfg, step: 0, force_generic: false })
    }

    /// Excludes from weight decay every parameter whose name satisfies `no_decay`
    /// (e.g. [`is_norm_or_bias`](super::is_norm_or_bias)).
    pub fn with_no_decay(mut self, no_decay: impl Fn(&str) -> bool) -> Self {
        for p in &mut self.params {
            p.decay = !no_decay(&p.name);
        }
        self
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.cfg
    }

    /// Replaces the hyper-parameters (e.g. after a script reload); the state is kept.
    pub fn set_config(&mut self, cfg: AdamWConfig) -> Result<()> {
        cfg.validate()?;
        self.cfg = cfg;
        Ok(())
    }

    /// Optimizer steps taken (skipped steps are not counted).
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// The parameters, by name, in construction order.
    pub fn params(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.params.iter().map(|p| (p.name.as_str(), &p.var))
    }

    /// Total number of parameter elements.
    pub fn n_elements(&self) -> usize {
        self.params.iter().map(|p| p.var.elem_count()).sum()
    }

    /// Elements with f32 master weights (the parameters that are not f32).
    pub fn n_master_elements(&self) -> usize {
        self.params.iter().filter(|p| p.master.is_some()).map(|p| p.var.elem_count()).sum()
    }

    /// The f32 master weights of parameter `name`, when it has them (a parameter that
    /// is not f32); the parameter itself is their rounding.
    pub fn master(&self, name: &str) -> Option<&Var> {
        self.params.iter().find(|p| p.name == name).and_then(|p| p.master.as_ref())
    }

    /// Global L2 norm of the gradients of this optimizer's parameters (f64
    /// accumulation, one read-only pass per gradient), and how many parameters
    /// have no gradient. Fails if a gradient's shape differs from its parameter's.
    pub fn grad_norm(&self, grads: &GradStore) -> Result<(f64, usize)> {
        let mut sum_sq = 0f64;
        let mut missing = 0;
        for p in &self.params {
            let Some(g) = grads.get(&p.var) else {
                missing += 1;
                continue;
            };
            if g.dims() != p.var.dims() {
                return Err(Error::Shape {
                    file: "gradients".into(),
                    name: p.name.clone(),
                    expected: p.var.dims().to_vec(),
                    found: g.dims().to_vec(),
                });
            }
            sum_sq += grad_sum_sq(g)?;
        }
        Ok((sum_sq.sqrt(), missing))
    }

    /// One AdamW step at learning rate `lr` (the caller applies the schedule).
    ///
    /// Computes the global gradient norm; if it is not finite, returns `skipped = true`
    /// with weights, moments and step counts untouched. Otherwise clips (as a scale
    /// folded into the update) and checks, in a read-only pass with the update's own
    /// arithmetic, that every new weight and moment would be finite: if one would not
    /// (a learning rate so large that weight decay overflows), it returns `skipped =
    /// true` naming the parameter, again with nothing changed. Otherwise it updates
    /// every parameter that has a gradient; parameters without one are counted in the
    /// report and left as they are.
    pub fn step(&mut self, grads: &GradStore, lr: f64) -> Result<StepReport> {
        check_lr(&self.cfg, lr)?;
        let (grad_norm, missing) = self.grad_norm(grads)?;
        // The caller reports a skip (the library prints nothing): `report.skipped`.
        let Some(clip_coef) = clip_coef(&self.cfg, grad_norm) else {
            return Ok(StepReport::skipped(grad_norm, None, missing));
        };
        if let Some(name) = self.first_nonfinite_update(grads, lr, clip_coef)? {
            return Ok(StepReport::skipped(grad_norm, Some(name), missing));
        }
        let cfg = self.cfg.clone();
        let force_generic = self.force_generic;
        for p in &mut self.params {
            let Some(g) = grads.get(&p.var) else { continue };
            p.steps += 1;
            let h = hyper(&cfg, lr, p.steps, p.decay, clip_coef);
            if !force_generic && fused_supported(p.trained()) {
                update_fused(p, g, &h)?;
            } else {
                update_generic(p, g, &h)?;
            }
            p.write_back()?;
        }
        self.step += 1;
        Ok(StepReport::applied(grad_norm, clip_coef, missing))
    }

    /// The first parameter whose update at `lr` (gradients scaled by `clip_coef`) would
    /// leave a non-finite weight or moment, computed as [`AdamW::step`] would compute it,
    /// without writing anything: the guard that keeps a diverging step from ever reaching
    /// the weights, at the cost of one read-only pass over them.
    fn first_nonfinite_update(&self, grads: &GradStore, lr: f64, clip_coef: f64) -> Result<Option<String>> {
        for p in &self.params {
            let Some(g) = grads.get(&p.var) else { continue };
            let h = hyper(&self.cfg, lr, p.steps + 1, p.decay, clip_coef);
            if !update_stays_finite(p.trained(), g, &p.m, &p.v, &h, !self.force_generic)? {
                return Ok(Some(p.name.clone()));
            }
        }
        Ok(None)
    }

    /// The optimizer state as named tensors, for `optimizer.safetensors`:
    /// `{name}.exp_avg` and `{name}.exp_avg_sq` (f32, the parameter's shape),
    /// `{name}.step` (an i64 scalar), and `{name}.master` (f32) for a parameter with
    /// master weights. Save [`AdamW::step_count`] alongside.
    ///
    /// The moment tensors share storage with the live state (no copy): write them
    /// out before the next [`AdamW::step`], or `copy()` them to keep a snapshot.
    pub fn state_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::with_capacity(3 * self.params.len());
        for p in &self.params {
            out.push((format!("{}.exp_avg", p.name), p.m.as_tensor().clone()));
            out.push((format!("{}.exp_avg_sq", p.name), p.v.as_tensor().clone()));
            let steps = i64::try_from(p.steps)
                .map_err(|_| Error::invalid(format!("adamw: step count of `{}` overflows i64", p.name)))?;
            out.push((format!("{}.step", p.name), Tensor::new(steps, &candle_core::Device::Cpu)?));
            if let Some(w) = &p.master {
                out.push((format!("{}.master", p.name), w.as_tensor().clone()));
            }
        }
        Ok(out)
    }

    /// Restores state saved by [`AdamW::state_tensors`]; `step` is the saved
    /// [`AdamW::step_count`] and `file` names the source in errors.
    ///
    /// Every parameter needs `{name}.exp_avg` and `{name}.exp_avg_sq` of its shape
    /// (any float dtype, any device: they are converted and copied into this
    /// optimizer's own storage). A missing `{name}.step` falls back to `step`.
    /// Tensors for other names are ignored (e.g. parameters now frozen). Nothing
    /// is changed unless every tensor checks out.
    ///
    /// A parameter with master weights takes `{name}.master` when the file has it, and
    /// is set to its rounding; without it (state saved by an f32 run, or before master
    /// weights existed) the master weights start from the parameter as it is. An f32
    /// parameter ignores a saved master.
    pub fn load_state(&mut self, tensors: &HashMap<String, Tensor>, step: u64, file: &str) -> Result<()> {
        let get = |name: String, shape: &[usize]| -> Result<Tensor> {
            let t = tensors
                .get(&name)
                .ok_or_else(|| Error::MissingTensor { file: file.into(), name: name.clone() })?;
            if t.dims() != shape {
                return Err(Error::Shape {
                    file: file.into(),
                    name,
                    expected: shape.to_vec(),
                    found: t.dims().to_vec(),
                });
            }
            Ok(t.clone())
        };
        let mut loaded = Vec::with_capacity(self.params.len());
        for p in &self.params {
            let dims = p.var.dims();
            let m = get(format!("{}.exp_avg", p.name), dims)?;
            let v = get(format!("{}.exp_avg_sq", p.name), dims)?;
            let steps = match tensors.get(&format!("{}.step", p.name)) {
                None => step,
                Some(t) => {
                    let vals = t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
                    match vals.as_slice() {
                        [s] if s.is_finite() && *s >= 0.0 && s.fract() == 0.0 => *s as u64,
                        _ => {
                            return Err(Error::invalid(format!(
                            "{file}: tensor `{}.step` should hold one non-negative integer, found {vals:?}",
                            p.name
                        )))
                        }
                    }
                }
            };
            let master = match (&p.master, tensors.contains_key(&format!("{}.master", p.name))) {
                (Some(_), true) => Some(get(format!("{}.master", p.name), dims)?),
                _ => None,
            };
            loaded.push((m, v, steps, master));
        }
        for (p, (m, v, steps, master)) in self.params.iter_mut().zip(loaded) {
            // `Var::set` copies into the existing storage, so the moments stay private.
            p.m.set(&m.to_device(p.var.device())?.to_dtype(DType::F32)?)?;
            p.v.set(&v.to_device(p.var.device())?.to_dtype(DType::F32)?)?;
            p.steps = steps;
            if let Some(w) = &p.master {
                match master {
                    Some(saved) => {
                        w.set(&saved.to_device(p.var.device())?.to_dtype(DType::F32)?)?;
                        p.write_back()?;
                    }
                    None => w.set(&p.var.to_dtype(DType::F32)?)?,
                }
            }
        }
        self.step = step;
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Device-generic path
// ---------------------------------------------------------------------------

/// f32 master weights for `var` when it is not f32 (a fresh copy, own storage).
fn master_of(var: &Var) -> Result<Option<Var>> {
    if var.dtype() == DType::F32 {
        return Ok(None);
    }
    Ok(Some(Var::from_tensor(&var.to_dtype(DType::F32)?)?))
}

/// The same update composed of candle ops, for CUDA/Metal and unusual dtypes or
/// layouts. Correct everywhere, but allocates temporaries. Arithmetic in f32.
/// Writes the master weights when there are (the caller rounds them back).
fn update_generic(p: &ParamState, g: &Tensor, h: &Hyper) -> Result<()> {
    let w = p.trained();
    let (m_new, v_new, p_new) = generic_new_values(w, g, &p.m, &p.v, h)?;
    p.m.set(&m_new)?;
    p.v.set(&v_new)?;
    w.set(&p_new)?;
    Ok(())
}

/// Whether every element of `t` is finite: `0 * t` is 0 for a finite element and NaN
/// otherwise, and NaN survives the sum (a plain sum of finite values could overflow).
pub(crate) fn all_finite(t: &Tensor) -> Result<bool> {
    let t = t.to_dtype(DType::F32)?;
    Ok(t.affine(0.0, 0.0)?.sum_all()?.to_scalar::<f32>()? == 0.0)
}

/// The new (first moment, second moment, parameter) of the device-generic update of
/// `p` (any dtype; computed in f32, returned in `p`'s dtype) with moments `m`, `v`.
pub(super) fn generic_new_values(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    h: &Hyper,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (clip, b1, b2) = (h.clip as f64, h.b1 as f64, h.b2 as f64);
    let g = g.to_device(p.device())?.to_dtype(DType::F32)?;
    let m_new = (m.affine(b1, 0.0)? + g.affine(h.one_minus_b1 as f64 * clip, 0.0)?)?;
    let v_new = (v.affine(b2, 0.0)? + g.sqr()?.affine(h.one_minus_b2 as f64 * clip * clip, 0.0)?)?;
    let denom = v_new.sqrt()?.affine(h.inv_sqrt_bc2 as f64, h.eps as f64)?;
    let upd = (m_new.clone() / denom)?.affine(h.step_size as f64, 0.0)?;
    let p_new = (p.to_dtype(DType::F32)?.affine(h.decay as f64, 0.0)? - upd)?.to_dtype(p.dtype())?;
    Ok((m_new, v_new, p_new))
}

/// Whether the update of `p` (moments `m`, `v`) with gradient `g` would leave every
/// weight and moment finite, computed with the arithmetic of the path that will run
/// it (the fused kernel when `fused` and the tensors allow, else candle ops), without
/// writing anything. Shared by [`AdamW`] and the sharded optimizer, which calls it on
/// views of its flat shards.
pub(super) fn update_stays_finite(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    h: &Hyper,
    fused: bool,
) -> Result<bool> {
    if fused && fused_supported(p) {
        return fused_stays_finite(p, g, m, v, h);
    }
    let (m, v, w) = generic_new_values(p, g, m, v, h)?;
    Ok(all_finite(&m)? && all_finite(&v)? && all_finite(&w)?)
}

/// Refuses a learning rate no AdamW step can use: not finite, negative, or so large
/// that decoupled decay multiplies weights by `1 - lr * wd <= 0`.
pub(super) fn check_lr(cfg: &AdamWConfig, lr: f64) -> Result<()> {
    if !(lr.is_finite() && lr >= 0.0) {
        return Err(Error::invalid(format!("adamw: learning rate must be finite and >= 0, found {lr}")));
    }
    // At lr * wd >= 1 every weight flips sign and grows by that factor each step (finite,
    // so no later check would catch it).
    if cfg.weight_decay > 0.0 && lr * cfg.weight_decay >= 1.0 {
        return Err(Error::invalid(format!(
            "adamw: learning rate {lr:e} times weight_decay {} is {:e}, at least 1: weight decay would \
             multiply every weight by {:e}; lower `actor.optim.lr` (or \
             `actor.optim.weight_decay`)",
            cfg.weight_decay,
            lr * cfg.weight_decay,
            1.0 - lr * cfg.weight_decay
        )));
    }
    Ok(())
}

/// The factor the gradients are scaled by at global norm `grad_norm` (1 unless
/// `max_grad_norm` clips), or `None` when the norm is not finite and the step is skipped.
pub(super) fn clip_coef(cfg: &AdamWConfig, grad_norm: f64) -> Option<f64> {
    if !grad_norm.is_finite() {
        return None;
    }
    Some(match cfg.max_grad_norm {
        Some(max) => (max / (grad_norm + 1e-6)).min(1.0),
        None => 1.0,
    })
}

impl StepReport {
    /// A step that changed nothing: a non-finite gradient norm, or (`nonfinite_param`)
    /// an update that would have left that parameter non-finite.
    pub(super) fn skipped(grad_norm: f64, nonfinite_param: Option<String>, missing: usize) -> Self {
        StepReport {
            grad_norm,
            skipped: true,
            nonfinite_param,
            clip_coef: 0.0,
            n_params_without_grad: missing,
        }
    }

    /// A step that updated every parameter with a gradient.
    pub(super) fn applied(grad_norm: f64, clip_coef: f64, missing: usize) -> Self {
        StepReport {
            grad_norm,
            skipped: false,
            nonfinite_param: None,
            clip_coef,
            n_params_without_grad: missing,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::config::is_norm_or_bias;
    use super::super::kernels::CHUNK;
    use super::super::schedule::LrSchedule;
    use super::super::Optimizer;
    use super::*;
    use candle_core::Device;

    fn vec_of(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        vec_of(a).iter().zip(vec_of(b)).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    fn assert_close(found: &[f32], expected: &[f64], tol: f64) {
        assert_eq!(found.len(), expected.len());
        for (i, (f, e)) in found.iter().zip(expected).enumerate() {
            assert!((*f as f64 - e).abs() <= tol, "element {i}: found {f}, expected {e}");
        }
    }

    fn state_of(opt: &AdamW, name: &str) -> Vec<f32> {
        let st = opt.state_tensors().unwrap();
        let t = st.iter().find(|(n, _)| n == name).unwrap();
        vec_of(&t.1)
    }

    fn no_clip(lr: f64, wd: f64) -> AdamWConfig {
        AdamWConfig { lr, weight_decay: wd, max_grad_norm: None, ..AdamWConfig::default() }
    }

    /// Two steps by hand. lr = 0.1, wd = 0.1, b1 = 0.9, b2 = 0.999, eps = 1e-8 (negligible here).
    ///
    /// `w` (decayed) starts at [1, -2]; `n.norm.weight` (not decayed) at [1].
    /// Step 1, g = [0.5, -1] and [0.5]:
    ///   decay: w *= 1 - 0.1*0.1 = 0.99                  -> [0.99, -1.98]
    ///   m = 0.1 g = [0.05, -0.1];  v = 0.001 g^2 = [0.00025, 0.001]
    ///   m_hat = m / 0.1 = [0.5, -1];  v_hat = v / 0.001 = [0.25, 1];  sqrt = [0.5, 1]
    ///   w -= 0.1 * m_hat / sqrt = 0.1 * [1, -1]         -> [0.89, -1.88]
    ///   norm weight: 1 - 0.1 * 1                        -> 0.9
    /// Step 2, g = [0.5, 1] and [0.5]:
    ///   decay: w *= 0.99                                -> [0.8811, -1.8612]
    ///   m = 0.9 [0.05, -0.1] + 0.1 [0.5, 1] = [0.095, 0.01]
    ///   v = 0.999 [0.00025, 0.001] + 0.001 [0.25, 1] = [0.00049975, 0.001999]
    ///   bias corrections: 1 - 0.9^2 = 0.19, 1 - 0.999^2 = 0.001999
    ///   m_hat = [0.5, 0.0526315789...];  v_hat = [0.25, 1];  sqrt = [0.5, 1]
    ///   w -= 0.1 * [1, 0.0526315789]                    -> [0.7811, -1.8664631579]
    ///   norm weight: m_hat = 0.5, v_hat = 0.25          -> 0.9 - 0.1 = 0.8
    #[test]
    fn hand_computed_two_steps() {
        let dev = Device::Cpu;
        let w = Var::new(&[1.0f32, -2.0], &dev).unwrap();
        let n = Var::new(&[1.0f32], &dev).unwrap();
        let mut opt =
            AdamW::new(vec![("w".into(), w.clone()), ("n.norm.weight".into(), n.clone())], no_clip(0.1, 0.1))
                .unwrap()
                .with_no_decay(is_norm_or_bias);
        let grads_for = |gw: [f32; 2], gn: [f32; 1]| {
            let mut gs = GradStore::default();
            gs.insert(&w, Tensor::new(&gw, &dev).unwrap());
            gs.insert(&n, Tensor::new(&gn, &dev).unwrap());
            gs
        };
        let r = opt.step(&grads_for([0.5, -1.0], [0.5]), 0.1).unwrap();
        assert!(!r.skipped);
        assert_eq!(r.clip_coef, 1.0);
        assert_close(&vec_of(&w), &[0.89, -1.88], 1e-6);
        assert_close(&vec_of(&n), &[0.9], 1e-6);
        opt.step(&grads_for([0.5, 1.0], [0.5]), 0.1).unwrap();
        assert_close(&vec_of(&w), &[0.7811, -1.8664631579], 1e-6);
        assert_close(&vec_of(&n), &[0.8], 1e-6);
        assert_close(&state_of(&opt, "w.exp_avg"), &[0.095, 0.01], 1e-7);
        assert_close(&state_of(&opt, "w.exp_avg_sq"), &[0.00049975, 0.001999], 1e-9);
        assert_eq!(opt.step_count(), 2);
    }

    /// Straightforward unfused AdamW in candle ops, written from the PyTorch docs'
    /// pseudo-code (m_hat, v_hat), independent of the kernel's rearrangement.
    struct Reference {
        p: Tensor,
        m: Tensor,
        v: Tensor,
        t: i32,
    }

    impl Reference {
        fn step(&mut self, g: &Tensor, lr: f64, wd: f64) {
            let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8);
            self.t += 1;
            let p = (&self.p * (1.0 - lr * wd)).unwrap();
            self.m = ((&self.m * b1).unwrap() + (g * (1.0 - b1)).unwrap()).unwrap();
            self.v = ((&self.v * b2).unwrap() + (g.sqr().unwrap() * (1.0 - b2)).unwrap()).unwrap();
            let m_hat = (&self.m / (1.0 - b1.powi(self.t))).unwrap();
            let v_hat = (&self.v / (1.0 - b2.powi(self.t))).unwrap();
            let upd = (m_hat / (v_hat.sqrt().unwrap() + eps).unwrap()).unwrap();
            self.p = (p - (upd * lr).unwrap()).unwrap();
        }
    }

    fn check_against_reference(force_generic: bool) {
        let dev = Device::Cpu;
        let shapes: [&[usize]; 4] = [&[7, 13], &[64], &[3, 5, 4], &[CHUNK + 17]];
        let vars: Vec<Var> = shapes.iter().map(|s| Var::randn(0f32, 1.0, *s, &dev).unwrap()).collect();
        let mut refs: Vec<Reference> = vars
            .iter()
            .map(|v| Reference {
                p: v.as_tensor().copy().unwrap(),
                m: v.zeros_like().unwrap(),
                v: v.zeros_like().unwrap(),
                t: 0,
            })
            .collect();
        let named = vars.iter().enumerate().map(|(i, v)| (format!("p{i}"), v.clone())).collect();
        let mut opt = AdamW::new(named, no_clip(1e-2, 0.05)).unwrap().with_no_decay(|n| n == "p1");
        opt.force_generic = force_generic;
        for step in 0..5 {
            let lr = 1e-2 * (1.0 + step as f64) / 5.0;
            let mut gs = GradStore::default();
            for (i, (var, r)) in vars.iter().zip(&mut refs).enumerate() {
                let g = (Tensor::randn(0f32, 1.0, var.shape(), &dev).unwrap() * 0.1).unwrap();
                r.step(&g, lr, if i == 1 { 0.0 } else { 0.05 });
                gs.insert(var, g);
            }
            opt.step(&gs, lr).unwrap();
        }
        for (i, (var, r)) in vars.iter().zip(&refs).enumerate() {
            let st = opt.state_tensors().unwrap();
            let get = |k: String| st.iter().find(|(n, _)| *n == k).unwrap().1.clone();
            assert!(max_abs_diff(var, &r.p) <= 1e-6, "param p{i}: {}", max_abs_diff(var, &r.p));
            assert!(max_abs_diff(&get(format!("p{i}.exp_avg")), &r.m) <= 1e-6);
            assert!(max_abs_diff(&get(format!("p{i}.exp_avg_sq")), &r.v) <= 1e-6);
        }
    }

    #[test]
    fn fused_matches_unfused_reference() {
        check_against_reference(false);
    }

    #[test]
    fn generic_path_matches_unfused_reference() {
        check_against_reference(true);
    }

    /// A bf16 parameter trains in mixed precision: its f32 master weights take exactly
    /// the f32 run's steps (same arithmetic on the same widened gradients, bit for bit on
    /// the fused path), and the parameter is their rounding to bf16 after every step.
    #[test]
    fn bf16_params_train_f32_master_weights() {
        let dev = Device::Cpu;
        // Start from bf16-representable values, so both runs start equal.
        let init = Tensor::randn(0f32, 1.0, (32, 16), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        for generic in [false, true] {
            let p32 = Var::from_tensor(&init.to_dtype(DType::F32).unwrap()).unwrap();
            let p16 = Var::from_tensor(&init.copy().unwrap()).unwrap();
            let mut a = AdamW::new(vec![("p".into(), p32.clone())], no_clip(1e-2, 0.1)).unwrap();
            let mut b = AdamW::new(vec![("p".into(), p16.clone())], no_clip(1e-2, 0.1)).unwrap();
            a.force_generic = generic;
            b.force_generic = generic;
            assert_eq!((a.n_master_elements(), b.n_master_elements()), (0, 32 * 16));
            assert_eq!(b.state_bytes(), 12 * 32 * 16, "moments and master weights");
            for _ in 0..3 {
                let g16 = Tensor::randn(0f32, 1.0, (32, 16), &dev).unwrap().to_dtype(DType::BF16).unwrap();
                let (mut ga, mut gb) = (GradStore::default(), GradStore::default());
                ga.insert(&p32, g16.to_dtype(DType::F32).unwrap());
                gb.insert(&p16, g16);
                a.step(&ga, 1e-2).unwrap();
                b.step(&gb, 1e-2).unwrap();
            }
            assert_eq!(p16.dtype(), DType::BF16);
            let master = b.master("p").expect("a bf16 parameter has master weights");
            let tol = if generic { 1e-7 } else { 0.0 };
            assert!(max_abs_diff(master, &p32) <= tol, "generic {generic}: {}", max_abs_diff(master, &p32));
            // The parameter is the master's rounding, exactly.
            assert_eq!(vec_of(&p16), vec_of(&master.to_dtype(DType::BF16).unwrap()), "generic {generic}");
            let saved = b.state_tensors().unwrap();
            assert!(saved.iter().any(|(n, t)| n == "p.master" && t.dtype() == DType::F32));
            assert!(!a.state_tensors().unwrap().iter().any(|(n, _)| n.ends_with(".master")));
        }
    }

    /// Steps under half a bf16 ulp are not lost: at 1.0 a bf16 ulp is 2^-8 below and
    /// 2^-7 above, and Adam's first steps on a constant gradient move by lr = 1e-3, so
    /// rounding the weight after each step would leave it at 1.0 forever; the master
    /// weights take all ten steps (0.99), and the parameter follows their rounding
    /// (253 * 2^-8 = 0.98828125, the bf16 value nearest 0.99).
    #[test]
    fn updates_under_half_a_bf16_ulp_accumulate_in_the_master() {
        let dev = Device::Cpu;
        let p =
            Var::from_tensor(&Tensor::new(&[1.0f32], &dev).unwrap().to_dtype(DType::BF16).unwrap()).unwrap();
        let mut opt = AdamW::new(vec![("p".into(), p.clone())], no_clip(1e-3, 0.0)).unwrap();
        let rounded_once = Tensor::new(&[1.0f32 - 1e-3], &dev).unwrap().to_dtype(DType::BF16).unwrap();
        assert_eq!(vec_of(&rounded_once), vec![1.0], "one step rounded to bf16 is lost");
        for _ in 0..10 {
            let mut gs = GradStore::default();
            gs.insert(&p, Tensor::new(&[1.0f32], &dev).unwrap().to_dtype(DType::BF16).unwrap());
            opt.step(&gs, 1e-3).unwrap();
        }
        // Each step is lr / (1 + eps) with m_hat / sqrt(v_hat) = 1 for a constant gradient.
        assert_close(&vec_of(opt.master("p").unwrap()), &[1.0 - 10.0 * 1e-3], 1e-6);
        assert_eq!(vec_of(&p), vec![0.98828125]);
    }

    /// Saved master weights come back exactly, and the parameter is set to their
    /// rounding; state without them (an f32 run's) starts the master from the parameter.
    #[test]
    fn master_weights_round_trip_through_the_state() {
        let dev = Device::Cpu;
        let init = Tensor::randn(0f32, 1.0, (5, 7), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let p = Var::from_tensor(&init.copy().unwrap()).unwrap();
        let mut opt = AdamW::new(vec![("p".into(), p.clone())], no_clip(1e-3, 0.0)).unwrap();
        for _ in 0..3 {
            let mut gs = GradStore::default();
            gs.insert(&p, Tensor::randn(0f32, 1.0, (5, 7), &dev).unwrap().to_dtype(DType::BF16).unwrap());
            opt.step(&gs, 1e-3).unwrap();
        }
        let saved: HashMap<String, Tensor> =
            opt.state_tensors().unwrap().into_iter().map(|(n, t)| (n, t.copy().unwrap())).collect();
        let master = vec_of(&saved["p.master"]);
        // A fresh model from the saved (rounded) weights, resumed.
        let q = Var::from_tensor(&init.copy().unwrap()).unwrap();
        let mut resumed = AdamW::new(vec![("q".into(), q.clone())], no_clip(1e-3, 0.0)).unwrap();
        let renamed: HashMap<String, Tensor> =
            saved.iter().map(|(n, t)| (n.replacen("p.", "q.", 1), t.clone())).collect();
        resumed.load_state(&renamed, 3, "optimizer.safetensors").unwrap();
        assert_eq!(vec_of(resumed.master("q").unwrap()), master);
        assert_eq!(vec_of(&q), vec_of(&p), "the parameter is the master's rounding");
        // Without `.master` in the file the master weights start from the parameter.
        let without: HashMap<String, Tensor> =
            renamed.into_iter().filter(|(n, _)| !n.ends_with(".master")).collect();
        resumed.load_state(&without, 3, "optimizer.safetensors").unwrap();
        assert_eq!(vec_of(resumed.master("q").unwrap()), vec_of(&q));
    }

    /// Gradients [3, 4] and [0] have norm 5; with max_grad_norm 1 the coefficient
    /// is 1 / (5 + 1e-6), so after one step m = 0.1 * coef * g = [0.06, 0.08]
    /// and v = 0.001 * (coef * g)^2 = 0.001 * [0.36, 0.64] = [3.6e-4, 6.4e-4]
    /// (to 1e-6 relative).
    #[test]
    fn clipping_scales_the_update() {
        let dev = Device::Cpu;
        let a = Var::new(&[1.0f32, 1.0], &dev).unwrap();
        let b = Var::new(&[1.0f32], &dev).unwrap();
        let cfg =
            AdamWConfig { lr: 0.1, weight_decay: 0.0, max_grad_norm: Some(1.0), ..AdamWConfig::default() };
        let mut opt =
            AdamW::new(vec![("a".into(), a.clone()), ("b".into(), b.clone())], cfg.clone()).unwrap();
        let mut gs = GradStore::default();
        gs.insert(&a, Tensor::new(&[3.0f32, 4.0], &dev).unwrap());
        gs.insert(&b, Tensor::new(&[0.0f32], &dev).unwrap());
        let r = opt.step(&gs, 0.1).unwrap();
        assert!((r.grad_norm - 5.0).abs() < 1e-9);
        assert!((r.clip_coef - 1.0 / (5.0 + 1e-6)).abs() < 1e-12);
        assert_close(&state_of(&opt, "a.exp_avg"), &[0.06, 0.08], 1e-7);
        assert_close(&state_of(&opt, "a.exp_avg_sq"), &[3.6e-4, 6.4e-4], 1e-9);
        // The same as an unclipped optimizer fed pre-scaled gradients.
        let a2 = Var::new(&[1.0f32, 1.0], &dev).unwrap();
        let mut opt2 = AdamW::new(vec![("a".into(), a2.clone())], no_clip(0.1, 0.0)).unwrap();
        let mut gs2 = GradStore::default();
        let coef = r.clip_coef as f32;
        gs2.insert(&a2, Tensor::new(&[3.0f32 * coef, 4.0 * coef], &dev).unwrap());
        opt2.step(&gs2, 0.1).unwrap();
        assert!(max_abs_diff(&a, &a2) < 1e-7);
        // The gradients themselves are not rewritten.
        assert_eq!(vec_of(gs.get(&a).unwrap()), vec![3.0, 4.0]);
        // A norm under the threshold is not clipped.
        let big = AdamWConfig { max_grad_norm: Some(10.0), ..cfg };
        let mut opt3 = AdamW::new(vec![("a".into(), a.clone()), ("b".into(), b.clone())], big).unwrap();
        assert_eq!(opt3.step(&gs, 0.1).unwrap().clip_coef, 1.0);
    }

    #[test]
    fn non_finite_gradient_skips_the_step() {
        let dev = Device::Cpu;
        let a = Var::new(&[1.0f32, 2.0], &dev).unwrap();
        let b = Var::new(&[3.0f32], &dev).unwrap();
        let mut opt =
            AdamW::new(vec![("a".into(), a.clone()), ("b".into(), b.clone())], AdamWConfig::default())
                .unwrap();
        let mut gs = GradStore::default();
        gs.insert(&a, Tensor::new(&[0.1f32, 0.2], &dev).unwrap());
        gs.insert(&b, Tensor::new(&[0.3f32], &dev).unwrap());
        opt.step(&gs, 1e-3).unwrap();
        let snapshot = |o: &AdamW| -> Vec<Vec<f32>> {
            let mut s: Vec<Vec<f32>> = o.state_tensors().unwrap().iter().map(|(_, t)| vec_of(t)).collect();
            s.push(vec_of(&a));
            s.push(vec_of(&b));
            s
        };
        let before = snapshot(&opt);
        for bad in [f32::NAN, f32::INFINITY] {
            let mut gs = GradStore::default();
            gs.insert(&a, Tensor::new(&[0.1f32, 0.2], &dev).unwrap());
            gs.insert(&b, Tensor::new(&[bad], &dev).unwrap());
            let r = opt.step(&gs, 1e-3).unwrap();
            assert!(r.skipped && !r.grad_norm.is_finite());
            assert_eq!(snapshot(&opt), before);
            assert_eq!(opt.step_count(), 1);
        }
    }

    /// An update that would write a non-finite weight is skipped with the
    /// parameter named and nothing changed, on the fused and the device-generic path alike;
    /// a finite update of the same optimizer then steps normally.
    #[test]
    fn nothing_lost_nonfinite_update_is_skipped_on_both_paths() {
        for generic in [false, true] {
            let dev = Device::Cpu;
            let a = Var::new(&[1.0f32, -2.0], &dev).unwrap();
            let b = Var::new(&[3.0f32], &dev).unwrap();
            let cfg = AdamWConfig { weight_decay: 0.0, ..AdamWConfig::default() };
            let mut opt = AdamW::new(vec![("a".into(), a.clone()), ("b".into(), b.clone())], cfg).unwrap();
            opt.force_generic = generic;
            let mut gs = GradStore::default();
            gs.insert(&a, Tensor::new(&[0.1f32, 0.2], &dev).unwrap());
            gs.insert(&b, Tensor::new(&[0.3f32], &dev).unwrap());
            // lr / (1 - beta1) overflows f32: every new weight would be infinite.
            let r = opt.step(&gs, 1e38).unwrap();
            assert!(r.skipped && r.grad_norm.is_finite(), "generic {generic}: {r:?}");
            assert_eq!(r.nonfinite_param.as_deref(), Some("a"), "generic {generic}");
            assert_eq!((vec_of(&a), vec_of(&b), opt.step_count()), (vec![1.0, -2.0], vec![3.0], 0));
            assert!(state_of(&opt, "a.exp_avg").iter().all(|&x| x == 0.0));
            let r = opt.step(&gs, 1e-3).unwrap();
            assert!(!r.skipped && r.nonfinite_param.is_none() && opt.step_count() == 1, "generic {generic}");
            assert_ne!(vec_of(&a), vec![1.0, -2.0]);
        }
        assert!(!all_finite(&Tensor::new(&[1f32, f32::NEG_INFINITY], &Device::Cpu).unwrap()).unwrap());
        assert!(all_finite(&Tensor::new(&[f32::MAX, -f32::MAX], &Device::Cpu).unwrap()).unwrap());
    }

    #[test]
    fn parameter_without_gradient_is_counted_and_untouched() {
        let dev = Device::Cpu;
        let a = Var::new(&[1.0f32], &dev).unwrap();
        let b = Var::new(&[1.0f32], &dev).unwrap();
        let mut opt =
            AdamW::new(vec![("a".into(), a.clone()), ("b".into(), b.clone())], no_clip(0.1, 0.1)).unwrap();
        let mut gs = GradStore::default();
        gs.insert(&a, Tensor::new(&[1.0f32], &dev).unwrap());
        let r = opt.step(&gs, 0.1).unwrap();
        assert_eq!(r.n_params_without_grad, 1);
        assert_eq!(vec_of(&b), vec![1.0]);
        assert_ne!(vec_of(&a), vec![1.0]);
    }

    #[test]
    fn gradient_of_wrong_shape_is_an_error() {
        let dev = Device::Cpu;
        let a = Var::new(&[1.0f32, 2.0], &dev).unwrap();
        let mut opt = AdamW::new(vec![("a".into(), a.clone())], AdamWConfig::default()).unwrap();
        let mut gs = GradStore::default();
        gs.insert(&a, Tensor::new(&[1.0f32, 2.0, 3.0], &dev).unwrap());
        match opt.step(&gs, 1e-3) {
            Err(Error::Shape { name, .. }) => assert_eq!(name, "a"),
            other => panic!("expected a shape error, got {other:?}"),
        }
    }

    #[test]
    fn save_load_continue_equals_uninterrupted() {
        let dev = Device::Cpu;
        let init: Vec<Tensor> =
            [(4usize, 5usize), (3, 1)].iter().map(|s| Tensor::randn(0f32, 1.0, *s, &dev).unwrap()).collect();
        let grads: Vec<Vec<Tensor>> = (0..6)
            .map(|_| init.iter().map(|t| Tensor::randn(0f32, 0.5, t.shape(), &dev).unwrap()).collect())
            .collect();
        let make = |vals: &[Tensor]| -> (Vec<Var>, AdamW) {
            let vars: Vec<Var> = vals.iter().map(|t| Var::from_tensor(&t.copy().unwrap()).unwrap()).collect();
            let named = vars.iter().enumerate().map(|(i, v)| (format!("w{i}"), v.clone())).collect();
            let cfg = AdamWConfig { lr: 1e-2, max_grad_norm: Some(0.5), ..AdamWConfig::default() };
            (vars, AdamW::new(named, cfg).unwrap())
        };
        let run = |vars: &[Var], opt: &mut AdamW, steps: std::ops::Range<usize>| {
            for s in steps {
                let mut gs = GradStore::default();
                // w1 gets no gradient at step 1, so per-parameter step counts differ.
                for (i, (v, g)) in vars.iter().zip(&grads[s]).enumerate() {
                    if !(i == 1 && s == 1) {
                        gs.insert(v, g.clone());
                    }
                }
                opt.step(&gs, LrSchedule::Constant { warmup_steps: 2 }.lr_at(1e-2, s as u64)).unwrap();
            }
        };
        let (va, mut a) = make(&init);
        run(&va, &mut a, 0..6);

        let (vb, mut b) = make(&init);
        run(&vb, &mut b, 0..3);
        // Emulate a file: deep copies, the moments as another dtype.
        let saved: HashMap<String, Tensor> =
            b.state_tensors().unwrap().into_iter().map(|(n, t)| (n, t.copy().unwrap())).collect();
        let weights: Vec<Tensor> = vb.iter().map(|v| v.as_tensor().copy().unwrap()).collect();
        let (vc, mut c) = make(&weights);
        c.load_state(&saved, b.step_count(), "optimizer.safetensors").unwrap();
        assert_eq!(c.step_count(), 3);
        run(&vc, &mut c, 3..6);
        for (x, y) in va.iter().zip(&vc) {
            assert_eq!(vec_of(x), vec_of(y));
        }
        assert_eq!(a.state_tensors().unwrap().len(), c.state_tensors().unwrap().len());
        for ((n1, t1), (n2, t2)) in a.state_tensors().unwrap().iter().zip(c.state_tensors().unwrap().iter()) {
            assert_eq!(n1, n2);
            assert_eq!(vec_of(t1), vec_of(t2), "{n1}");
        }

        // Errors name the tensor.
        let mut missing = saved.clone();
        missing.remove("w1.exp_avg_sq");
        match c.load_state(&missing, 3, "optimizer.safetensors") {
            Err(Error::MissingTensor { file, name }) => {
                assert_eq!((file.as_str(), name.as_str()), ("optimizer.safetensors", "w1.exp_avg_sq"))
            }
            other => panic!("expected a missing-tensor error, got {other:?}"),
        }
        let mut wrong = saved.clone();
        wrong.insert("w0.exp_avg".into(), Tensor::zeros((5, 4), DType::F32, &dev).unwrap());
        match c.load_state(&wrong, 3, "optimizer.safetensors") {
            Err(Error::Shape { name, expected, found, .. }) => {
                assert_eq!(name, "w0.exp_avg");
                assert_eq!((expected, found), (vec![4, 5], vec![5, 4]));
            }
            other => panic!("expected a shape error, got {other:?}"),
        }
    }
}
