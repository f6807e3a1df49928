//! Bindings for evaluation: avg@n / pass@n (and pass@k for a list of k) of a
//! model on a dataset.

use std::sync::Arc;

use rhai::{Dynamic, Engine, Map};

use super::{lock, DatasetHandle, ModelHandle};
use crate::data::{Dataset, DatasetOptions, PromptTemplate};
use crate::eval;
use crate::reward::ExtractMode;
use crate::rollout::SamplingParams;
use crate::script::convert::{from_json, get_num, get_str, to_json};
use crate::script::error::{bad_arg, host, RhaiResult};
use crate::script::host::Host;

/// `opts.pass_k`: an array of k for pass@k (empty when absent).
fn pass_k_opt(opts: &Map) -> RhaiResult<Vec<usize>> {
    match opts.get("pass_k") {
        None => Ok(Vec::new()),
        Some(d) if d.is_unit() => Ok(Vec::new()),
        Some(d) => serde_json::from_value(to_json("pass_k", d)?).map_err(|e| {
            bad_arg(
                "evaluate",
                format!("pass_k: expected an array of positive integers such as [1, 4, 16] ({e})"),
            )
        }),
    }
}

fn evaluate(host_: &Host, m: &ModelHandle, data: &Dynamic, opts: &Map) -> RhaiResult<Dynamic> {
    let ds: Arc<Dataset> = if data.is::<DatasetHandle>() {
        data.clone().cast::<DatasetHandle>().0
    } else if data.is_string() {
        Arc::new(Dataset::load(data.to_string(), &DatasetOptions::default()).map_err(host)?.0)
    } else {
        return Err(bad_arg(
            "evaluate",
            format!("data: expected a path or a Dataset, found {}", data.type_name()),
        ));
    };
    let mut limit = get_num(opts, "limit")?.map_or(ds.len(), |x| x as usize).min(ds.len());
    let mut params = SamplingParams {
        n: get_num(opts, "n")?.map_or(4, |x| x as usize),
        temperature: get_num(opts, "temperature")?.unwrap_or(1.0),
        top_p: get_num(opts, "top_p")?.unwrap_or(1.0),
        max_new_tokens: get_num(opts, "max_tokens")?.map_or(256, |x| x as usize),
        seed: get_num(opts, "seed")?.map_or(0, |x| x as u64),
        ..SamplingParams::default()
    };
    let mut ks = pass_k_opt(opts)?;
    if host_.opts.smoke {
        limit = limit.min(2);
        params.n = params.n.min(1);
        params.max_new_tokens = params.max_new_tokens.min(8);
        ks = crate::script::train_loop::smoke_pass_k(&ks, params.n);
    }
    eval::check_pass_k(&ks, params.n).map_err(|e| bad_arg("evaluate", format!("pass_k: {e}")))?;
    let slot = lock(&m.0, "model")?;
    let tok = slot.tokenizer.clone().ok_or_else(|| host("evaluate: the model has no tokenizer"))?;
    params.stop_token_ids.extend(tok.eos_ids());
    let tmpl = match opts.get("template") {
        // A map spells a template as train() configs do: #{kind: "chat", suffix: "...", ...}.
        Some(t) if t.is_map() => serde_json::from_value::<PromptTemplate>(to_json("template", t)?)
            .map_err(|e| bad_arg("evaluate", format!("template: {e}")))?,
        _ => super::data::template(&get_str(opts, "template")?.unwrap_or_else(|| "raw".into()))?
            .unwrap_or_else(PromptTemplate::raw),
    };
    let extract = match get_str(opts, "extract")? {
        Some(s) => s.parse::<ExtractMode>().map_err(|e| bad_arg("evaluate", e.to_string()))?,
        None => ExtractMode::Strict,
    };
    let rep =
        eval::evaluate(&slot.model, &tok, &ds.examples()[..limit], &tmpl, &params, extract, 64, &|_| {})
            .and_then(|r| r.with_pass_k(&ks))
            .map_err(host)?;
    Ok(from_json(&serde_json::json!({
        "avg": rep.overall.avg, "pass": rep.overall.pass, "pass_at_k": rep.overall.pass_at_k, "mean_len": rep.overall.mean_len,
        "problems": rep.overall.problems, "n": rep.overall.samples_per_problem, "by_source": rep.by_source,
    })))
}

pub(super) fn register(engine: &mut Engine, host_: &Arc<Host>) {
    let h = host_.clone();
    func!(engine, "evaluate", "evaluate(model, data, opts) -> map\navg@n and pass@n on a dataset (path or Dataset). opts: #{n (4), temperature (1.0), top_p (1.0), max_tokens (256), limit, template (name or map), extract (strict | flexible | answer_line), seed, pass_k ([] ; e.g. [1, 4, 16])}. Returns #{avg, pass (pass@n), pass_at_k (#{\"1\": .., \"4\": ..}), mean_len, problems, n, by_source}.\nExample: `evaluate(m, \"data/arith/test.jsonl\", #{n: 8, pass_k: [1, 4], limit: 50}).pass_at_k[\"4\"]`", move |m: ModelHandle, data: Dynamic, opts: Map| evaluate(&h, &m, &data, &opts));
    let h = host_.clone();
    func!(
        engine,
        "evaluate",
        "evaluate(model, data) -> map\nSame with the default options.",
        move |m: ModelHandle, data: Dynamic| evaluate(&h, &m, &data, &Map::new())
    );
}
