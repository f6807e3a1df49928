//! Qwen3 model configuration, read from a Hugging Face `config.json`.
//!
//! Mirrors `transformers.Qwen3Config` field for field (the subset that shapes the
//! network). Unknown fields are ignored; a missing or invalid required field is an
//! error that names the field and the file. So is a field of `Qwen3Config` whose
//! value asks for math this model does not implement (rope scaling, sliding-window
//! attention, another activation, attention biases, dropout, another model type,
//! quantized weights): loading such a checkpoint anyway would give wrong logits
//! without a word (`unsupported`).

use std::path::Path;

use candle_core::DType;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::{Error, Result};

/// The architecture hyper-parameters of a Qwen3 causal language model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Config {
    /// Rows of the embedding and of the LM head.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention).
    pub num_key_value_heads: usize,
    /// Dimension of one attention head.
    pub head_dim: usize,
    /// Base of the rotary embedding's frequencies.
    pub rope_theta: f64,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f64,
    /// Longest sequence the rotary tables cover.
    pub max_position_embeddings: usize,
    /// True when the LM head shares the embedding's weights.
    pub tie_word_embeddings: bool,
    /// True when q, k, v and o projections have biases.
    pub attention_bias: bool,
    /// Beginning-of-sequence id, when the model has one.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence id, when the model has one.
    pub eos_token_id: Option<u32>,
    /// The dtype the weights were saved in (`"float32"`, `"bfloat16"`, `"float16"`).
    pub torch_dtype: String,
}

