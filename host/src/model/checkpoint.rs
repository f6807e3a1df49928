//! Model folders in the Hugging Face layout: load, save and random init.
//!
//! A folder holds `config.json` and either `model.safetensors` or a sharded
//! `model.safetensors.index.json` with its shards. Tensors are read one by one
//! and converted to the requested dtype (HF checkpoints are usually bf16).
//! Saving writes into a temporary sibling folder and renames it into place, so
//! a reader (or a crash) never sees a half-written checkpoint.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};

use super::config::{dtype_name, Config};
use super::qwen3::{Qwen3, WeightSource};
use crate::{Error, Result};

/// Files copied alongside the weights when a folder is saved, if present.
pub const TOKENIZER_FILES: &[&str] =
    &["tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"];

/// Weights read lazily from one or more safetensors files.
pub struct SafetensorsSource {
    files: Vec<PathBuf>,
    /// tensor name -> index into `files`
    index: HashMap<String, usize>,
    st: MmapedSafetensors,
    device: Device,
    dtype: DType,
    /// Names the model asked for (the rest are unused: [`SafetensorsSource::unused`]).
    used: std::collections::HashSet<String>,
}

impl SafetensorsSource {
    /// Opens the weights of a model folder (single file or sharded index).
    pub fn open(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if single.is_file() {
            vec![single]
        } else if index_path.is_file() {
            shard_files(&index_path)?
        } else {
            return Err(Error::io(
                dir,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no model.safetensors or model.safetensors.index.json in this folder",
                ),
            ));
        };
        for f in &files {
            if !f.is_file() {
                return Err(Error::io(
                    f,
                    std::io::Error::new(std::io::ErrorKind::NotFound, "shard listed in the index is missing"),
                ));
            }
        }
        // SAFETY: the files are memory-mapped read-only; stapo never writes to a
        // checkpoint in place (saves go to a new folder then rename).
        let st = unsafe { MmapedSafetensors::multi(&files) }.map_err(|e| Error::Config {
            file: files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
            field: "<safetensors>".into(),
            msg: format!("unreadable safetensors file: {e}"),
        })?;
        let mut index = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            // SAFETY: as above.
            let one = unsafe { MmapedSafetensors::new(f) }.map_err(|e| Error::Config {
                file: f.display().to_string(),
                field: "<safetensors>".into(),
                msg: format!("unreadable: {e}"),
            })?;
            for (name, _) in one.tensors() {
                index.insert(name, i);
            }
        }
        Ok(Self { files, index, st, device: device.clone(), dtype, used: Default::default() })
    }

    /// Tensors of the files that the model never asked for, sorted, leaving out those
    /// Hugging Face ignores too: rotary `inv_freq` buffers of older checkpoints, and
    /// `lm_head.weight` next to tied embeddings.
    pub fn unused(&self, cfg: &Config) -> Vec<String> {
        let mut out: Vec<String> = self
            .index
            .keys()
            .filter(|n| !self.used.contains(*n))
            .filter(|n| !n.ends_with("rotary_emb.inv_freq"))
            .filter(|n| !(cfg.tie_word_embeddings && n.as_str() == "lm_head.weight"))
            .cloned()
            .collect();
        out.sort();
        out
    }

    /// The decoder layers the weights hold (one more than the largest `model.layers.N`).
    pub fn layers_in_weights(&self) -> usize {
        self.index
            .keys()
            .filter_map(|n| n.strip_prefix("model.layers.")?.split('.').next()?.parse::<usize>().ok())
            .map(|l| l + 1)
            .max()
            .unwrap_or(0)
    }

    /// The files the weights come from, joined for messages.
    fn files_list(&self) -> String {
        self.files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    }

    fn file_of(&self, name: &str) -> String {
        match self.index.get(name) {
            Some(&i) => self.files[i].display().to_string(),
            None => self.files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
        }
    }
}

impl WeightSource for SafetensorsSource {
    fn get(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        if !self.index.contains_key(name) {
            return Err(Error::MissingTensor { file: self.file_of(name), name: name.into() });
        }
        self.used.insert(name.to_string());
        let t = self.st.load(name, &Device::Cpu).map_err(|e| Error::Config {
            file: self.file_of(name),
            field: name.into(),
            msg: format!("cannot read tensor: {e}"),
        })?;
        if t.dims() != shape {
            return Err(Error::Shape {
                file: self.file_of(name),
                name: name.into(),
                expected: shape.to_vec(),
                found: t.dims().to_vec(),
            });
        }
        if !t.dtype().is_float() {
            return Err(Error::Config {
                file: self.file_of(name),
                field: name.into(),
                msg: format!("expected a float tensor, found {:?}", t.dtype()),
            });
        }
        Ok(t.to_dtype(self.dtype)?.to_device(&self.device)?)
    }

    fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }
}

