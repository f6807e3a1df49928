//! LoRA adapters as Hugging Face `peft` writes them: a folder with
//! `adapter_model.safetensors` (tensors named
//! `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`, ...)
//! and `adapter_config.json` (`peft_type: "LORA"`, `r`, `lora_alpha`,
//! `target_modules`, `use_rslora`, `base_model_name_or_path`, ...), so that
//! `peft.PeftModel.from_pretrained(base, folder)` loads what stapo trains and
//! stapo loads what peft saved (`PeftModel.save_pretrained`).
//!
//! Only what a Qwen3 LoRA uses is accepted: adapters on the seven block
//! projections of every layer, no DoRA, no bias training, no
//! `modules_to_save`, no per-layer rank or alpha patterns; anything else is
//! an error naming the field or tensor. Dropout is read and ignored (RL
//! samples the policy it trains).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use serde_json::{json, Value};

use super::checkpoint;
use super::lora::{LoraConfig, Target};
use super::qwen3::Qwen3;
use crate::{Error, Result};

/// The adapter weights file of a peft folder.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// The adapter configuration file of a peft folder.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";

/// True when `dir` holds a peft adapter (its `adapter_config.json`).
pub fn is_adapter_dir(dir: &Path) -> bool {
    dir.join(ADAPTER_CONFIG).is_file()
}

/// What `adapter_config.json` says: the LoRA settings and the base model.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterConfig {
    /// The LoRA settings (rank, alpha, targets, rsLoRA).
    pub lora: LoraConfig,
    /// `base_model_name_or_path` as written (may be a hub id or a path).
    pub base: Option<String>,
}

impl AdapterConfig {
    /// The base model folder: `base_model_name_or_path` resolved against the
    /// adapter folder first (a relative path written next to it), then as
    /// given; an error when neither is a model folder.
    pub fn base_dir(&self, adapter_dir: &Path) -> Result<PathBuf> {
        let file = adapter_dir.join(ADAPTER_CONFIG);
        let base = self.base.as_deref().filter(|b| !b.is_empty()).ok_or_else(|| Error::Config {
            file: file.display().to_string(),
            field: "base_model_name_or_path".into(),
            msg: "missing: name the base model folder (e.g. `--base DIR`)".into(),
        })?;
        let candidates = [adapter_dir.join(base), PathBuf::from(base)];
        candidates.into_iter().find(|p| p.join("config.json").is_file()).ok_or_else(|| Error::Config {
            file: file.display().to_string(),
            field: "base_model_name_or_path".into(),
            msg: format!(
                "{base:?} is not a model folder (no config.json relative to the adapter folder or the \
                 working directory); name the base with `--base DIR`"
            ),
        })
    }
}

fn field_err(file: &Path, field: &str, msg: impl Into<String>) -> Error {
    Error::Config { file: file.display().to_string(), field: field.into(), msg: msg.into() }
}

/// Reads and checks `dir/adapter_config.json`.
pub fn read_config(dir: &Path) -> Result<AdapterConfig> {
    let file = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&file).map_err(|e| Error::io(&file, e))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| Error::Parse {
        path: file.clone(),
        line: e.line(),
        msg: e.to_string(),
    })?;
    let get = |k: &str| v.get(k).filter(|x| !x.is_null());
    if let Some(t) = get("peft_type").and_then(Value::as_str) {
        if t != "LORA" {
            return Err(field_err(&file, "peft_type", format!("expected \"LORA\", found {t:?}")));
        }
    }
    let rank =
        get("r").and_then(Value::as_u64).ok_or_else(|| field_err(&file, "r", "missing or not an integer"))?;
    let alpha =
        get("lora_alpha").map(|a| a.as_f64().ok_or_else(|| field_err(&file, "lora_alpha", "not a number")));
    let rslora = get("use_rslora").and_then(Value::as_bool).unwrap_or(false);
    for (k, what) in [("use_dora", "DoRA"), ("modules_to_save", "modules_to_save")] {
        let set = match get(k) {
            Some(Value::Bool(b)) => *b,
            Some(Value::Array(a)) => !a.is_empty(),
            Some(_) => true,
            None => false,
        };
        if set {
            return Err(field_err(
                &file,
                k,
                format!("{what} is not supported (plain LoRA on the projections)"),
            ));
        }
    }
    for k in ["rank_pattern", "alpha_pattern"] {
        if get(k).and_then(Value::as_object).is_some_and(|m| !m.is_empty()) {
            return Err(field_err(&file, k, "per-module ranks or alphas are not supported"));
        }
    }
    if get("layers_to_transform").is_some() {
        return Err(field_err(
            &file,
            "layers_to_transform",
            "adapters on a subset of layers are not supported",
        ));
    }
    if let Some(b) = get("bias").and_then(Value::as_str).filter(|b| *b != "none") {
        return Err(field_err(&file, "bias", format!("expected \"none\", found {b:?}")));
    }
    let targets = parse_targets(get("target_modules"), &file)?;
    let lora =
        LoraConfig { rank: rank as usize, alpha: alpha.transpose()?, targets, rslora, ..LoraConfig::new(1) };
    lora.validate().map_err(|e| field_err(&file, "r", e.to_string()))?;
    let base = get("base_model_name_or_path").and_then(Value::as_str).map(str::to_string);
    Ok(AdapterConfig { lora, base })
}

