//! Bindings for models and tokenizers: load, random init, save, inspect,
//! encode/decode.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device};
use rhai::plugin::{export_module, exported_module};
use rhai::{Dynamic, Engine, Map};
use serde::Deserialize;

use super::{lock, ModelHandle, ModelSlot, TokenizerHandle};
use crate::data::Tokenizer;
use crate::model::{self, Config};
use crate::overlay::merge as merge_json;
use crate::script::convert::{options, to_json};
use crate::script::error::{bad_arg, host, RhaiResult};

/// `load_model(dir, opts)`.
#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct LoadOpts {
    dtype: String,
    device: String,
}

impl Default for LoadOpts {
    fn default() -> Self {
        LoadOpts { dtype: "float32".into(), device: "cpu".into() }
    }
}

/// `init_model(config, opts)`.
#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct InitOpts {
    seed: u64,
    /// Standard deviation of the random weights.
    std: f64,
    dtype: String,
    device: String,
    /// A tokenizer.json or a folder holding one; sets vocab_size and eos.
    tokenizer: Option<PathBuf>,
}

impl Default for InitOpts {
    fn default() -> Self {
        let LoadOpts { dtype, device } = LoadOpts::default();
        InitOpts { seed: 0, std: 0.02, dtype, device, tokenizer: None }
    }
}

/// `(dtype, device)` as a script names them (`float32`, `cpu` | `cuda` | `cuda:N`).
fn dtype_device(dtype: &str, device: &str) -> RhaiResult<(DType, Device)> {
    let dtype = model::parse_dtype(dtype).map_err(|e| bad_arg("dtype", e))?;
    let dev = model::parse_device(device).map_err(|e| bad_arg("device", e))?;
    Ok((dtype, dev))
}

/// `dir/tokenizer.json` for a folder, else the path itself.
fn tokenizer_file(p: &Path) -> PathBuf {
    if p.is_dir() {
        p.join("tokenizer.json")
    } else {
        p.to_path_buf()
    }
}

fn load(dir: &str, opts: &Map) -> RhaiResult<ModelHandle> {
    let o: LoadOpts = options("load_model", opts)?;
    let (dtype, dev) = dtype_device(&o.dtype, &o.device)?;
    let dir = PathBuf::from(dir);
    let m = model::load(&dir, dtype, &dev).map_err(host)?;
    let tok_path = dir.join("tokenizer.json");
    let tokenizer =
        if tok_path.is_file() { Some(Tokenizer::from_file(&tok_path).map_err(host)?) } else { None };
    Ok(ModelHandle(Arc::new(Mutex::new(ModelSlot { model: m, tokenizer, dir: Some(dir), opt: None }))))
}

/// A tiny Qwen3 configuration (2 layers, 64 wide), the base of `init_model`.
fn tiny_config_json() -> serde_json::Value {
    serde_json::json!({
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "tie_word_embeddings": true,
        "torch_dtype": "float32"
    })
}

fn init(cfg: &Map, opts: &Map) -> RhaiResult<ModelHandle> {
    let o: InitOpts = options("init_model", opts)?;
    let (dtype, dev) = dtype_device(&o.dtype, &o.device)?;
    let tokenizer = match &o.tokenizer {
        Some(p) => Some(Tokenizer::from_file(tokenizer_file(p)).map_err(host)?),
        None => None,
    };
    let mut j = tiny_config_json();
    if let Some(t) = &tokenizer {
        merge_json(&mut j, serde_json::json!({"vocab_size": t.vocab_size()}));
        if let Some(&eos) = t.eos_ids().last() {
            merge_json(&mut j, serde_json::json!({"eos_token_id": eos}));
        }
    }
    merge_json(&mut j, to_json("config", &Dynamic::from_map(cfg.clone()))?);
    let c = Config::from_json_str(&j.to_string(), "init_model config").map_err(host)?;
    let m = model::init(&c, o.seed, o.std, dtype, &dev).map_err(host)?;
    let dir = o.tokenizer.and_then(|p| if p.is_dir() { Some(p) } else { p.parent().map(Path::to_path_buf) });
    Ok(ModelHandle(Arc::new(Mutex::new(ModelSlot { model: m, tokenizer, dir, opt: None }))))
}

fn save(m: &ModelHandle, dir: &str) -> RhaiResult<String> {
    let slot = lock(&m.0, "model")?;
    let out = PathBuf::from(dir);
    let save_dtype = model::parse_dtype(&slot.model.config().torch_dtype).unwrap_or(DType::F32);
    model::save(&slot.model, &out, save_dtype, slot.dir.as_deref()).map_err(host)?;
    if slot.dir.is_none() {
        if let Some(t) = &slot.tokenizer {
            crate::data::save_tokenizer(t, &out).map_err(host)?;
        }
    }
    Ok(out.display().to_string())
}