fn shard_files(index_path: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index_path).map_err(|e| Error::io(index_path, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Parse {
        path: index_path.into(),
        line: e.line(),
        msg: e.to_string(),
    })?;
    let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| Error::Config {
        file: index_path.display().to_string(),
        field: "weight_map".into(),
        msg: "missing or not an object".into(),
    })?;
    let dir = index_path.parent().unwrap_or(Path::new("."));
    let mut files: Vec<PathBuf> = Vec::new();
    for (name, f) in map {
        let bad = |msg: String| Error::Config {
            file: index_path.display().to_string(),
            field: format!("weight_map.{name}"),
            msg,
        };
        let f = f.as_str().ok_or_else(|| bad("expected a file name".into()))?;
        // A shard is a file of the model folder itself: no absolute path, no `..`.
        let confined = Path::new(f).components().all(|c| matches!(c, std::path::Component::Normal(_)));
        if !confined || f.is_empty() {
            return Err(bad(format!(
                "shard path {f:?} leaves the model folder {}; shards must be files inside it",
                dir.display()
            )));
        }
        let p = dir.join(f);
        if !files.contains(&p) {
            files.push(p);
        }
    }
    files.sort();
    Ok(files)
}

/// Random initialisation as `Qwen3PreTrainedModel._init_weights`: linear and
/// embedding weights ~ N(0, std), norms 1, biases 0. Seeded and deterministic.
pub struct RandomInit {
    rng: rand::rngs::StdRng,
    std: f64,
}

impl RandomInit {
    /// A source that draws weights from N(0, `std`) with `seed`.
    pub fn new(seed: u64, std: f64) -> Self {
        Self { rng: rand::rngs::StdRng::seed_from_u64(seed), std }
    }
}

impl WeightSource for RandomInit {
    fn get(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = if name.ends_with("norm.weight") || name.ends_with("layernorm.weight") {
            vec![1.0; n]
        } else if name.ends_with(".bias") {
            vec![0.0; n]
        } else {
            // Box-Muller from the seeded generator (no extra dependency).
            (0..n)
                .map(|_| {
                    let u1: f64 = self.rng.random::<f64>().max(1e-300);
                    let u2: f64 = self.rng.random::<f64>();
                    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos() * self.std) as f32
                })
                .collect()
        };
        Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
    }

    fn contains(&self, _name: &str) -> bool {
        true
    }
}

/// Loads the Hugging Face model folder `dir` (`config.json` and safetensors)
/// with weights converted to `dtype` on `device`. [`super::load`] also takes a
/// peft adapter folder.
pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<Qwen3> {
    let cfg_path = dir.join("config.json");
    let cfg = Config::from_file(&cfg_path)?;
    let mut src = SafetensorsSource::open(dir, dtype, device)?;
    let layers = src.layers_in_weights();
    if layers != cfg.num_hidden_layers && layers > 0 {
        return Err(Error::Config {
            file: cfg_path.display().to_string(),
            field: "num_hidden_layers".into(),
            msg: format!(
                "declares {} decoder layers but the weights ({}) hold {layers} (model.layers.0-{})",
                cfg.num_hidden_layers,
                src.files_list(),
                layers - 1
            ),
        });
    }
    let m = Qwen3::new(&cfg, &mut src, dtype, device)?;
    check_unused(&src.unused(&cfg), &src.files_list())?;
    check_finite(&m, dir)?;
    Ok(m)
}

/// An error naming the first tensor of `m` (loaded from `dir`) that holds a NaN or an
/// infinity: every later forward would carry it into every output.
pub fn check_finite(m: &Qwen3, dir: &Path) -> Result<()> {
    for (name, v) in m.params() {
        // A sum in f64 of finite f32 (or bf16) values cannot overflow: not finite means a
        // NaN or an infinity inside.
        // Chunks of 16M values keep the f64 copy small whatever the tensor.
        let flat = v.as_tensor().flatten_all()?;
        let (n, chunk) = (flat.elem_count(), 1usize << 24);
        let mut finite = true;
        for start in (0..n).step_by(chunk) {
            let part = flat.narrow(0, start, chunk.min(n - start))?;
            finite &= part.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?.is_finite();
        }
        if finite {
            continue;
        }
        let vals = v.as_tensor().to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let nan = vals.iter().filter(|x| x.is_nan()).count();
        let inf = vals.iter().filter(|x| x.is_infinite()).count();
        let first = vals.iter().position(|x| !x.is_finite()).unwrap_or(0);
        return Err(Error::invalid(format!(
            "{}: tensor {name} holds {nan} NaN and {inf} infinite value(s) of {} (the first at flat \
             index {first}); the model cannot be used (was it saved from a diverged run?)",
            dir.display(),
            vals.len()
        )));
    }
    Ok(())
}

