//! Conversions between Rhai values and the host's serde types: a script map
//! becomes JSON, is laid over a default's JSON and deserialised once
//! ([`crate::overlay`]), so every config struct (`RunConfig`, `SamplingParams`, ...)
//! accepts partial maps with the same field names as its JSON form, and errors name the
//! field's dotted path.
//!
//! JSON is the intermediate rather than `rhai::serde::from_dynamic`, whose deserialiser
//! takes an `f32` field only from a Rhai value holding an `f32` (a script's `0.002` is an
//! `f64`) and a float field not from an integer (`temperature: 1`).

use rhai::{Array, Dynamic, Map};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use super::error::{bad_arg, host, RhaiResult};
use crate::rollout::SamplingParams;

/// A Rhai value as JSON (maps, arrays, strings, numbers, booleans, `()` → null).
pub fn to_json(what: &str, d: &Dynamic) -> RhaiResult<Value> {
    if d.is_unit() {
        return Ok(Value::Null);
    }
    if let Ok(b) = d.as_bool() {
        return Ok(Value::Bool(b));
    }
    if let Ok(i) = d.as_int() {
        return Ok(Value::from(i));
    }
    if let Ok(f) = d.as_float() {
        return serde_json::Number::from_f64(f)
            .map(Value::Number)
            .ok_or_else(|| bad_arg(what, format!("expected a finite number, found {f}")));
    }
    if d.is_string() || d.is_char() {
        return Ok(Value::String(d.to_string()));
    }
    if d.is_array() {
        let arr =
            d.clone().into_array().map_err(|t| bad_arg(what, format!("expected an array, found {t}")))?;
        return arr.iter().map(|x| to_json(what, x)).collect::<RhaiResult<Vec<_>>>().map(Value::Array);
    }
    if d.is_map() {
        let m = d.clone().cast::<Map>();
        let mut out = serde_json::Map::new();
        for (k, v) in &m {
            out.insert(k.to_string(), to_json(&format!("{what}.{k}"), v)?);
        }
        return Ok(Value::Object(out));
    }
    Err(bad_arg(what, format!("cannot convert a value of type {} to data", d.type_name())))
}

/// JSON as a Rhai value (integers stay integers).
pub fn from_json(v: &Value) -> Dynamic {
    match v {
        Value::Null => Dynamic::UNIT,
        Value::Bool(b) => (*b).into(),
        Value::Number(n) => match n.as_i64() {
            Some(i) => i.into(),
            None => n.as_f64().unwrap_or(f64::NAN).into(),
        },
        Value::String(s) => s.clone().into(),
        Value::Array(a) => Dynamic::from_array(a.iter().map(from_json).collect::<Array>()),
        Value::Object(o) => {
            let mut m = Map::new();
            for (k, v) in o {
                m.insert(k.as_str().into(), from_json(v));
            }
            Dynamic::from_map(m)
        }
    }
}

/// Any serialisable host value as a Rhai value.
pub fn to_dynamic<T: Serialize>(x: &T) -> RhaiResult<Dynamic> {
    serde_json::to_value(x).map(|v| from_json(&v)).map_err(host)
}

/// `T` from `base` with the fields of the script map `over` laid on top (the one converter,
/// [`crate::overlay::build`]); `what` names the argument in errors (e.g. `sampling`), which
/// name the key's dotted path and, for an unknown key, the nearest valid one.
pub fn overlay<T: Serialize + DeserializeOwned>(what: &str, base: &T, over: Value) -> RhaiResult<T> {
    let base = serde_json::to_value(base).map_err(host)?;
    crate::overlay::build(what, &base, &over).map_err(|e| config_arg(what, e))
}

/// A configuration error as a bad argument of `what`: "what: `key`: message".
pub fn config_arg(what: &str, e: crate::Error) -> Box<rhai::EvalAltResult> {
    match e {
        crate::Error::Config { field, msg, .. } => bad_arg(what, format!("`{field}`: {msg}")),
        other => bad_arg(what, other),
    }
}

/// The one converter from a script's option map to a typed option struct
/// (`#[serde(default, deny_unknown_fields)]`): absent keys take the struct's
/// defaults, an unknown key is an error naming the nearest valid one, and a value of
/// the wrong type or range (a negative count, a string for a number) is an
/// error naming its key. `what` names the argument (e.g. `evaluate opts`).
pub fn options<T: DeserializeOwned>(what: &str, m: &Map) -> RhaiResult<T> {
    let over = to_json(what, &Dynamic::from_map(m.clone()))?;
    crate::overlay::build(what, &Value::Object(Default::default()), &over).map_err(|e| config_arg(what, e))
}

/// `SamplingParams` from a script map laid over `base` (`n`, `temperature`,
/// `top_p`, `top_k`, `max_tokens`, `stop`, `seed`, ...); keys that are not sampling
/// fields (`template`) are ignored here.
pub fn sampling_from_map(base: &SamplingParams, m: &Map) -> RhaiResult<SamplingParams> {
    let mut m = m.clone();
    m.remove("template");
    overlay("sampling", base, to_json("sampling", &Dynamic::from_map(m))?)
}

