//! Checkpoints of the sharded optimizer, in the manner of DeepSpeed's ZeRO
//! checkpoints (one `*_optim_states.pt` per rank) and its "universal checkpoint"
//! re-sharding: every rank writes its range's state to
//! `optimizer-RRRRR-of-SSSSS.safetensors` (flat f32 `exp_avg`, `exp_avg_sq`, and
//! `master` for a model whose weights are not f32) and rank 0 writes
//! [`INDEX_FILE`], the ranges of the files over the flattened parameters, the
//! parameters (name, elements, steps) and the step counter.
//!
//! Reading ([`FlatState`]) goes by flat ranges, so a checkpoint written by any
//! number of ranks loads into any other: each rank reads the parts of the files
//! that overlap its new range (memory-mapped, tensor by tensor). The plain
//! `optimizer.safetensors` of the unsharded optimizer reads the same way, and a
//! sharded checkpoint assembles into the unsharded optimizer's per-parameter
//! tensors, so a run may change its shard mode when it resumes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use super::config::ShardMode;
use super::sharded::{FlatLayout, ShardedAdamW};
use crate::{Error, Result};

/// The index of a sharded optimizer checkpoint, next to its files.
pub const INDEX_FILE: &str = "optimizer.index.json";

/// The plain (unsharded) optimizer file.
pub const PLAIN_FILE: &str = "optimizer.safetensors";

/// What [`INDEX_FILE`] holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardIndex {
    /// Ranks that wrote the checkpoint.
    pub world_size: usize,
    /// What was sharded (moments, or moments and gradients).
    pub mode: ShardMode,
    /// Optimizer steps taken.
    pub step: u64,
    /// Whether the files hold f32 master weights.
    pub master: bool,
    /// The flattened parameters, in order.
    pub params: Vec<IndexParam>,
    /// One file per rank and the flat range it holds.
    pub shards: Vec<IndexShard>,
}

/// One parameter of a [`ShardIndex`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexParam {
    /// The parameter's name.
    pub name: String,
    /// Elements in the parameter.
    pub numel: usize,
    /// Steps in which it had a gradient.
    pub steps: u64,
}

/// One file of a [`ShardIndex`]: flat elements `start..end`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexShard {
    /// The file's name, relative to the checkpoint folder.
    pub file: String,
    /// First flat element in the file.
    pub start: usize,
    /// One past the last flat element in the file.
    pub end: usize,
}

/// The file rank `rank` of `size` writes.
pub fn shard_file_name(rank: usize, size: usize) -> String {
    format!("optimizer-{rank:05}-of-{size:05}.safetensors")
}

impl ShardedAdamW {
    /// Writes this rank's file into `dir` (every rank calls it); returns its path.
    pub fn save_shard(&self, dir: &Path) -> Result<PathBuf> {
        let path = dir.join(shard_file_name(self.rank(), self.layout().size()));
        let tensors: HashMap<String, Tensor> = self.state_tensors().into_iter().collect();
        candle_core::safetensors::save(&tensors, &path).map_err(|e| Error::Config {
            file: path.display().to_string(),
            field: "<safetensors>".into(),
            msg: format!("cannot write the optimizer shard: {e}"),
        })?;
        Ok(path)
    }

    /// The index of the files [`ShardedAdamW::save_shard`] writes on every rank.
    pub fn index(&self) -> ShardIndex {
        let layout = self.layout();
        let size = layout.size();
        ShardIndex {
            world_size: size,
            mode: self.mode(),
            step: self.step_count(),
            master: self.state_tensors().iter().any(|(n, _)| n == "master"),
            params: self
                .param_steps()
                .into_iter()
                .map(|(name, numel, steps)| IndexParam { name, numel, steps })
                .collect(),
            shards: (0..size)
                .map(|r| {
                    let range = layout.range(r);
                    IndexShard { file: shard_file_name(r, size), start: range.start, end: range.end }
                })
                .collect(),
        }
    }

    /// Loads this rank's range from a checkpoint of any world size and shard mode.
    pub fn load_from(&mut self, src: &FlatState) -> Result<()> {
        let names: Vec<(String, usize)> = self.param_steps().into_iter().map(|(n, k, _)| (n, k)).collect();
        let r = self.range();
        let read = |key: &str| src.read(key, &names, r.start, r.end);
        let m = read("exp_avg")?.ok_or_else(|| src.missing("exp_avg"))?;
        let v = read("exp_avg_sq")?.ok_or_else(|| src.missing("exp_avg_sq"))?;
        let master = read("master")?;
        let steps = src.steps(&names)?;
        self.set_state(&m, &v, master.as_ref(), &steps, src.step())
    }
}