/// An error listing the tensors the model did not use (a config that does not match its
/// weights), or with `--allow-unused` ([`crate::guard::allow_unused_tensors`]) a warning
/// queued for the caller ([`crate::guard::take_notes`]).
fn check_unused(unused: &[String], files: &str) -> Result<()> {
    if unused.is_empty() {
        return Ok(());
    }
    let shown: Vec<&str> = unused.iter().take(10).map(String::as_str).collect();
    let more = if unused.len() > shown.len() {
        format!(" and {} more", unused.len() - shown.len())
    } else {
        String::new()
    };
    let msg = format!(
        "{} tensor(s) of {files} are not used by the model: {}{more}",
        unused.len(),
        shown.join(", ")
    );
    if crate::guard::allow_unused_tensors() {
        crate::guard::note(format!("{msg} (ignored: --allow-unused)"));
        return Ok(());
    }
    Err(Error::invalid(format!(
        "{msg}; the config does not describe these weights (pass --allow-unused to load it anyway)"
    )))
}

/// A randomly initialised model.
pub fn init(cfg: &Config, seed: u64, std: f64, dtype: DType, device: &Device) -> Result<Qwen3> {
    Qwen3::new(cfg, &mut RandomInit::new(seed, std), dtype, device)
}

/// Saves `model` to `dir` in the Hugging Face layout, weights in `save_dtype`,
/// copying the tokenizer files found in `tokenizer_dir` (if any). Atomic: the
/// folder is written under a temporary name, then renamed over `dir`.
pub fn save(model: &Qwen3, dir: &Path, save_dtype: DType, tokenizer_dir: Option<&Path>) -> Result<()> {
    write_atomically(dir, |tmp| write_model_files(model, tmp, save_dtype, tokenizer_dir))
}

/// Writes `config.json`, `model.safetensors` and the tokenizer files of
/// `tokenizer_dir` into the existing folder `dir` (not atomic on its own: use
/// inside [`write_atomically`]).
pub fn write_model_files(
    model: &Qwen3,
    dir: &Path,
    save_dtype: DType,
    tokenizer_dir: Option<&Path>,
) -> Result<()> {
    let mut cfg = model.config().clone();
    cfg.torch_dtype = dtype_name(save_dtype).into();
    let cfg_text =
        serde_json::to_string_pretty(&cfg.to_hf_json()).map_err(|e| Error::invalid(e.to_string()))?;
    std::fs::write(dir.join("config.json"), cfg_text).map_err(|e| Error::io(dir.join("config.json"), e))?;
    let mut tensors = HashMap::new();
    for (name, var) in model.params() {
        tensors.insert(name, var.as_tensor().detach().to_dtype(save_dtype)?.to_device(&Device::Cpu)?);
    }
    save_safetensors(&tensors, &dir.join("model.safetensors"))?;
    if let Some(src) = tokenizer_dir {
        copy_tokenizer_files(src, dir)?;
    }
    Ok(())
}

/// Writes `tensors` to the safetensors file `path`; a failure (a full disk) names the path.
pub fn save_safetensors(tensors: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    candle_core::safetensors::save(tensors, path).map_err(|e| Error::Config {
        file: path.display().to_string(),
        field: "<safetensors>".into(),
        msg: format!("cannot write: {e}"),
    })
}

/// Copies the tokenizer files ([`TOKENIZER_FILES`]) that `src` has into `dir`.
pub(crate) fn copy_tokenizer_files(src: &Path, dir: &Path) -> Result<()> {
    for f in TOKENIZER_FILES {
        let from = src.join(f);
        if from.is_file() && from != dir.join(f) {
            std::fs::copy(&from, dir.join(f)).map_err(|e| Error::io(&from, e))?;
        }
    }
    Ok(())
}

/// Writes a folder through `fill(tmp)` and renames it over `dir` once complete.
/// A previous `dir` is moved aside and removed only after the rename succeeded.
pub fn write_atomically(dir: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    for n in crate::guard::folder::recover_folder_leftovers(dir)? {
        crate::guard::note(n);
    }
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    if let Err(e) = fill(&tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    sync_dir(&tmp);
    let old = parent.join(format!(".{name}.old-{}", std::process::id()));
    let had_old = dir.exists();
    if had_old {
        std::fs::rename(dir, &old).map_err(|e| Error::io(dir, e))?;
    }
    if let Err(e) = std::fs::rename(&tmp, dir) {
        if had_old {
            let _ = std::fs::rename(&old, dir);
        }
        return Err(Error::io(dir, e));
    }
    sync_dir(parent);
    if had_old {
        let _ = std::fs::remove_dir_all(&old);
    }
    Ok(())
}

/// Flushes a directory's files and entry to disk (best effort).
fn sync_dir(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if let Ok(f) = std::fs::File::open(e.path()) {
                let _ = f.sync_all();
            }
        }
    }
    if let Ok(f) = std::fs::File::open(dir) {
        let _ = f.sync_all();
    }
}