/// `target_modules`: a list of module names (`"q_proj"` or a dotted path
/// ending in one), or `"all-linear"`.
fn parse_targets(v: Option<&Value>, file: &Path) -> Result<Vec<Target>> {
    let names: Vec<String> = match v {
        Some(Value::String(s)) if s == "all-linear" => return Ok(Target::ALL.to_vec()),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).map(str::to_string).collect(),
        Some(Value::String(s)) => {
            return Err(field_err(
                file,
                "target_modules",
                format!("a pattern ({s:?}) is not supported: list the modules"),
            ))
        }
        _ => return Err(field_err(file, "target_modules", "missing")),
    };
    let mut targets = Vec::new();
    for n in &names {
        let last = n.rsplit('.').next().unwrap_or(n);
        let t =
            Target::ALL.into_iter().find(|t| t.module().ends_with(&format!(".{last}"))).ok_or_else(|| {
                field_err(
                    file,
                    "target_modules",
                    format!(
                        "{n:?} is not one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"
                    ),
                )
            })?;
        if !targets.contains(&t) {
            targets.push(t);
        }
    }
    // The order of a layer's slots, whatever the file's.
    targets.sort_by_key(|t| Target::ALL.iter().position(|a| a == t));
    Ok(targets)
}

/// peft's `target_modules` name of a target (`q_proj`, ...).
fn short(t: Target) -> &'static str {
    t.module().rsplit('.').next().unwrap_or_default()
}

/// The `adapter_config.json` peft writes for `lora` on `base`.
pub fn config_json(lora: &LoraConfig, base: &str) -> Value {
    json!({
        "alpha_pattern": {},
        "auto_mapping": null,
        "base_model_name_or_path": base,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "layers_pattern": null,
        "layers_to_transform": null,
        // An integer when it is one, as peft's dataclass types it.
        "lora_alpha": match lora.alpha.unwrap_or(lora.rank as f64) {
            a if a.fract() == 0.0 && a.abs() < 1e15 => json!(a as i64),
            a => json!(a),
        },
        "lora_dropout": 0.0,
        "modules_to_save": null,
        "peft_type": "LORA",
        "r": lora.rank,
        "rank_pattern": {},
        "revision": null,
        "target_modules": lora.targets.iter().map(|&t| short(t)).collect::<Vec<_>>(),
        "task_type": "CAUSAL_LM",
        "use_dora": false,
        "use_rslora": lora.rslora,
    })
}