impl Config {
    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_json_str(&text, &path.display().to_string())
    }

    /// Parses and validates a `config.json` text; `file` names it in errors.
    pub fn from_json_str(text: &str, file: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(text).map_err(|e| Error::Parse {
            path: file.into(),
            line: e.line(),
            msg: e.to_string(),
        })?;
        let obj = value.as_object().ok_or_else(|| Error::Config {
            file: file.into(),
            field: "<root>".into(),
            msg: "expected a JSON object".into(),
        })?;
        let f = Fields { obj, file };
        unsupported(&f)?;
        let num_attention_heads = f.usize("num_attention_heads")?;
        let hidden_size = f.usize("hidden_size")?;
        let cfg = Config {
            vocab_size: f.usize("vocab_size")?,
            hidden_size,
            intermediate_size: f.usize("intermediate_size")?,
            num_hidden_layers: f.usize("num_hidden_layers")?,
            num_attention_heads,
            // HF defaults: kv heads = attention heads, head_dim = hidden / heads.
            num_key_value_heads: f.opt_usize("num_key_value_heads")?.unwrap_or(num_attention_heads),
            head_dim: f.opt_usize("head_dim")?.unwrap_or(hidden_size / num_attention_heads.max(1)),
            // transformers >= 5 nests rope_theta under rope_parameters.
            rope_theta: match f.opt_f64("rope_theta")? {
                Some(t) => t,
                None => obj
                    .get("rope_parameters")
                    .and_then(|r| r.get("rope_theta"))
                    .and_then(Value::as_f64)
                    .unwrap_or(10_000.0),
            },
            rms_norm_eps: f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6),
            max_position_embeddings: f.opt_usize("max_position_embeddings")?.unwrap_or(32_768),
            tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            attention_bias: f.opt_bool("attention_bias")?.unwrap_or(false),
            bos_token_id: f.opt_token_id("bos_token_id")?,
            eos_token_id: f.opt_token_id("eos_token_id")?,
            // transformers >= 4.56 writes `dtype` instead of `torch_dtype`.
            torch_dtype: match f.opt_str("torch_dtype")? {
                Some(d) => d,
                None => f.opt_str("dtype")?.unwrap_or_else(|| "float32".into()),
            },
        };
        cfg.validate(file)?;
        Ok(cfg)
    }

    /// Checks the invariants the model relies on, once, with a clear message.
    pub fn validate(&self, file: &str) -> Result<()> {
        let bad = |field: &str, msg: String| Error::Config { file: file.into(), field: field.into(), msg };
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(bad(name, "must be positive, found 0".into()));
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(bad(
                "num_key_value_heads",
                format!(
                    "must divide num_attention_heads ({}), found {}",
                    self.num_attention_heads, self.num_key_value_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(bad(
                "head_dim",
                format!("must be even for rotary embeddings, found {}", self.head_dim),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(bad("rope_theta", format!("must be a positive number, found {}", self.rope_theta)));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(bad(
                "rms_norm_eps",
                format!("must be a positive number, found {}", self.rms_norm_eps),
            ));
        }
        // A special token outside the vocabulary would stop generation never (eos) or
        // index past the embedding (bos).
        for (name, id) in [("bos_token_id", self.bos_token_id), ("eos_token_id", self.eos_token_id)] {
            if let Some(id) = id.filter(|&id| id as usize >= self.vocab_size) {
                return Err(bad(
                    name,
                    format!("token id {id} is outside the vocabulary (vocab_size {})", self.vocab_size),
                ));
            }
        }
        parse_dtype(&self.torch_dtype).map_err(|_| {
            bad("torch_dtype", format!("expected float32, bfloat16 or float16, found {:?}", self.torch_dtype))
        })?;
        Ok(())
    }

    /// The Hugging Face `config.json` text for this configuration.
    pub fn to_hf_json(&self) -> Value {
        let mut v = serde_json::to_value(self).unwrap_or(Value::Null);
        if let Some(obj) = v.as_object_mut() {
            obj.insert("architectures".into(), Value::from(vec!["Qwen3ForCausalLM"]));
            obj.insert("model_type".into(), Value::from("qwen3"));
            obj.insert("hidden_act".into(), Value::from("silu"));
            obj.insert("attention_dropout".into(), Value::from(0.0));
            obj.insert("initializer_range".into(), Value::from(0.02));
            obj.insert("use_cache".into(), Value::from(true));
            obj.insert("use_sliding_window".into(), Value::from(false));
            obj.insert("sliding_window".into(), Value::Null);
            obj.insert("max_window_layers".into(), Value::from(self.num_hidden_layers));
            obj.insert("rope_scaling".into(), Value::Null);
            obj.insert("transformers_version".into(), Value::from("4.51.0"));
        }
        v
    }

    /// Number of parameters (embedding counted once when tied).
    pub fn num_params(&self) -> usize {
        let (h, i, d) = (self.hidden_size, self.intermediate_size, self.head_dim);
        let (nq, nkv) = (self.num_attention_heads, self.num_key_value_heads);
        let attn = h * nq * d + 2 * h * nkv * d + nq * d * h + 2 * d;
        let bias = if self.attention_bias { nq * d + 2 * nkv * d + h } else { 0 };
        let layer = attn + bias + 3 * h * i + 2 * h;
        let emb = self.vocab_size * h;
        let head = if self.tie_word_embeddings { 0 } else { emb };
        emb + head + self.num_hidden_layers * layer + h
    }
}

/// Refuses every `config.json` value that changes the math of `Qwen3Config`
/// away from what [`super::qwen3`] computes, naming the field and the value.
/// Absent and `null` fields take HF's defaults, which are all supported.
fn unsupported(f: &Fields) -> Result<()> {
    let bad = |field: &str, v: &Value, why: &str| f.err(field, format!("{v} is not supported: {why}"));
    if let Some(v) = f.get("model_type") {
        if v.as_str() != Some("qwen3") {
            return Err(bad("model_type", v, "only \"qwen3\" (dense Qwen3) is implemented"));
        }
    }
    if let Some(v) = f.get("architectures") {
        let names = v.as_array().map(|a| a.iter().filter_map(Value::as_str).collect::<Vec<_>>());
        if !names.is_some_and(|n| n.contains(&"Qwen3ForCausalLM")) {
            return Err(bad("architectures", v, "expected [\"Qwen3ForCausalLM\"]"));
        }
    }
    if let Some(v) = f.get("hidden_act") {
        if v.as_str() != Some("silu") {
            return Err(bad("hidden_act", v, "the MLP implements only \"silu\" (SwiGLU)"));
        }
    }
    // transformers 4.x spells it rope_scaling (`rope_type`, or `type` before 4.45);
    // 5.x folds it into rope_parameters next to rope_theta.
    for field in ["rope_scaling", "rope_parameters"] {
        if let Some(v) = f.get(field) {
            let kind = v.get("rope_type").or_else(|| v.get("type")).filter(|k| !k.is_null());
            let default = match kind {
                // No type: default only if nothing else asks for scaling.
                None => v.as_object().is_some_and(|o| {
                    o.iter().all(|(k, x)| {
                        x.is_null() || ["rope_theta", "rope_type", "type"].contains(&k.as_str())
                    })
                }),
                Some(k) => k.as_str() == Some("default"),
            };
            if !default {
                return Err(bad(
                    field,
                    v,
                    "only the default rotary embedding (rope_type \"default\") is implemented",
                ));
            }
        }
    }
    if let Some(v) = f.get("use_sliding_window") {
        if v.as_bool() != Some(false) {
            // sliding_window with use_sliding_window false is ignored, as in HF.
            return Err(bad("use_sliding_window", v, "only full causal attention is implemented"));
        }
    }
    if let Some(v) = f.get("layer_types") {
        let full = v.as_array().is_some_and(|a| a.iter().all(|t| t.as_str() == Some("full_attention")));
        if !full {
            return Err(bad("layer_types", v, "every layer must be \"full_attention\""));
        }
        let (n, layers) = (v.as_array().map_or(0, Vec::len), f.get("num_hidden_layers"));
        if layers.and_then(Value::as_u64).is_some_and(|l| l as usize != n) {
            return Err(f.err(
                "layer_types",
                format!("has {n} entries but num_hidden_layers is {}", layers.unwrap_or(&Value::Null)),
            ));
        }
    }
    if let Some(v) = f.get("attention_bias") {
        // layer.rs carries q/k/v/o biases, but no test holds them against
        // transformers yet (the HF fixtures have none): refused until one does.
        if v.as_bool() == Some(true) {
            return Err(bad("attention_bias", v, "attention biases are not verified against transformers"));
        }
    }
    if let Some(v) = f.get("attention_dropout") {
        if v.as_f64() != Some(0.0) {
            return Err(bad("attention_dropout", v, "attention dropout is not implemented (must be 0)"));
        }
    }
    // Rotating only part of each head (GLM, Phi, NeoX style) is not Qwen3's math.
    let partial =
        f.get("partial_rotary_factor").or_else(|| f.get("rope_parameters")?.get("partial_rotary_factor"));
    if let Some(v) = partial.filter(|v| !v.is_null()) {
        if v.as_f64() != Some(1.0) {
            return Err(bad("partial_rotary_factor", v, "rotary embeddings cover the whole head_dim here"));
        }
    }
    if let Some(v) = f.get("quantization_config") {
        return Err(bad("quantization_config", v, "quantized checkpoints are not implemented"));
    }
    Ok(())
}

/// Maps a Hugging Face dtype name to a candle dtype.
pub fn parse_dtype(name: &str) -> Result<DType> {
    match name {
        "float32" | "f32" | "fp32" => Ok(DType::F32),
        "bfloat16" | "bf16" => Ok(DType::BF16),
        "float16" | "f16" | "fp16" | "half" => Ok(DType::F16),
        other => {
            Err(Error::invalid(format!("unknown dtype {other:?}: expected float32, bfloat16 or float16")))
        }
    }
}

/// Parses a device name: `cpu`, `cuda` or `cuda:N` (CUDA needs the `cuda` feature).
pub fn parse_device(name: &str) -> Result<candle_core::Device> {
    let cuda = |n: usize| {
        candle_core::Device::new_cuda(n).map_err(|e| {
            Error::invalid(format!("device {name:?}: {e} (was stapo built with --features cuda?)"))
        })
    };
    match name {
        "cpu" => Ok(candle_core::Device::Cpu),
        "cuda" => cuda(0),
        s => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => cuda(n),
            _ => Err(Error::invalid(format!("device: expected cpu, cuda or cuda:N, found {name:?}"))),
        },
    }
}

/// The Hugging Face name of a candle float dtype.
pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    }
}

