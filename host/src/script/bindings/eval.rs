//! Bindings for evaluation: avg@n / pass@n (and pass@k for a list of k) of a
//! model on a dataset.

use std::sync::Arc;

use rhai::plugin::{export_module, exported_module};
use rhai::{Dynamic, Engine, Map};
use serde::Deserialize;

use super::{lock, DatasetHandle, ModelHandle};
use crate::data::{Dataset, DatasetOptions, PromptTemplate};
use crate::eval;
use crate::reward::ExtractMode;
use crate::rollout::{EngineConfig, Generator, SamplingParams};
use crate::script::convert::{from_json, options, overlay, to_json};
use crate::script::error::{bad_arg, host, RhaiResult};
use crate::script::shared_state::Host;

/// `evaluate(model, data, opts)`: the keys that are not sampling fields; the rest of the map
/// is a [`SamplingParams`] (n 4 by default), so every sampling option reaches evaluation.
#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct EvalOpts {
    /// First `limit` problems only.
    limit: Option<usize>,
    /// "model" (the folder's own format, the default), a template name, or a map as train()
    /// configs write it (`#{kind: "chat", suffix: ..}`).
    template: Option<serde_json::Value>,
    /// Answer extraction: strict | flexible | answer_line.
    extract: Option<String>,
    /// The k of pass@k (each at most `n`).
    pass_k: Vec<usize>,
    /// The rollout engine's settings (`#{kv_cache_gb, max_rows, block_size}`, as a run's
    /// `rollout.engine`).
    engine: EngineConfig,
}

/// The keys of [`EvalOpts`].
const EVAL_KEYS: [&str; 5] = ["limit", "template", "extract", "pass_k", "engine"];

/// A dataset argument: a path or a `Dataset`.
fn dataset_arg(data: &Dynamic) -> RhaiResult<Arc<Dataset>> {
    if let Some(d) = data.clone().try_cast::<DatasetHandle>() {
        return Ok(d.0);
    }
    if !data.is_string() {
        let t = data.type_name();
        return Err(bad_arg("evaluate", format!("data: expected a path or a Dataset, found {t}")));
    }
    Ok(Arc::new(Dataset::load(data.to_string(), &DatasetOptions::default()).map_err(host)?.0))
}

fn evaluate(host_: &Host, m: &ModelHandle, data: &Dynamic, opts: &Map) -> RhaiResult<Dynamic> {
    let (own, sampling): (Map, Map) =
        opts.clone().into_iter().partition(|(k, _)| EVAL_KEYS.contains(&k.as_str()));
    let o: EvalOpts = options("evaluate", &own)?;
    let sampling = to_json("evaluate", &Dynamic::from_map(sampling))?;
    let mut params = overlay("evaluate", &SamplingParams { n: 4, ..SamplingParams::default() }, sampling)?;
    let ds = dataset_arg(data)?;
    let tmpl = match &o.template {
        None => PromptTemplate::Model,
        Some(t) => PromptTemplate::from_json(t).map_err(|e| bad_arg("evaluate", format!("template: {e}")))?,
    };
    let mut limit = o.limit.unwrap_or(ds.len()).min(ds.len());
    let mut ks = o.pass_k;
    if host_.opts.smoke {
        limit = limit.min(2);
        params.n = params.n.min(1);
        params.max_new_tokens = params.max_new_tokens.min(8);
        ks = crate::script::train_loop::smoke_pass_k(&ks, params.n);
    }
    eval::check_pass_k(&ks, params.n).map_err(|e| bad_arg("evaluate", format!("pass_k: {e}")))?;
    let slot = lock(&m.0, "model")?;
    let tok = slot.tokenizer.clone().ok_or_else(|| host("evaluate: the model has no tokenizer"))?;
    let extract = match &o.extract {
        Some(s) => s.parse::<ExtractMode>().map_err(|e| bad_arg("evaluate", e.to_string()))?,
        None => ExtractMode::Strict,
    };
    let gen = Generator::new(&slot.model, &tok, &tmpl).map_err(host)?;
    if let Some(note) = gen.note() {
        host_.println(note);
    }
    let rep = eval::evaluate(&gen, &ds.examples()[..limit], &params, extract, &o.engine, &|_| {})
        .and_then(|r| r.with_pass_k(&ks))
        .map_err(host)?;
    Ok(from_json(&serde_json::json!({
        "avg": rep.overall.avg, "pass": rep.overall.pass, "pass_at_k": rep.overall.pass_at_k, "mean_len": rep.overall.mean_len,
        "problems": rep.overall.problems, "n": rep.overall.samples_per_problem, "by_source": rep.by_source,
    })))
}

/// Registers `evaluate(model, data[, opts])`.
pub(super) fn register(engine: &mut Engine) {
    engine.register_global_module(exported_module!(fns).into());
}

/// The script-visible evaluation functions.
#[export_module]
mod fns {
    use rhai::{Dynamic, Map, NativeCallContext};

    use super::ModelHandle;
    use crate::script::bindings::host_of;
    use crate::script::error::RhaiResult;

    /// evaluate(model, data, opts) -> map
    ///
    /// avg@n and pass@n on a dataset (path or Dataset). opts: the sampling fields (n (4),
    /// temperature (1.0), top_p (1.0), top_k, min_p, max_tokens (256), stop, seed, ...) and limit,
    /// template ("model": the folder's own format; or "none", "raw", "chat", a map), extract
    /// (strict | flexible | answer_line), pass_k ([]; e.g. [1, 4, 16]), engine (the rollout
    /// engine's #{kv_cache_gb, max_rows, block_size}, as a run's rollout.engine). Returns
    /// #{avg, pass (pass@n), pass_at_k (#{"1": .., "4": ..}), mean_len, problems, n, by_source}.
    ///
    /// # Example
    ///
    /// ```rhai
    /// evaluate(m, "data/arith/test.jsonl", #{n: 8, pass_k: [1, 4], limit: 50}).pass_at_k["4"]
    /// ```
    #[rhai_fn(name = "evaluate", volatile, return_raw)]
    pub fn evaluate_with(
        ctx: NativeCallContext,
        m: ModelHandle,
        data: Dynamic,
        opts: Map,
    ) -> RhaiResult<Dynamic> {
        super::evaluate(&*host_of(&ctx)?, &m, &data, &opts)
    }

    /// evaluate(model, data) -> map
    ///
    /// Same with the default options.
    ///
    /// # Example
    ///
    /// ```rhai
    /// print(evaluate(m, "data/arith/test.jsonl").avg);
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn evaluate(ctx: NativeCallContext, m: ModelHandle, data: Dynamic) -> RhaiResult<Dynamic> {
        super::evaluate(&*host_of(&ctx)?, &m, &data, &Map::new())
    }
}