fn describe(m: &ModelHandle) -> String {
    match m.0.lock() {
        Ok(s) => {
            let c = s.model.config();
            format!(
                "Model({}: {} layers, hidden {}, vocab {}, {:.2}M params, {:?})",
                s.dir.as_ref().map(|d| d.display().to_string()).unwrap_or_else(|| "in memory".into()),
                c.num_hidden_layers,
                c.hidden_size,
                c.vocab_size,
                c.num_params() as f64 / 1e6,
                s.model.dtype()
            )
        }
        Err(_) => "Model(<unusable>)".into(),
    }
}

fn tokenizer_of(m: &ModelHandle) -> RhaiResult<TokenizerHandle> {
    let s = lock(&m.0, "model")?;
    s.tokenizer
        .clone()
        .map(|t| TokenizerHandle(Arc::new(t)))
        .ok_or_else(|| host("this model has no tokenizer (no tokenizer.json in its folder)"))
}

/// Registers the model and tokenizer functions.
pub(super) fn register(engine: &mut Engine) {
    engine.register_global_module(exported_module!(fns).into());
}

/// The script-visible model and tokenizer functions.
#[export_module]
mod fns {
    use std::path::Path;
    use std::sync::Arc;

    use rhai::{Array, Dynamic, Map};

    use super::{lock, ModelHandle, TokenizerHandle};
    use crate::data::Tokenizer;
    use crate::script::convert::from_json;
    use crate::script::error::{bad_arg, host, RhaiResult};

    /// load_model(dir) -> Model
    ///
    /// Loads a Hugging Face model folder (config.json, *.safetensors, tokenizer.json) on the CPU in
    /// float32.
    ///
    /// # Example
    ///
    /// ```rhai
    /// let m = load_model("models/tiny-qwen3");
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn load_model(dir: &str) -> RhaiResult<ModelHandle> {
        super::load(dir, &Map::new())
    }

    /// load_model(dir, opts) -> Model
    ///
    /// opts: #{dtype: "float32"|"bfloat16"|"float16", device: "cpu"|"cuda"|"cuda:N"}.
    ///
    /// # Example
    ///
    /// ```rhai
    /// let m = load_model("models/tiny-qwen3", #{dtype: "bfloat16"});
    /// ```
    #[rhai_fn(name = "load_model", volatile, return_raw)]
    pub fn load_model_with(dir: &str, opts: Map) -> RhaiResult<ModelHandle> {
        super::load(dir, &opts)
    }

    /// init_model(config) -> Model
    ///
    /// A randomly initialised Qwen3; `config` overrides a 2-layer, 64-wide default (HF config.json
    /// keys).
    ///
    /// # Example
    ///
    /// ```rhai
    /// let m = init_model(#{vocab_size: 300, num_hidden_layers: 1});
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn init_model(config: Map) -> RhaiResult<ModelHandle> {
        super::init(&config, &Map::new())
    }

    /// init_model(config, opts) -> Model
    ///
    /// opts: #{seed, std, dtype, device, tokenizer: "dir or tokenizer.json"} (vocab_size and eos
    /// follow the tokenizer).
    ///
    /// # Example
    ///
    /// ```rhai
    /// let m = init_model(#{}, #{tokenizer: "models/tiny-qwen3", seed: 1});
    /// ```
    #[rhai_fn(name = "init_model", volatile, return_raw)]
    pub fn init_model_with(config: Map, opts: Map) -> RhaiResult<ModelHandle> {
        super::init(&config, &opts)
    }

    /// save_model(model, dir) -> string
    ///
    /// Writes the model (HF layout, with its tokenizer) atomically into `dir`; returns the folder.
    ///
    /// # Example
    ///
    /// ```rhai
    /// save_model(m, "models/my-run");
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn save_model(m: ModelHandle, dir: &str) -> RhaiResult<String> {
        super::save(&m, dir)
    }

    /// model.save(dir) -> string
    ///
    /// Same as `save_model(model, dir)`.
    ///
    /// # Example
    ///
    /// ```rhai
    /// m.save("models/copy");
    /// ```
    #[rhai_fn(name = "save", pure, volatile, return_raw)]
    pub fn save(m: &mut ModelHandle, dir: &str) -> RhaiResult<String> {
        super::save(m, dir)
    }

    /// model.config -> map
    ///
    /// The model's config.json as a map.
    ///
    /// # Example
    ///
    /// ```rhai
    /// print(m.config.hidden_size);
    /// ```
    #[rhai_fn(get = "config", pure, volatile, return_raw)]
    pub fn config(m: &mut ModelHandle) -> RhaiResult<Dynamic> {
        let s = lock(&m.0, "model")?;
        Ok(from_json(&s.model.config().to_hf_json()))
    }