/// Typed access to the fields of a JSON object, with errors naming the field.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    file: &'a str,
}

impl Fields<'_> {
    fn err(&self, field: &str, msg: impl Into<String>) -> Error {
        Error::Config { file: self.file.into(), field: field.into(), msg: msg.into() }
    }

    fn get(&self, field: &str) -> Option<&Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }

    fn usize(&self, field: &str) -> Result<usize> {
        self.opt_usize(field)?.ok_or_else(|| self.err(field, "missing required field"))
    }

    fn opt_usize(&self, field: &str) -> Result<Option<usize>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| self.err(field, format!("expected a non-negative integer, found {v}"))),
        }
    }

    fn opt_f64(&self, field: &str) -> Result<Option<f64>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => {
                v.as_f64().map(Some).ok_or_else(|| self.err(field, format!("expected a number, found {v}")))
            }
        }
    }

    fn opt_bool(&self, field: &str) -> Result<Option<bool>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(field, format!("expected true or false, found {v}"))),
        }
    }

    fn opt_str(&self, field: &str) -> Result<Option<String>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(|s| Some(s.to_string()))
                .ok_or_else(|| self.err(field, format!("expected a string, found {v}"))),
        }
    }

    /// A token id, or the first of a list of ids (HF allows both for eos).
    fn opt_token_id(&self, field: &str) -> Result<Option<u32>> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::Array(a)) if a.is_empty() => Ok(None),
            Some(Value::Array(a)) => a[0]
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| self.err(field, format!("expected a token id, found {}", a[0]))),
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| self.err(field, format!("expected a token id, found {v}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: &str = r#"{"vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
        "tie_word_embeddings": true, "torch_dtype": "float32", "some_future_field": [1, 2]}"#;

    #[test]
    fn parses_and_ignores_unknown_fields() {
        let c = Config::from_json_str(TINY, "config.json").unwrap();
        assert_eq!(c.vocab_size, 384);
        assert_eq!(c.num_key_value_heads, 2);
        assert!(c.tie_word_embeddings);
        assert!(!c.attention_bias);
    }

    /// The config.json of models/tiny-qwen3, as transformers 4.51 writes it.
    const HF: &str = r#"{"architectures": ["Qwen3ForCausalLM"], "attention_bias": false,
        "attention_dropout": 0.0, "bos_token_id": null, "eos_token_id": 0, "head_dim": 48,
        "hidden_act": "silu", "hidden_size": 192, "initializer_range": 0.02, "intermediate_size": 512,
        "max_position_embeddings": 512, "max_window_layers": 4, "model_type": "qwen3",
        "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_scaling": null, "rope_theta": 10000.0, "sliding_window": null, "tie_word_embeddings": true,
        "torch_dtype": "float32", "transformers_version": "4.51.0", "use_cache": true,
        "use_sliding_window": false, "vocab_size": 271}"#;

    /// `HF` with `field` set to `value` (added when absent).
    fn with(field: &str, value: &str) -> String {
        let mut v: Value = serde_json::from_str(HF).unwrap();
        v[field] = serde_json::from_str(value).unwrap();
        v.to_string()
    }

    #[test]
    fn unsupported_values_are_refused_naming_field_and_value() {
        Config::from_json_str(HF, "m/config.json").unwrap();
        for (field, value, shown) in [
            ("rope_scaling", r#"{"rope_type": "yarn", "factor": 4.0}"#, "yarn"),
            ("rope_scaling", r#"{"type": "linear", "factor": 2.0}"#, "linear"),
            ("rope_scaling", r#"{"factor": 2.0, "rope_type": null}"#, "factor"),
            ("rope_scaling", r#""dynamic""#, "dynamic"),
            ("rope_parameters", r#"{"rope_theta": 1e6, "rope_type": "llama3", "factor": 8.0}"#, "llama3"),
            ("use_sliding_window", "true", "true"),
            ("hidden_act", r#""gelu""#, "gelu"),
            ("hidden_act", r#""gelu_pytorch_tanh""#, "gelu_pytorch_tanh"),
            ("attention_bias", "true", "true"),
            ("model_type", r#""qwen3_moe""#, "qwen3_moe"),
            ("model_type", r#""llama""#, "llama"),
            ("architectures", r#"["Qwen3ForSequenceClassification"]"#, "Qwen3ForSequenceClassification"),
            ("attention_dropout", "0.1", "0.1"),
            (
                "layer_types",
                r#"["full_attention", "sliding_attention", "full_attention", "full_attention"]"#,
                "sliding_attention",
            ),
            ("layer_types", r#"["full_attention", "full_attention"]"#, "2 entries"),
            ("partial_rotary_factor", "0.5", "0.5"),
            ("quantization_config", r#"{"quant_method": "gptq", "bits": 4}"#, "gptq"),
            ("rope_theta", "-1.0", "-1"),
            ("rope_theta", "0.0", "0"),
            ("head_dim", "47", "47"),
            ("tie_word_embeddings", r#""yes""#, "yes"),
        ] {
            let text = with(field, value);
            let err = Config::from_json_str(&text, "m/config.json").unwrap_err().to_string();
            assert!(
                err.contains("m/config.json") && err.contains(&format!("`{field}`")) && err.contains(shown),
                "{field} = {value}: {err}"
            );
        }
    }

    #[test]
    fn supported_spellings_of_the_defaults_load() {
        for (field, value) in [
            ("rope_scaling", r#"{"rope_type": "default"}"#),
            ("rope_scaling", r#"{"type": "default"}"#),
            ("rope_parameters", r#"{"rope_theta": 10000.0, "rope_type": "default"}"#),
            // HF ignores sliding_window while use_sliding_window is false.
            ("sliding_window", "4096"),
            ("max_window_layers", "2"),
            ("use_sliding_window", "null"),
            ("layer_types", r#"["full_attention", "full_attention", "full_attention", "full_attention"]"#),
            ("attention_dropout", "0"),
            ("partial_rotary_factor", "1.0"),
            ("architectures", "null"),
            ("hidden_act", "null"),
        ] {
            let text = with(field, value);
            let c = Config::from_json_str(&text, "m/config.json").unwrap_or_else(|e| panic!("{field}: {e}"));
            assert_eq!(c, Config::from_json_str(HF, "m/config.json").unwrap(), "{field} = {value}");
        }
    }

    #[test]
    fn missing_field_is_named() {
        let text = TINY.replace("\"vocab_size\": 384,", "");
        let err = Config::from_json_str(&text, "m/config.json").unwrap_err().to_string();
        assert!(
            err.contains("m/config.json") && err.contains("vocab_size") && err.contains("missing"),
            "{err}"
        );
    }

    #[test]
    fn invalid_field_is_named() {
        let text = TINY.replace("\"hidden_size\": 64", "\"hidden_size\": \"wide\"");
        let err = Config::from_json_str(&text, "c.json").unwrap_err().to_string();
        assert!(err.contains("hidden_size") && err.contains("integer"), "{err}");
        let text = TINY.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3");
        let err = Config::from_json_str(&text, "c.json").unwrap_err().to_string();
        assert!(err.contains("num_key_value_heads") && err.contains("divide"), "{err}");
        let text = TINY.replace("\"float32\"", "\"int8\"");
        let err = Config::from_json_str(&text, "c.json").unwrap_err().to_string();
        assert!(err.contains("torch_dtype"), "{err}");
    }

    #[test]
    fn newer_transformers_spellings_are_read() {
        let text = TINY.replace("\"torch_dtype\": \"float32\"", "\"dtype\": \"bfloat16\"").replace(
            "\"rope_theta\": 10000.0,",
            "\"rope_parameters\": {\"rope_theta\": 5000.0, \"rope_type\": \"default\"},",
        );
        let c = Config::from_json_str(&text, "c.json").unwrap();
        assert_eq!(c.torch_dtype, "bfloat16");
        assert_eq!(c.rope_theta, 5000.0);
    }

    #[test]
    fn eos_may_be_a_list() {
        let text = TINY.replace("\"torch_dtype\"", "\"eos_token_id\": [7, 9], \"torch_dtype\"");
        let c = Config::from_json_str(&text, "c.json").unwrap();
        assert_eq!(c.eos_token_id, Some(7));
    }

    #[test]
    fn hf_json_round_trips() {
        let c = Config::from_json_str(TINY, "c.json").unwrap();
        let text = serde_json::to_string(&c.to_hf_json()).unwrap();
        assert_eq!(Config::from_json_str(&text, "c.json").unwrap(), c);
    }

    #[test]
    fn counts_parameters_of_the_16m_shape() {
        let c = Config::from_json_str(
            r#"{"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
                "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "tie_word_embeddings": true}"#,
            "c.json",
        )
        .unwrap();
        // 8192*512 + 4*(512*512 + 2*512*256 + 512*512 + 128 + 3*512*1536 + 1024) + 512 (final norm)
        assert_eq!(c.num_params(), 16_782_336);
    }
}