/// An `f32` as the `f64` with the same shortest decimal form (0.01f32 → 0.01, not 0.009999999776).
pub fn clean_f64(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

/// A number argument (int or float).
pub fn num(d: &Dynamic) -> Option<f64> {
    d.as_float().ok().or_else(|| d.as_int().ok().map(|i| i as f64))
}

/// `m[key]` as a number, if present.
pub fn get_num(m: &Map, key: &str) -> RhaiResult<Option<f64>> {
    match m.get(key) {
        None => Ok(None),
        Some(d) if d.is_unit() => Ok(None),
        Some(d) => num(d)
            .map(Some)
            .ok_or_else(|| bad_arg(key, format!("expected a number, found {}", d.type_name()))),
    }
}

/// `m[key]` as a string, if present.
pub fn get_str(m: &Map, key: &str) -> RhaiResult<Option<String>> {
    match m.get(key) {
        None => Ok(None),
        Some(d) if d.is_unit() => Ok(None),
        Some(d) if d.is_string() => Ok(Some(d.to_string())),
        Some(d) => Err(bad_arg(key, format!("expected a string, found {}", d.type_name()))),
    }
}

/// A count or index argument: a negative number is an error naming `what`.
pub fn usize_arg(what: &str, i: i64) -> RhaiResult<usize> {
    usize::try_from(i).map_err(|_| bad_arg(what, format!("expected a non-negative integer, found {i}")))
}

/// A seed argument: a negative number is an error naming `what`.
pub fn u64_arg(what: &str, i: i64) -> RhaiResult<u64> {
    u64::try_from(i).map_err(|_| bad_arg(what, format!("expected a non-negative integer, found {i}")))
}

/// Parses a `--set` value: integer, float, bool, else string.
pub fn parse_cli_value(s: &str) -> Dynamic {
    if let Ok(i) = s.parse::<i64>() {
        return i.into();
    }
    if let Ok(f) = s.parse::<f64>() {
        return f.into();
    }
    match s {
        "true" => true.into(),
        "false" => false.into(),
        _ => s.to_string().into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::script::error::message;

    #[test]
    fn overlay_keeps_defaults_and_names_bad_fields() {
        let engine = rhai::Engine::new();
        let m: Map = engine.eval("#{ n: 4, temperature: 1, max_tokens: 16 }").unwrap();
        let v = to_json("sampling", &Dynamic::from_map(m)).unwrap();
        let p: SamplingParams = overlay("sampling", &SamplingParams::default(), v).unwrap();
        assert_eq!((p.n, p.temperature, p.max_new_tokens, p.top_p), (4, 1.0, 16, 1.0));
        let bad: Map = engine.eval("#{ nn: 4 }").unwrap();
        let e = overlay::<SamplingParams>(
            "sampling",
            &SamplingParams::default(),
            to_json("s", &Dynamic::from_map(bad)).unwrap(),
        )
        .unwrap_err();
        let e = message(&e);
        assert!(e.contains("nn"), "{e}");
    }

    #[derive(serde::Deserialize, Debug, PartialEq)]
    #[serde(default, deny_unknown_fields)]
    struct Opts {
        n: usize,
        name: String,
        lr: f64,
    }

    impl Default for Opts {
        fn default() -> Self {
            Opts { n: 4, name: "x".into(), lr: 0.5 }
        }
    }

    fn opts(src: &str) -> Result<Opts, String> {
        let m: Map = rhai::Engine::new().eval(src).unwrap();
        options("f opts", &m).map_err(|e| message(&e))
    }

    #[test]
    fn options_take_defaults_and_name_the_bad_key() {
        assert_eq!(opts("#{}").unwrap(), Opts::default());
        assert_eq!(opts("#{ n: 2, lr: 1 }").unwrap(), Opts { n: 2, lr: 1.0, ..Opts::default() });
        // A negative count is an error naming it, never a wrapped usize.
        let e = opts("#{ name: \"a\", n: -3 }").unwrap_err();
        assert!(e.contains("f opts") && e.contains("`n`") && e.contains("-3"), "{e}");
        let e = opts("#{ name: 5 }").unwrap_err();
        assert!(e.contains("`name`") && e.contains("expected a string"), "{e}");
        // An unknown key lists the valid ones.
        let e = opts("#{ nn: 1 }").unwrap_err();
        assert!(e.contains("`nn`") && e.contains("did you mean `n`?") && e.contains("n, name, lr"), "{e}");
    }

    #[test]
    fn json_round_trip() {
        let v: Value = serde_json::json!({"a": [1, 2.5, "x", null, true], "b": {"c": 3}});
        let d = from_json(&v);
        assert_eq!(to_json("x", &d).unwrap(), v);
    }
}
