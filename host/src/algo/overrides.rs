//! `--set key=value` overrides of an [`ObjectiveConfig`], as one converter over its serde
//! form: the config becomes a JSON value, the key's entry in [`ALIASES`] says where the
//! value goes (a short name for a path such as `eps_high` → `loss.eps_high`), the value
//! is parsed as that entry says, and the edited JSON is deserialised and validated again.
//! There is no hand-written setter per field: a new field is reachable as soon as it has
//! an alias line, and a new loss or mask variant as soon as its default exists.
//!
//! Tagged objects (`loss`, `mask`) switch variant by their `kind`: a switch replaces the
//! object by the new variant's defaults ([`PolicyLoss::default_of`]), so `kind=gspo` gets
//! GSPO's eps 3e-4/4e-4, not PPO's. Optional sections (`kl`, `overlong`) are created with
//! their defaults when one of their fields is set, and cleared by `none`.

use serde_json::{json, Map, Value};

use super::config::{cfg_err, MaskConfig, ObjectiveConfig, PolicyLoss, TauH};
use super::preset::DAPO_OVERLONG;
use crate::Result;

/// How the text of a value is read.
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// A finite number.
    Num,
    /// A non-negative integer.
    Int,
    /// A number, or `none` / `off` / `null`.
    OptNum,
    /// An integer, or `none` / `off` / `null`.
    OptInt,
    /// `true|on|yes|1` or `false|off|no|0`.
    Bool,
    /// One of the words (lower case, `-` read as `_`), each mapped to its serde name.
    Word(&'static [(&'static str, &'static str)]),
}

