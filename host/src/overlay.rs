//! Typed configuration from layers of JSON, the one converter behind the run
//! configuration, `--set`, script option maps and hook return maps: a default's serde
//! form, with a user's partial form laid on top, deserialised once into a
//! `#[serde(deny_unknown_fields)]` type.
//!
//! Layering follows Hydra/OmegaConf as verl uses it (defaults, then the user's file, then
//! `a.b=c` overrides): objects merge key by key, anything else replaces, and a tagged
//! object whose `kind` changes is replaced whole, so it takes the new kind's serde
//! defaults (`loss: #{kind: "gspo"}` over a PPO loss is GSPO with its own eps, never PPO's
//! eps under a GSPO tag).
//!
//! Errors name the dotted path of the offending key (`actor.optim.lrr`) and, for an
//! unknown key, the nearest valid name: the path is found by narrowing the user's layer to
//! the smallest part that still fails, because serde's own messages carry no path.

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::{Error, Result};

/// Deep-merges `over` into `base`: objects merge key by key, anything else replaces; an
/// object whose `kind` differs from the base object's replaces it whole.
pub fn merge(base: &mut Value, over: Value) {
    match (base, over) {
        (Value::Object(b), Value::Object(o)) if !switches_kind(b, &o) => {
            for (k, v) in o {
                match b.get_mut(&k) {
                    Some(slot) => merge(slot, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, o) => *b = o,
    }
}

/// Whether `over` names another `kind` than `base` has.
fn switches_kind(base: &Map<String, Value>, over: &Map<String, Value>) -> bool {
    matches!((base.get("kind"), over.get("kind")), (Some(a), Some(b)) if a != b)
}

/// `T` from `base` with `over` merged on top. `what` names the configuration in errors
/// (`run config`, `thresholds hook`); the error's field is the dotted path of the key at
/// fault, with the nearest valid name when the key is unknown.
pub fn build<T: DeserializeOwned>(what: &str, base: &Value, over: &Value) -> Result<T> {
    let mut v = base.clone();
    merge(&mut v, over.clone());
    match serde_json::from_value::<T>(v) {
        Ok(t) => Ok(t),
        Err(e) => {
            let (path, msg) = locate::<T>(base, over, &mut Vec::new()).unwrap_or((Vec::new(), e.to_string()));
            Err(config_error(what, &path.join("."), &msg))
        }
    }
}

/// The smallest part of `over` (below `prefix`) that fails on its own over `base`: its path
/// and serde's message. `None` when no single key fails alone (only their combination).
fn locate<T: DeserializeOwned>(
    base: &Value,
    over: &Value,
    prefix: &mut Vec<String>,
) -> Option<(Vec<String>, String)> {
    let Value::Object(o) = over else { return None };
    for (k, x) in o {
        let one = Value::Object([(k.clone(), x.clone())].into_iter().collect());
        let mut v = base.clone();
        merge(&mut v, nest(prefix, one));
        let Err(e) = serde_json::from_value::<T>(v) else { continue };
        prefix.push(k.clone());
        if let Some(found) = locate::<T>(base, x, prefix) {
            return Some(found);
        }
        // Only the keys together fail (a key of another `kind` than the one they switch
        // to): an unknown key still names its own path.
        let msg = e.to_string();
        let unknown = msg.strip_prefix("unknown field `").and_then(|r| r.split_once('`')).map(|(n, _)| n);
        if let Some(name) = unknown.filter(|n| x.get(*n).is_some()) {
            prefix.push(name.to_string());
        }
        return Some((prefix.clone(), msg));
    }
    None
}

/// `leaf` wrapped in objects named by `path`.
fn nest(path: &[String], leaf: Value) -> Value {
    path.iter().rev().fold(leaf, |v, k| Value::Object([(k.clone(), v)].into_iter().collect()))
}

/// The configuration error for `path`: serde's message, with the nearest valid name of an
/// unknown key (serde lists the valid ones).
pub fn config_error(what: &str, path: &str, msg: &str) -> Error {
    let msg = if let Some(rest) = msg.strip_prefix("unknown field `") {
        unknown("key", rest)
    } else if let Some(rest) = msg.strip_prefix("unknown variant `") {
        unknown("value", rest)
    } else {
        msg.to_string()
    };
    let field = if path.is_empty() { "<root>" } else { path };
    Error::Config { file: what.into(), field: field.into(), msg }
}

/// serde's "unknown field `x`, expected one of `a`, `b`" (`rest` follows the first
/// backtick) as "unknown key `x`; did you mean `a`? (valid: a, b)".
fn unknown(what: &str, rest: &str) -> String {
    let (name, tail) = rest.split_once('`').unwrap_or((rest, ""));
    let valid = backticked(tail);
    match nearest(name, valid.iter().map(String::as_str)) {
        Some(n) => format!("unknown {what} `{name}`; did you mean `{n}`? (valid: {})", valid.join(", ")),
        None => format!("unknown {what} `{name}` (valid: {})", valid.join(", ")),
    }
}

/// The words between backticks of `s`.
fn backticked(s: &str) -> Vec<String> {
    s.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

/// The candidate closest to `word` by edit distance (ignoring case), if it is close
/// enough to be a likely misspelling: at most a third of the longer name's length.
pub fn nearest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let w = word.to_ascii_lowercase();
    candidates
        .into_iter()
        .map(|c| (levenshtein(&w, &c.to_ascii_lowercase()), c))
        .filter(|(d, c)| *d <= c.len().max(w.len()).div_ceil(3))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// Edit distance (insertions, deletions, substitutions) between two strings.
fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (diag + usize::from(ca != *cb)).min(row[j] + 1).min(row[j + 1] + 1);
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// Sets the dotted `path` (`actor.optim.lr`) of the object `v` to `value`, creating the
/// objects on the way (a non-object on the way is replaced).
pub fn set_dotted(v: &mut Value, path: &str, value: Value) {
    let mut slot = v;
    for p in path.split('.') {
        if !slot.is_object() {
            *slot = Value::Object(Map::new());
        }
        let Value::Object(o) = slot else { return };
        slot = o.entry(p.to_string()).or_insert(Value::Null);
    }
    *slot = value;
}

/// Every leaf path of `v` (`actor.optim.lr`), objects walked in key order (a null is a
/// leaf, an empty object has none).
pub fn leaves(v: &Value) -> Vec<String> {
    fn walk(v: &Value, path: &str, out: &mut Vec<String>) {
        match v {
            Value::Object(o) => {
                for (k, x) in o {
                    let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                    walk(x, &p, out);
                }
            }
            _ => out.push(path.to_string()),
        }
    }
    let mut out = Vec::new();
    walk(v, "", &mut out);
    out
}

/// `paths` for people, one line per parent: `actor.optim.{beta1,eps,lr}`, the leaves of
/// the top level together on the first line.
pub fn paths_help(paths: &[String]) -> String {
    let mut groups: Vec<(&str, Vec<&str>)> = Vec::new();
    for p in paths {
        let (parent, leaf) = p.rsplit_once('.').unwrap_or(("", p));
        match groups.iter_mut().find(|(g, _)| *g == parent) {
            Some((_, leaves)) => leaves.push(leaf),
            None => groups.push((parent, vec![leaf])),
        }
    }
    groups.sort_by_key(|(g, _)| !g.is_empty());
    let line = |(g, l): &(&str, Vec<&str>)| match (g.is_empty(), l.as_slice()) {
        (true, _) => l.join(", "),
        (false, [one]) => format!("{g}.{one}"),
        (false, _) => format!("{g}.{{{}}}", l.join(",")),
    };
    groups.iter().map(line).collect::<Vec<_>>().join("\n")
}

/// The value at the dotted `path` of `v`, if there is one.
pub fn get_dotted<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(v, |v, p| v.get(p))
}

/// A `--set` value: JSON when it parses as JSON (numbers, `true`, `null`, `[1, 4]`,
/// `{"q": 0.5}`), `none` as null, anything else a string.
pub fn parse_value(raw: &str) -> Value {
    let t = raw.trim();
    if t.eq_ignore_ascii_case("none") {
        return Value::Null;
    }
    serde_json::from_str(t).unwrap_or_else(|_| Value::String(t.to_string()))
}

/// The leaves where `a` and `b` differ, as (dotted path, value in `a`, value in `b`);
/// an object against a non-object counts as one leaf.
pub fn diff(a: &Value, b: &Value) -> Vec<(String, Value, Value)> {
    let mut out = Vec::new();
    diff_into(a, b, &mut String::new(), &mut out);
    out
}

fn diff_into(a: &Value, b: &Value, path: &mut String, out: &mut Vec<(String, Value, Value)>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys().filter(|k| !x.contains_key(*k))).collect();
            keys.sort();
            for k in keys {
                let len = path.len();
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(k);
                diff_into(x.get(k).unwrap_or(&Value::Null), y.get(k).unwrap_or(&Value::Null), path, out);
                path.truncate(len);
            }
        }
        _ if a != b => out.push((path.clone(), a.clone(), b.clone())),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use serde_json::json;

    #[test]
    fn leaves_and_their_help_lines() {
        let v = json!({"seed": 1, "actor": {"epochs": 1, "optim": {"lr": 1e-6, "eps": 1e-8}, "kl": null},
                       "extra": {}});
        let mut got = leaves(&v);
        got.sort();
        assert_eq!(got, ["actor.epochs", "actor.kl", "actor.optim.eps", "actor.optim.lr", "seed"]);
        assert_eq!(paths_help(&got), "seed\nactor.{epochs,kl}\nactor.optim.{eps,lr}");
    }

    #[derive(Deserialize, Debug, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Outer {
        lr: f64,
        inner: Inner,
        loss: Loss,
    }

    #[derive(Deserialize, Debug, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        n: usize,
        name: String,
    }

    #[derive(Deserialize, Debug, PartialEq)]
    #[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
    enum Loss {
        Ppo {
            #[serde(default = "eps")]
            eps: f32,
        },
        Sapo {
            #[serde(default = "tau")]
            tau: f32,
        },
    }

    fn eps() -> f32 {
        0.2
    }
    fn tau() -> f32 {
        1.05
    }

    fn base() -> Value {
        json!({"lr": 1e-6, "inner": {"n": 4, "name": "x"}, "loss": {"kind": "ppo", "eps": 0.3}})
    }

    fn err(over: Value) -> String {
        build::<Outer>("test config", &base(), &over).unwrap_err().to_string()
    }

    #[test]
    fn layers_merge_and_a_new_kind_takes_its_own_defaults() {
        let o: Outer = build("t", &base(), &json!({"inner": {"n": 2}})).unwrap();
        assert_eq!(o.inner, Inner { n: 2, name: "x".into() });
        assert_eq!(o.loss, Loss::Ppo { eps: 0.3 });
        // Switching the kind drops PPO's eps instead of failing on it.
        let o: Outer = build("t", &base(), &json!({"loss": {"kind": "sapo"}})).unwrap();
        assert_eq!(o.loss, Loss::Sapo { tau: 1.05 });
        // The same kind merges.
        let o: Outer = build("t", &base(), &json!({"loss": {"kind": "ppo"}})).unwrap();
        assert_eq!(o.loss, Loss::Ppo { eps: 0.3 });
    }

    #[test]
    fn errors_name_the_dotted_path_and_the_nearest_name() {
        let e = err(json!({"inner": {"nn": 2}}));
        assert!(e.contains("field `inner.nn`") && e.contains("did you mean `n`?"), "{e}");
        let e = err(json!({"lrr": 2}));
        assert!(e.contains("field `lrr`") && e.contains("did you mean `lr`?"), "{e}");
        let e = err(json!({"inner": {"n": -2}}));
        assert!(e.contains("field `inner.n`") && e.contains("-2"), "{e}");
        let e = err(json!({"lr": "fast"}));
        assert!(e.contains("field `lr`") && e.contains("fast"), "{e}");
        // A key of another kind: the path and the valid keys of this kind.
        let e = err(json!({"loss": {"tau": 1.0}}));
        assert!(e.contains("field `loss.tau`") && e.contains("valid: eps"), "{e}");
        // Far from every name: no guess.
        let e = err(json!({"zzzzzz": 1}));
        assert!(e.contains("unknown key `zzzzzz` (valid: lr, inner, loss)"), "{e}");
    }

    #[test]
    fn nearest_and_dotted_helpers() {
        assert_eq!(nearest("tau_P", ["tau_p", "tau_h"]), Some("tau_p"));
        assert_eq!(nearest("lrr", ["lr", "seed"]), Some("lr"));
        assert_eq!(nearest("banana", ["lr", "seed"]), None);
        assert_eq!(levenshtein("kitten", "sitting"), 3);
        let mut v = json!({"a": {"b": 1}});
        set_dotted(&mut v, "a.c.d", json!(2));
        assert_eq!(v, json!({"a": {"b": 1, "c": {"d": 2}}}));
        assert_eq!(get_dotted(&v, "a.c.d"), Some(&json!(2)));
        assert_eq!(parse_value("1e-4"), json!(1e-4));
        assert_eq!(parse_value("[1, 4]"), json!([1, 4]));
        assert_eq!(parse_value("none"), Value::Null);
        assert_eq!(parse_value("fast"), json!("fast"));
        let d = diff(&json!({"a": {"b": 1, "c": 2}, "x": 1}), &json!({"a": {"b": 1, "c": 3}, "y": 1}));
        let paths: Vec<&str> = d.iter().map(|x| x.0.as_str()).collect();
        assert_eq!(paths, ["a.c", "x", "y"]);
    }
}