/// An optimizer checkpoint read by flat ranges.
pub enum FlatState {
    /// Files written by the ranks of a sharded run, and their index.
    Shards {
        /// The folder of the shard files.
        dir: PathBuf,
        /// Which file holds which flat range.
        index: ShardIndex,
    },
    /// The unsharded optimizer's per-parameter tensors (`{name}.exp_avg`, ...).
    PerParam {
        /// The safetensors file.
        file: String,
        /// Its tensors by name.
        tensors: HashMap<String, Tensor>,
        /// Optimizer steps taken.
        step: u64,
    },
}

impl FlatState {
    /// The optimizer state of checkpoint `dir` (written at `step`): its index when it
    /// has one, else `optimizer.safetensors`.
    pub fn open(dir: &Path, step: u64) -> Result<Self> {
        let index_path = dir.join(INDEX_FILE);
        if index_path.is_file() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
            let index: ShardIndex = serde_json::from_str(&text).map_err(|e| Error::Config {
                file: index_path.display().to_string(),
                field: "<json>".into(),
                msg: e.to_string(),
            })?;
            return Ok(Self::Shards { dir: dir.to_path_buf(), index });
        }
        let path = dir.join(PLAIN_FILE);
        let tensors = candle_core::safetensors::load(&path, &Device::Cpu).map_err(|e| Error::Config {
            file: path.display().to_string(),
            field: "<safetensors>".into(),
            msg: format!("unreadable optimizer state: {e}"),
        })?;
        Ok(Self::PerParam { file: path.display().to_string(), tensors, step })
    }

    /// The step counter the state was saved at.
    pub fn step(&self) -> u64 {
        match self {
            Self::Shards { index, .. } => index.step,
            Self::PerParam { step, .. } => *step,
        }
    }

    fn file(&self) -> String {
        match self {
            Self::Shards { dir, .. } => dir.join(INDEX_FILE).display().to_string(),
            Self::PerParam { file, .. } => file.clone(),
        }
    }

    fn missing(&self, key: &str) -> Error {
        Error::MissingTensor { file: self.file(), name: key.into() }
    }

    /// Checks that the checkpoint covers the parameters `names` (name, elements), in order.
    fn check_params(&self, names: &[(String, usize)]) -> Result<()> {
        let Self::Shards { index, .. } = self else { return Ok(()) };
        let have: Vec<(&str, usize)> = index.params.iter().map(|p| (p.name.as_str(), p.numel)).collect();
        let want: Vec<(&str, usize)> = names.iter().map(|(n, k)| (n.as_str(), *k)).collect();
        if have == want {
            return Ok(());
        }
        let first = have.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(have.len().min(want.len()));
        Err(Error::Config {
            file: self.file(),
            field: "params".into(),
            msg: format!(
                "the checkpoint's optimizer covers {} parameters, the model trains {}; first difference at \
                 position {first}: {:?} vs {:?}",
                have.len(),
                want.len(),
                have.get(first),
                want.get(first)
            ),
        })
    }

    /// Per-parameter step counts of the parameters `names`, in order.
    pub fn steps(&self, names: &[(String, usize)]) -> Result<Vec<u64>> {
        self.check_params(names)?;
        match self {
            Self::Shards { index, .. } => Ok(index.params.iter().map(|p| p.steps).collect()),
            Self::PerParam { tensors, step, file } => names
                .iter()
                .map(|(n, _)| match tensors.get(&format!("{n}.step")) {
                    None => Ok(*step),
                    Some(t) => {
                        let v = t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
                        match v.as_slice() {
                            [s] if s.is_finite() && *s >= 0.0 && s.fract() == 0.0 => Ok(*s as u64),
                            _ => Err(Error::invalid(format!(
                                "{file}: tensor `{n}.step` should hold one non-negative integer, found {v:?}"
                            ))),
                        }
                    }
                })
                .collect(),
        }
    }

    /// Flat elements `lo..hi` of `key` (`exp_avg`, `exp_avg_sq`, `master`) over the
    /// parameters `names`, as an f32 CPU tensor; `None` when the checkpoint has no
    /// such state (`master` of an f32 run, or of an unsharded file without
    /// `{name}.master` for every parameter).
    pub fn read(&self, key: &str, names: &[(String, usize)], lo: usize, hi: usize) -> Result<Option<Tensor>> {
        self.check_params(names)?;
        let parts = match self {
            Self::Shards { dir, index } => {
                if key == "master" && !index.master {
                    return Ok(None);
                }
                read_shards(dir, index, key, lo, hi)?
            }
            Self::PerParam { tensors, file, .. } => {
                if key == "master" && !names.iter().all(|(n, _)| tensors.contains_key(&format!("{n}.master")))
                {
                    return Ok(None);
                }
                let layout = FlatLayout::new(names.iter().map(|(_, k)| *k), 1);
                let mut parts = Vec::new();
                for pc in layout.pieces(lo, hi) {
                    let name = format!("{}.{key}", names[pc.param].0);
                    let t = tensors
                        .get(&name)
                        .ok_or_else(|| Error::MissingTensor { file: file.clone(), name: name.clone() })?;
                    if t.elem_count() != names[pc.param].1 {
                        return Err(Error::Shape {
                            file: file.clone(),
                            name,
                            expected: vec![names[pc.param].1],
                            found: t.dims().to_vec(),
                        });
                    }
                    parts.push(t.flatten_all()?.narrow(0, pc.at, pc.len)?.to_dtype(DType::F32)?);
                }
                parts
            }
        };
        Ok(Some(match parts.len() {
            0 => Tensor::zeros(0, DType::F32, &Device::Cpu)?,
            _ => Tensor::cat(&parts, 0)?,
        }))
    }

    /// The unsharded optimizer's tensors for parameters `params` (name, shape):
    /// `{name}.exp_avg`, `{name}.exp_avg_sq`, `{name}.step`, and `{name}.master` when
    /// the state has master weights.
    pub fn per_param(&self, params: &[(String, Vec<usize>)]) -> Result<HashMap<String, Tensor>> {
        if let Self::PerParam { tensors, .. } = self {
            return Ok(tensors.clone());
        }
        let names: Vec<(String, usize)> =
            params.iter().map(|(n, s)| (n.clone(), s.iter().product())).collect();
        let layout = FlatLayout::new(names.iter().map(|(_, k)| *k), 1);
        let steps = self.steps(&names)?;
        let mut out = HashMap::new();
        for (i, (name, shape)) in params.iter().enumerate() {
            let r = layout.param(i);
            for key in ["exp_avg", "exp_avg_sq"] {
                let t = self.read(key, &names, r.start, r.end)?.ok_or_else(|| self.missing(key))?;
                out.insert(format!("{name}.{key}"), t.reshape(shape.as_slice())?);
            }
            if let Some(t) = self.read("master", &names, r.start, r.end)? {
                out.insert(format!("{name}.master"), t.reshape(shape.as_slice())?);
            }
            out.insert(format!("{name}.step"), Tensor::new(steps[i] as i64, &Device::Cpu)?);
        }
        Ok(out)
    }
}