/// Writes the adapters of `model` into the existing folder `dir` as peft
/// does (f32 tensors), naming `base` as the base model, with the tokenizer
/// files of `tokenizer_dir` (not atomic on its own: use inside
/// [`checkpoint::write_atomically`]).
pub fn write_adapter_files(
    model: &Qwen3,
    lora: &LoraConfig,
    dir: &Path,
    base: &str,
    tokenizer_dir: Option<&Path>,
) -> Result<()> {
    if !model.has_lora() {
        return Err(Error::invalid("save adapter: the model has no LoRA adapters"));
    }
    let mut tensors = HashMap::new();
    for (name, var) in model.lora_params() {
        tensors.insert(name, var.as_tensor().detach().to_dtype(DType::F32)?.to_device(&Device::Cpu)?);
    }
    let path = dir.join(ADAPTER_WEIGHTS);
    candle_core::safetensors::save(&tensors, &path)
        .map_err(|e| field_err(&path, "<safetensors>", format!("cannot write: {e}")))?;
    let text =
        serde_json::to_string_pretty(&config_json(lora, base)).map_err(|e| Error::invalid(e.to_string()))?;
    let cfg = dir.join(ADAPTER_CONFIG);
    std::fs::write(&cfg, text).map_err(|e| Error::io(&cfg, e))?;
    if let Some(src) = tokenizer_dir {
        checkpoint::copy_tokenizer_files(src, dir)?;
    }
    Ok(())
}

/// [`write_adapter_files`] into `dir`, atomically.
pub fn save_adapter(
    model: &Qwen3,
    lora: &LoraConfig,
    dir: &Path,
    base: &str,
    tokenizer_dir: Option<&Path>,
) -> Result<()> {
    checkpoint::write_atomically(dir, |tmp| write_adapter_files(model, lora, tmp, base, tokenizer_dir))
}

/// The base path to write into `adapter_config.json`: the canonical path of
/// `base` (so peft finds it from anywhere), or `base` as given.
pub fn base_name(base: &Path) -> String {
    std::fs::canonicalize(base).unwrap_or_else(|_| base.to_path_buf()).display().to_string()
}

/// Puts the adapters of the peft folder `dir` on the base model `model`:
/// fresh adapters as its config says, then every `lora_A` / `lora_B`
/// from `adapter_model.safetensors` (each must be there, with the shape
/// the base implies; a tensor the model has no place for is an error).
pub fn load_adapter(model: &mut Qwen3, dir: &Path) -> Result<LoraConfig> {
    let cfg = read_config(dir)?;
    model.add_lora(&cfg.lora, 0)?;
    let path = dir.join(ADAPTER_WEIGHTS);
    let mut file = candle_core::safetensors::load(&path, &Device::Cpu)
        .map_err(|e| field_err(&path, "<safetensors>", format!("unreadable adapter weights: {e}")))?;
    // An adapter trained on a deeper model: say so with both layer counts.
    let layers = model.config().num_hidden_layers;
    let deepest = file.keys().filter_map(|k| layer_of(k)).max();
    if let Some(d) = deepest.filter(|&d| d >= layers) {
        return Err(field_err(
            &path,
            "<layers>",
            format!(
                "the adapter has weights for layers 0-{d} ({} layers), but its base model has {layers} \
                 decoder layers (num_hidden_layers); it was trained on another base",
                d + 1
            ),
        ));
    }
    for (name, var) in model.lora_params() {
        // peft <= 0.6 and some tools keep the adapter name in the key.
        let t = file
            .remove(&name)
            .or_else(|| file.remove(&name.replace(".weight", ".default.weight")))
            .ok_or_else(|| Error::MissingTensor { file: path.display().to_string(), name: name.clone() })?;
        if t.dims() != var.dims() {
            return Err(Error::Shape {
                file: path.display().to_string(),
                name,
                expected: var.dims().to_vec(),
                found: t.dims().to_vec(),
            });
        }
        var.set(&t.to_dtype(var.dtype())?.to_device(model.device())?)?;
    }
    if let Some(extra) = file.keys().min() {
        return Err(field_err(
            &path,
            extra,
            format!("{} tensor(s) the adapter config does not place (first: {extra})", file.len()),
        ));
    }
    Ok(cfg.lora)
}

/// The decoder layer a tensor name belongs to (`...layers.7.mlp...` → 7).
fn layer_of(name: &str) -> Option<usize> {
    let (_, rest) = name.split_once("layers.")?;
    rest.split('.').next()?.parse().ok()
}