/// Where a value goes.
#[derive(Clone, Copy, Debug)]
enum Action {
    /// These paths of the JSON form (optional sections on the way are created).
    Set(&'static [&'static [&'static str]], Kind),
    /// The `kind` of the tagged object at this top-level key: a different kind replaces
    /// the object by that kind's defaults.
    Switch(&'static str, Kind),
    /// An optional section: `none` clears it, `on` creates it with its defaults (keeping
    /// one that exists), any other word sets its field.
    Toggle(&'static str, Option<&'static str>, Kind),
    /// The externally tagged object at the path becomes `{tag: number}` (an S2T `tau_h`).
    Tagged(&'static [&'static str], &'static str),
    /// One field of the S2T `tau_h` quantile (`q` or `over`), keeping the other; an
    /// absolute `tau_h` becomes the paper's quantile first.
    TauHQuantile(&'static str, Kind),
    /// `overlong.max_len`, with `cache_len` rescaled to keep its fraction of L_max (so
    /// that shrinking L_max for a small run stays valid; an explicit cache comes after).
    OverlongMaxLen,
}

/// One short key of `--set`.
#[derive(Clone, Copy, Debug)]
pub struct Alias {
    /// The key users type.
    pub key: &'static str,
    /// What the value must be, for help texts and errors.
    pub expects: &'static str,
    /// The tagged top-level object (and its kind) the key belongs to, when it has one:
    /// setting `rho` needs `mask.kind = top_entropy`.
    requires: Option<(&'static str, &'static [&'static str])>,
    action: Action,
    /// Overrides apply in this order whatever order they come in: switches first, then
    /// L_max (which rescales the buffer), then the rest.
    order: u8,
}

const NONE_WORDS: [&str; 3] = ["none", "off", "null"];
const OVER: &[(&str, &str)] = &[("response", "response"), ("candidates", "candidates")];
const LOSS_KINDS: &[(&str, &str)] = &[("ppo", "ppo"), ("gspo", "gspo"), ("sapo", "sapo"), ("pg", "pg")];
const MASK_KINDS: &[(&str, &str)] =
    &[("none", "none"), ("off", "none"), ("s2t", "s2t"), ("top_entropy", "top_entropy")];
const KL_KINDS: &[(&str, &str)] = &[("k1", "k1"), ("k2", "k2"), ("k3", "k3"), ("low_var_kl", "k3")];
const AGG_MODES: &[(&str, &str)] = &[
    ("token_mean", "token-mean"),
    ("seq_mean_token_mean", "seq-mean-token-mean"),
    ("seq_mean_token_sum", "seq-mean-token-sum"),
    ("seq_mean_token_sum_norm", "seq-mean-token-sum-norm"),
];
const ADV: &[(&str, &str)] = &[("grpo", "grpo"), ("dr_grpo", "dr_grpo"), ("drgrpo", "dr_grpo")];
const STD: &[(&str, &str)] =
    &[("sample", "sample"), ("unbiased", "sample"), ("population", "population"), ("biased", "population")];
const SCALE: &[(&str, &str)] = &[
    ("zero_one", "zero_one"),
    ("01", "zero_one"),
    ("plus_minus_one", "plus_minus_one"),
    ("pm1", "plus_minus_one"),
];

/// The losses with a clip range.
const CLIPPED: Option<(&str, &[&str])> = Some(("loss", &["ppo", "gspo"]));

const fn alias(key: &'static str, expects: &'static str, action: Action) -> Alias {
    Alias { key, expects, requires: None, action, order: 2 }
}

/// Every `--set` key: the one table help texts, errors and the script bindings read.
pub const ALIASES: &[Alias] = &[
    Alias {
        order: 0,
        ..alias(
            "kind",
            "ppo|gspo|sapo|pg (resets the loss to that kind's defaults)",
            Action::Switch("loss", Kind::Word(LOSS_KINDS)),
        )
    },
    Alias {
        order: 0,
        requires: CLIPPED,
        ..alias(
            "eps",
            "number (sets eps_low and eps_high)",
            Action::Set(&[&["loss", "eps_low"], &["loss", "eps_high"]], Kind::Num),
        )
    },
    Alias {
        requires: CLIPPED,
        ..alias("eps_low", "number in [0, 1) (ppo, gspo)", Action::Set(&[&["loss", "eps_low"]], Kind::Num))
    },
    Alias {
        requires: CLIPPED,
        ..alias("eps_high", "number >= 0 (ppo, gspo)", Action::Set(&[&["loss", "eps_high"]], Kind::Num))
    },
    Alias {
        requires: Some(("loss", &["ppo"])),
        ..alias(
            "dual_clip",
            "number > 1, or none (ppo)",
            Action::Set(&[&["loss", "dual_clip"]], Kind::OptNum),
        )
    },
    Alias {
        requires: Some(("loss", &["sapo"])),
        ..alias("sapo_tau_pos", "number > 0 (sapo)", Action::Set(&[&["loss", "tau_pos"]], Kind::Num))
    },
    Alias {
        requires: Some(("loss", &["sapo"])),
        ..alias("sapo_tau_neg", "number > 0 (sapo)", Action::Set(&[&["loss", "tau_neg"]], Kind::Num))
    },
    Alias {
        order: 0,
        ..alias("kl", "none|k1|k2|k3", Action::Toggle("kl", Some("kind"), Kind::Word(KL_KINDS)))
    },
    alias(
        "kl_beta",
        "number >= 0 (turns kl on as k3 if it was off)",
        Action::Set(&[&["kl", "beta"]], Kind::Num),
    ),
    alias("entropy_coef", "number", Action::Set(&[&["entropy_coef"]], Kind::Num)),
    alias(
        "agg",
        "token-mean|seq-mean-token-mean|seq-mean-token-sum|seq-mean-token-sum-norm",
        Action::Set(&[&["agg"]], Kind::Word(AGG_MODES)),
    ),
    alias("norm_len", "positive integer, or none", Action::Set(&[&["norm_len"]], Kind::OptInt)),
    alias("adv", "grpo|dr_grpo", Action::Set(&[&["adv"]], Kind::Word(ADV))),
    alias("std", "sample|population", Action::Set(&[&["std"]], Kind::Word(STD))),
    Alias {
        order: 0,
        ..alias("mask", "none|s2t|top_entropy", Action::Switch("mask", Kind::Word(MASK_KINDS)))
    },
    Alias {
        requires: Some(("mask", &["s2t"])),
        ..alias("tau_p", "number > 0 (mask=s2t)", Action::Set(&[&["mask", "tau_p"]], Kind::Num))
    },
    Alias {
        requires: Some(("mask", &["s2t"])),
        ..alias("tau_h", "absolute entropy threshold (mask=s2t)", Action::Tagged(&["mask", "tau_h"], "abs"))
    },
    Alias {
        requires: Some(("mask", &["s2t"])),
        ..alias(
            "tau_h_quantile",
            "number in [0, 1] (mask=s2t; keeps tau_h_over)",
            Action::TauHQuantile("q", Kind::Num),
        )
    },
    Alias {
        requires: Some(("mask", &["s2t"])),
        ..alias(
            "tau_h_over",
            "response|candidates: the tau_h quantile's population (mask=s2t; keeps tau_h_quantile)",
            Action::TauHQuantile("over", Kind::Word(OVER)),
        )
    },
    Alias {
        requires: Some(("mask", &["top_entropy"])),
        ..alias("rho", "number in (0, 1] (mask=top_entropy)", Action::Set(&[&["mask", "rho"]], Kind::Num))
    },
    alias("dynamic_sampling", "true|false", Action::Set(&[&["dynamic_sampling"]], Kind::Bool)),
    Alias { order: 0, ..alias("overlong", "none|on", Action::Toggle("overlong", None, Kind::Word(&[]))) },
    Alias {
        order: 1,
        ..alias(
            "overlong_max_len",
            "positive integer (turns overlong on if it was off; rescales cache_len to keep its fraction)",
            Action::OverlongMaxLen,
        )
    },
    alias(
        "overlong_cache_len",
        "positive integer (turns overlong on if it was off)",
        Action::Set(&[&["overlong", "cache_len"]], Kind::Int),
    ),
    alias(
        "overlong_factor",
        "number >= 0 (turns overlong on if it was off)",
        Action::Set(&[&["overlong", "factor"]], Kind::Num),
    ),
    alias("reward_scale", "zero_one|plus_minus_one", Action::Set(&[&["reward_scale"]], Kind::Word(SCALE))),
];

/// The entry of `key`, or an error listing the valid keys.
pub fn alias_of(key: &str) -> Result<&'static Alias> {
    ALIASES.iter().find(|a| a.key == key).ok_or_else(|| {
        let keys: Vec<&str> = ALIASES.iter().map(|a| a.key).collect();
        cfg_err(key, format!("unknown key; valid keys: {}", keys.join(", ")))
    })
}

/// Whether `key` is a `--set` key.
pub fn is_set_key(key: &str) -> bool {
    ALIASES.iter().any(|a| a.key == key)
}

/// The JSON default of an optional section or of a variant of a tagged object.
fn default_of(section: &str, kind: Option<&str>) -> Option<Value> {
    let v = match (section, kind) {
        ("loss", Some(k)) => serde_json::to_value(PolicyLoss::default_of(k)?),
        ("mask", Some("none")) => serde_json::to_value(MaskConfig::None),
        ("mask", Some("s2t")) => serde_json::to_value(MaskConfig::S2T_DEFAULT),
        ("mask", Some("top_entropy")) => serde_json::to_value(MaskConfig::TopEntropy { rho: 0.2 }),
        ("kl", _) => Ok(json!({"kind": "k3", "beta": DEFAULT_KL_BETA})),
        ("overlong", _) => serde_json::to_value(DAPO_OVERLONG),
        _ => return None,
    };
    v.ok()
}

/// verl's default `kl_loss_coef`.
const DEFAULT_KL_BETA: f32 = 0.001;

impl Alias {
    fn bad(&self, value: &str) -> crate::Error {
        cfg_err(self.key, format!("expected {}, found `{value}`", self.expects))
    }

    /// The value's JSON form under `kind`.
    fn parse(&self, kind: Kind, value: &str) -> Result<Value> {
        let lower = value.trim().to_ascii_lowercase();
        let is_none = NONE_WORDS.contains(&lower.as_str());
        let num = || -> Result<Value> {
            let x: f64 = lower.parse().ok().filter(|x: &f64| x.is_finite()).ok_or_else(|| self.bad(value))?;
            Ok(json!(x))
        };
        let int = || -> Result<Value> { Ok(json!(lower.parse::<u64>().map_err(|_| self.bad(value))?)) };
        match kind {
            Kind::Num => num(),
            Kind::Int => int(),
            Kind::OptNum if is_none => Ok(Value::Null),
            Kind::OptNum => num(),
            Kind::OptInt if is_none => Ok(Value::Null),
            Kind::OptInt => int(),
            Kind::Bool => match lower.as_str() {
                "true" | "on" | "yes" | "1" => Ok(json!(true)),
                "false" | "off" | "no" | "0" => Ok(json!(false)),
                _ => Err(self.bad(value)),
            },
            Kind::Word(words) => {
                let w = lower.replace('-', "_");
                words
                    .iter()
                    .find(|(from, _)| *from == w)
                    .map(|(_, to)| json!(to))
                    .ok_or_else(|| self.bad(value))
            }
        }
    }

    /// Applies `value` to the JSON form `cfg` of an [`ObjectiveConfig`].
    fn apply(&self, cfg: &mut Map<String, Value>, value: &str) -> Result<()> {
        if let Some((section, kinds)) = self.requires {
            let here = cfg.get(section).and_then(|o| o.get("kind")).and_then(Value::as_str);
            if !here.is_some_and(|h| kinds.contains(&h)) {
                let kinds = kinds.join("|");
                return Err(cfg_err(
                    self.key,
                    format!(
                        "applies to {section}={kinds} only (here {section}={}); set {}={kinds} first",
                        here.unwrap_or("none"),
                        switch_key(section)
                    ),
                ));
            }
        }
        match self.action {
            Action::Set(paths, kind) => {
                let v = self.parse(kind, value)?;
                for path in paths {
                    set_path(cfg, path, v.clone())?;
                }
            }
            Action::Switch(section, kind) => {
                let v = self.parse(kind, value)?;
                let new = v.as_str().unwrap_or_default();
                let here = cfg.get(section).and_then(|o| o.get("kind")).and_then(Value::as_str);
                if here != Some(new) {
                    let d = default_of(section, Some(new)).ok_or_else(|| self.bad(value))?;
                    cfg.insert(section.into(), d);
                }
            }
            Action::Toggle(section, field, kind) => {
                let lower = value.trim().to_ascii_lowercase();
                if NONE_WORDS.contains(&lower.as_str()) || lower == "false" {
                    cfg.insert(section.into(), Value::Null);
                } else if lower == "on" || lower == "true" {
                    if cfg.get(section).is_none_or(Value::is_null) {
                        cfg.insert(section.into(), default_of(section, None).ok_or_else(|| self.bad(value))?);
                    }
                } else {
                    let field = field.ok_or_else(|| self.bad(value))?;
                    set_path(cfg, &[section, field], self.parse(kind, value)?)?;
                }
            }
            Action::Tagged(path, tag) => {
                let v = self.parse(Kind::Num, value)?;
                set_path(cfg, path, json!({ tag: v }))?;
            }
            Action::TauHQuantile(field, kind) => {
                let v = self.parse(kind, value)?;
                let here = cfg.get("mask").and_then(|m| m.get("tau_h")).and_then(|t| t.get("quantile"));
                let mut qt = match here {
                    Some(o) if o.is_object() => o.clone(),
                    _ => serde_json::to_value(TauH::PAPER).map_err(|e| cfg_err("tau_h", e.to_string()))?
                        ["quantile"]
                        .clone(),
                };
                qt[field] = v;
                set_path(cfg, &["mask", "tau_h"], json!({ "quantile": qt }))?;
            }
            Action::OverlongMaxLen => {
                let new_max = self.parse(Kind::Int, value)?.as_u64().unwrap_or(0);
                let mut o = match cfg.get("overlong") {
                    Some(o) if !o.is_null() => o.clone(),
                    _ => default_of("overlong", None).ok_or_else(|| self.bad(value))?,
                };
                let (old_max, cache) =
                    (o["max_len"].as_u64().unwrap_or(1), o["cache_len"].as_u64().unwrap_or(1));
                let frac = cache as f64 / old_max.max(1) as f64;
                o["cache_len"] = json!(((new_max as f64 * frac).round() as u64).max(1));
                o["max_len"] = json!(new_max);
                cfg.insert("overlong".into(), o);
            }
        }
        Ok(())
    }
}

/// The key that switches a tagged section.
fn switch_key(section: &str) -> &'static str {
    match section {
        "loss" => "kind",
        _ => "mask",
    }
}

/// Sets `path` in `cfg` to `v`, creating an optional section on the way with its defaults.
fn set_path(cfg: &mut Map<String, Value>, path: &[&str], v: Value) -> Result<()> {
    let (last, parents) = path.split_last().expect("alias paths are never empty");
    let mut obj = cfg;
    for p in parents {
        if obj.get(*p).is_none_or(Value::is_null) {
            let d = default_of(p, None).ok_or_else(|| cfg_err(p, "no such section"))?;
            obj.insert((*p).into(), d);
        }
        obj = obj
            .get_mut(*p)
            .and_then(Value::as_object_mut)
            .ok_or_else(|| cfg_err(p, "expected an object in the config"))?;
    }
    obj.insert((*last).into(), v);
    Ok(())
}

impl ObjectiveConfig {
    /// Applies one `--set key=value` override, then validates; on error the config is left
    /// unchanged and the error names the key and what it expects (or lists the valid keys).
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let (key, value) = (key.trim(), value.trim());
        let a = alias_of(key)?;
        let mut v = match serde_json::to_value(&*self) {
            Ok(Value::Object(m)) => m,
            _ => return Err(cfg_err(key, "the objective config has no JSON form")),
        };
        a.apply(&mut v, value)?;
        let new: ObjectiveConfig = serde_json::from_value(Value::Object(v)).map_err(|_| a.bad(value))?;
        new.validate()?;
        *self = new;
        Ok(())
    }

    /// Applies `key=value` (the CLI's `--set` form).
    pub fn set_pair(&mut self, pair: &str) -> Result<()> {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| cfg_err("--set", format!("expected key=value, found `{pair}`")))?;
        self.set(k, v)
    }

    /// A preset with `key = value` overrides (the form run configs, script maps and
    /// `stapo update --set` give), validated; the error names the preset or the key.
    /// Overrides apply in a fixed order whatever order they come in: switches (`kind`,
    /// `mask`, `kl`, `overlong`, `eps`) before their parameters, and `overlong_max_len`
    /// (which rescales the buffer) before `overlong_cache_len`.
    pub fn with_overrides<K: AsRef<str>, V: AsRef<str>>(
        name: &str,
        overrides: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Self> {
        let mut pairs: Vec<(K, V)> = overrides.into_iter().collect();
        let rank = |k: &str| alias_of(k.trim()).map_or(3, |a| a.order);
        pairs
            .sort_by(|a, b| rank(a.0.as_ref()).cmp(&rank(b.0.as_ref())).then(a.0.as_ref().cmp(b.0.as_ref())));
        let mut o = ObjectiveConfig::preset(name)?;
        for (k, v) in &pairs {
            o.set(k.as_ref(), v.as_ref())?;
        }
        o.validate()?;
        Ok(o)
    }
}

/// `key: expects` lines of every `--set` key, for help texts.
pub fn set_keys_help() -> String {
    ALIASES.iter().map(|a| format!("  {:<18} {}", a.key, a.expects)).collect::<Vec<_>>().join("\n")
}