/// The parts of `key` over flat `lo..hi` from the shard files that overlap it.
fn read_shards(dir: &Path, index: &ShardIndex, key: &str, lo: usize, hi: usize) -> Result<Vec<Tensor>> {
    let mut parts = Vec::new();
    let mut at = lo;
    for s in &index.shards {
        let (a, b) = (s.start.max(lo), s.end.min(hi));
        if a >= b {
            continue;
        }
        if a != at {
            return Err(Error::invalid(format!(
                "{}: the shards do not cover flat elements {at}..{a}",
                dir.join(INDEX_FILE).display()
            )));
        }
        let path = dir.join(&s.file);
        let bad = |msg: String| Error::Config { file: path.display().to_string(), field: key.into(), msg };
        // SAFETY: checkpoint files are never written in place (saved to a new folder, then renamed).
        let st = unsafe { MmapedSafetensors::new(&path) }.map_err(|e| bad(format!("unreadable: {e}")))?;
        let t = st.load(key, &Device::Cpu).map_err(|e| bad(format!("cannot read: {e}")))?;
        if t.dims() != [s.end - s.start] {
            return Err(Error::Shape {
                file: path.display().to_string(),
                name: key.into(),
                expected: vec![s.end - s.start],
                found: t.dims().to_vec(),
            });
        }
        parts.push(t.narrow(0, a - s.start, b - a)?.to_dtype(DType::F32)?);
        at = b;
    }
    if at < hi {
        return Err(Error::invalid(format!(
            "{}: the shards end at flat element {at}, {hi} needed",
            dir.join(INDEX_FILE).display()
        )));
    }
    Ok(parts)
}