    /// model.num_params -> int
    ///
    /// Number of parameters.
    ///
    /// # Example
    ///
    /// ```rhai
    /// print(m.num_params);
    /// ```
    #[rhai_fn(get = "num_params", pure, volatile, return_raw)]
    pub fn num_params(m: &mut ModelHandle) -> RhaiResult<i64> {
        Ok(lock(&m.0, "model")?.model.config().num_params() as i64)
    }

    /// model.tokenizer -> Tokenizer
    ///
    /// The model's tokenizer.
    ///
    /// # Example
    ///
    /// ```rhai
    /// let t = m.tokenizer; print(t.encode("1+1"));
    /// ```
    #[rhai_fn(get = "tokenizer", pure, volatile, return_raw)]
    pub fn tokenizer(m: &mut ModelHandle) -> RhaiResult<TokenizerHandle> {
        super::tokenizer_of(m)
    }

    /// to_string(model) -> string
    ///
    /// A one-line description.
    ///
    /// # Example
    ///
    /// ```rhai
    /// print(m);
    /// ```
    #[rhai_fn(name = "to_string", pure, volatile)]
    pub fn model_to_string(m: &mut ModelHandle) -> String {
        super::describe(m)
    }

    /// to_debug(model) -> string
    ///
    /// A one-line description.
    ///
    /// # Example
    ///
    /// ```rhai
    /// debug(m);
    /// ```
    #[rhai_fn(name = "to_debug", pure, volatile)]
    pub fn model_to_debug(m: &mut ModelHandle) -> String {
        super::describe(m)
    }

    /// load_tokenizer(path) -> Tokenizer
    ///
    /// Loads a tokenizer.json (or the one in a folder).
    ///
    /// # Example
    ///
    /// ```rhai
    /// let t = load_tokenizer("models/qwen3-tokenizer");
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn load_tokenizer(path: &str) -> RhaiResult<TokenizerHandle> {
        let t = Tokenizer::from_file(super::tokenizer_file(Path::new(path))).map_err(host)?;
        Ok(TokenizerHandle(Arc::new(t)))
    }

    /// tokenizer.encode(text) -> array of int
    ///
    /// Token ids of `text` (special-token strings become their ids).
    ///
    /// # Example
    ///
    /// ```rhai
    /// t.encode("12+7")
    /// ```
    #[rhai_fn(pure, volatile, return_raw)]
    pub fn encode(t: &mut TokenizerHandle, text: &str) -> RhaiResult<Array> {
        Ok(t.0.encode(text, false).map_err(host)?.into_iter().map(|i| Dynamic::from(i as i64)).collect())
    }

    /// tokenizer.decode(ids) -> string
    ///
    /// Text of token ids (special tokens kept).
    ///
    /// # Example
    ///
    /// ```rhai
    /// t.decode([1, 2, 3])
    /// ```
    #[rhai_fn(pure, volatile, return_raw)]
    pub fn decode(t: &mut TokenizerHandle, ids: Array) -> RhaiResult<String> {
        let ids: Vec<u32> = ids
            .iter()
            .map(|d| {
                d.as_int()
                    .ok()
                    .and_then(|i| u32::try_from(i).ok())
                    .ok_or_else(|| bad_arg("decode", "expected an array of token ids"))
            })
            .collect::<RhaiResult<_>>()?;
        t.0.decode(&ids, false).map_err(host)
    }

    /// tokenizer.token(id) -> string
    ///
    /// A readable form of one token.
    ///
    /// # Example
    ///
    /// ```rhai
    /// t.token(42)
    /// ```
    #[rhai_fn(pure, volatile, return_raw)]
    pub fn token(t: &mut TokenizerHandle, id: i64) -> RhaiResult<String> {
        let id =
            u32::try_from(id).map_err(|_| bad_arg("token", format!("expected a token id, found {id}")))?;
        Ok(t.0.token_str(id))
    }

    /// tokenizer.vocab_size -> int
    ///
    /// Number of tokens, special tokens included.
    ///
    /// # Example
    ///
    /// ```rhai
    /// print(m.tokenizer.vocab_size);
    /// ```
    #[rhai_fn(get = "vocab_size", pure, volatile)]
    pub fn vocab_size(t: &mut TokenizerHandle) -> i64 {
        t.0.vocab_size() as i64
    }

    /// to_string(tokenizer) -> string
    ///
    /// # Example
    ///
    /// ```rhai
    /// print(load_tokenizer("models/qwen3-tokenizer"));
    /// ```
    #[rhai_fn(name = "to_string", pure, volatile)]
    pub fn tokenizer_to_string(t: &mut TokenizerHandle) -> String {
        format!("Tokenizer({}, {} tokens)", t.0.path().display(), t.0.vocab_size())
    }
}
