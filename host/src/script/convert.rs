//! Conversions between Rhai values and the host's serde types: a script map
//! becomes JSON, is overlaid on a default's JSON and deserialised, so every
//! config struct (`RunConfig`, `SamplingParams`, ...) accepts partial maps with
//! the same field names as its JSON form, and errors name the field.

use rhai::{Array, Dynamic, Map};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use super::error::{bad_arg, host, RhaiResult};

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

/// Deep-merges `over` into `base`: objects merge key by key, anything else replaces.
pub fn merge_json(base: &mut Value, over: Value) {
    match (base, over) {
        (Value::Object(b), Value::Object(o)) => {
            for (k, v) in o {
                match b.get_mut(&k) {
                    Some(slot) if slot.is_object() && v.is_object() => merge_json(slot, v),
                    _ => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, o) => *b = o,
    }
}

/// `T` from `base` with the fields of the script map `over` laid on top;
/// `what` names the argument in errors (e.g. `sampling`).
pub fn overlay<T: Serialize + DeserializeOwned>(what: &str, base: &T, over: Value) -> RhaiResult<T> {
    let mut v = serde_json::to_value(base).map_err(host)?;
    merge_json(&mut v, over);
    serde_json::from_value(v).map_err(|e| bad_arg(what, e))
}

/// Sampling options as scripts write them: `max_tokens` is accepted for
/// `max_new_tokens` and `stop` for `stop_strings`.
pub fn sampling_json(mut v: Value) -> Value {
    if let Value::Object(o) = &mut v {
        for (alias, name) in [("max_tokens", "max_new_tokens"), ("stop", "stop_strings")] {
            if let Some(x) = o.remove(alias) {
                o.insert(name.into(), x);
            }
        }
    }
    v
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

/// A non-negative integer argument.
pub fn usize_arg(what: &str, i: i64) -> RhaiResult<usize> {
    usize::try_from(i).map_err(|_| bad_arg(what, format!("expected a non-negative integer, found {i}")))
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
    use crate::rollout::SamplingParams;

    #[test]
    fn overlay_keeps_defaults_and_names_bad_fields() {
        let engine = rhai::Engine::new();
        let m: Map = engine.eval("#{ n: 4, temperature: 1, max_tokens: 16 }").unwrap();
        let v = sampling_json(to_json("sampling", &Dynamic::from_map(m)).unwrap());
        let p: SamplingParams = overlay("sampling", &SamplingParams::default(), v).unwrap();
        assert_eq!((p.n, p.temperature, p.max_new_tokens, p.top_p), (4, 1.0, 16, 1.0));
        let bad: Map = engine.eval("#{ nn: 4 }").unwrap();
        let e = overlay::<SamplingParams>(
            "sampling",
            &SamplingParams::default(),
            to_json("s", &Dynamic::from_map(bad)).unwrap(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("nn"), "{e}");
    }

    #[test]
    fn json_round_trip() {
        let v: Value = serde_json::json!({"a": [1, 2.5, "x", null, true], "b": {"c": 3}});
        let d = from_json(&v);
        assert_eq!(to_json("x", &d).unwrap(), v);
    }
}