/// Loads the base model of the adapter folder `dir` (`base`, or its
/// `base_model_name_or_path`) in `dtype` on `device`, with the adapters on.
pub fn load_with_adapter(
    dir: &Path,
    base: Option<&Path>,
    dtype: DType,
    device: &Device,
) -> Result<(Qwen3, LoraConfig)> {
    let base = match base {
        Some(b) => b.to_path_buf(),
        None => read_config(dir)?.base_dir(dir)?,
    };
    let mut m = checkpoint::load(&base, dtype, device)?;
    let lora = load_adapter(&mut m, dir)?;
    Ok((m, lora))
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::*;
    use crate::model::{init, Config, TokenBatch};

    #[test]
    fn errors_name_the_cause_adapter_deeper_than_its_base() {
        let dir = tempfile::tempdir().unwrap();
        let lora = LoraConfig::new(2);
        let mut deep = cfg();
        deep.num_hidden_layers = 3;
        let mut d = init(&deep, 3, 0.3, DType::F32, &Device::Cpu).unwrap();
        d.add_lora(&lora, 4).unwrap();
        save_adapter(&d, &lora, &dir.path().join("deep"), "base", None).unwrap();
        let mut m = init(&cfg(), 3, 0.3, DType::F32, &Device::Cpu).unwrap();
        let e = load_adapter(&mut m, &dir.path().join("deep")).unwrap_err().to_string();
        assert!(e.contains("layers 0-2 (3 layers)") && e.contains("has 2 decoder layers"), "{e}");
    }

    fn cfg() -> Config {
        Config::from_json_str(
            r#"{"vocab_size": 41, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 64, "tie_word_embeddings": true}"#,
            "tiny",
        )
        .unwrap()
    }

    fn logits(m: &Qwen3) -> Vec<f32> {
        let b = TokenBatch::left_padded(&[vec![3, 9, 27, 1], vec![5, 8]], 0, &Device::Cpu).unwrap();
        m.forward(&b).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    }

    /// A base folder and a model on it with random (non-zero) adapters.
    fn adapted(dir: &Path, lora: &LoraConfig) -> Qwen3 {
        let mut m = init(&cfg(), 3, 0.3, DType::F32, &Device::Cpu).unwrap();
        crate::model::save(&m, &dir.join("base"), DType::F32, None).unwrap();
        m.add_lora(lora, 4).unwrap();
        for (k, (_, v)) in m.lora_params().iter().enumerate() {
            let t = crate::model::fused::test_util::randn(v.dims(), DType::F32, 50 + k as u64);
            v.set(&(t.as_tensor() * 0.4).unwrap()).unwrap();
        }
        m
    }

    /// Save as peft -> load on the base (by the config's base path, and through
    /// `model::load`) -> the same logits; the files carry peft's names and fields.
    #[test]
    fn save_load_round_trip() {
        let tmp = tempfile::tempdir().unwrap();
        let mut lora = LoraConfig::new(3);
        lora.alpha = Some(7.0);
        lora.rslora = true;
        lora.targets = vec![Target::QProj, Target::VProj, Target::UpProj];
        let m = adapted(tmp.path(), &lora);
        let want = logits(&m);
        let out = tmp.path().join("adapter");
        save_adapter(&m, &lora, &out, &base_name(&tmp.path().join("base")), None).unwrap();
        let names = candle_core::safetensors::load(out.join(ADAPTER_WEIGHTS), &Device::Cpu).unwrap();
        assert_eq!(names.len(), 2 * 3 * 2);
        assert!(names.contains_key("base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"));
        let c: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join(ADAPTER_CONFIG)).unwrap()).unwrap();
        assert_eq!(
            (c["r"].as_u64(), c["lora_alpha"].as_f64(), c["peft_type"].as_str()),
            (Some(3), Some(7.0), Some("LORA"))
        );
        assert_eq!(c["target_modules"], json!(["q_proj", "v_proj", "up_proj"]));
        let back = read_config(&out).unwrap();
        assert_eq!(
            (back.lora.rank, back.lora.alpha, back.lora.rslora, &back.lora.targets),
            (3, Some(7.0), true, &lora.targets)
        );
        let (l, _) = load_with_adapter(&out, None, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(logits(&l), want);
        let l = crate::model::load(&out, DType::F32, &Device::Cpu).unwrap();
        assert!(l.base_frozen());
        assert_eq!(logits(&l), want);
    }

    /// A config as peft writes it ("all-linear", dotted names, dropout) reads;
    /// what stapo cannot honour is refused, naming the field.
    #[test]
    fn reads_peft_configs_and_refuses_the_unsupported() {
        let tmp = tempfile::tempdir().unwrap();
        let write = |v: Value| {
            std::fs::write(tmp.path().join(ADAPTER_CONFIG), v.to_string()).unwrap();
            read_config(tmp.path())
        };
        let c = write(json!({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.05,
            "target_modules": "all-linear", "base_model_name_or_path": "b"}))
        .unwrap();
        assert_eq!((c.lora.rank, c.lora.scale(), c.lora.targets.len()), (8, 2.0, 7));
        let c = write(json!({"r": 4, "target_modules": ["model.layers.0.mlp.down_proj", "k_proj"]})).unwrap();
        assert_eq!(c.lora.targets, vec![Target::KProj, Target::DownProj]);
        for (v, field) in [
            (json!({"r": 4, "target_modules": ["q_proj"], "use_dora": true}), "use_dora"),
            (json!({"r": 4, "target_modules": ["lm_head"]}), "target_modules"),
            (
                json!({"r": 4, "target_modules": ["q_proj"], "layers_to_transform": [0]}),
                "layers_to_transform",
            ),
            (
                json!({"r": 4, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}),
                "modules_to_save",
            ),
            (json!({"target_modules": ["q_proj"]}), "r"),
        ] {
            let e = write(v).unwrap_err().to_string();
            assert!(e.contains(field), "{field}: {e}");
        }
    }

    /// Merge: the merged model saved as a plain folder computes the adapter's
    /// logits (f32 throughout: to rounding).
    #[test]
    fn merged_folder_matches_the_adapter() {
        let tmp = tempfile::tempdir().unwrap();
        let m = adapted(tmp.path(), &LoraConfig::new(2));
        let want = logits(&m);
        let out = tmp.path().join("adapter");
        save_adapter(&m, &LoraConfig::new(2), &out, &base_name(&tmp.path().join("base")), None).unwrap();
        let (mut l, _) = load_with_adapter(&out, None, DType::F32, &Device::Cpu).unwrap();
        l.merge_lora().unwrap();
        crate::model::save(&l, &tmp.path().join("merged"), DType::F32, None).unwrap();
        let merged = crate::model::load(&tmp.path().join("merged"), DType::F32, &Device::Cpu).unwrap();
        assert!(!merged.has_lora());
        let got = logits(&merged);
        let scale = want.iter().fold(0f32, |a, x| a.max(x.abs()));
        let err = got.iter().zip(&want).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        // Two f32 roundings of the same sums: about 1e-5 of the logit scale.
        assert!(err < 1e-4 * scale, "{err} (scale {scale})");
        assert!(
            want != logits(&crate::model::load(&tmp.path().join("base"), DType::F32, &Device::Cpu).unwrap())
        );
    }

    /// A missing tensor or one of the wrong shape is an error naming it.
    #[test]
    fn missing_or_misshapen_tensors_are_named() {
        let tmp = tempfile::tempdir().unwrap();
        let m = adapted(tmp.path(), &LoraConfig::new(2));
        let out = tmp.path().join("adapter");
        save_adapter(&m, &LoraConfig::new(2), &out, &base_name(&tmp.path().join("base")), None).unwrap();
        let mut t = candle_core::safetensors::load(out.join(ADAPTER_WEIGHTS), &Device::Cpu).unwrap();
        let name = "base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight".to_string();
        t.insert(name.clone(), Tensor::zeros((3, 16), DType::F32, &Device::Cpu).unwrap());
        candle_core::safetensors::save(&t, out.join(ADAPTER_WEIGHTS)).unwrap();
        let e = load_with_adapter(&out, None, DType::F32, &Device::Cpu).err().unwrap().to_string();
        assert!(e.contains(&name), "{e}");
        t.remove(&name);
        candle_core::safetensors::save(&t, out.join(ADAPTER_WEIGHTS)).unwrap();
        let e = load_with_adapter(&out, None, DType::F32, &Device::Cpu).err().unwrap().to_string();
        assert!(e.contains(&name), "{e}");
    }
}
