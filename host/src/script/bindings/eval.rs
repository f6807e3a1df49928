//! Bindings for evaluation: avg@n / pass@n of a model on a dataset.

use std::sync::Arc;

use rhai::{Dynamic, Engine, Map};

use super::{lock, DatasetHandle, ModelHandle};
use crate::data::{Dataset, DatasetOptions, PromptTemplate};
use crate::eval;
use crate::reward::ExtractMode;
use crate::rollout::SamplingParams;
use crate::script::convert::{from_json, get_num, get_str};
use crate::script::error::{bad_arg, host, RhaiResult};
use crate::script::host::Host;

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
    if host_.opts.smoke {
        limit = limit.min(2);
        params.n = params.n.min(1);
        params.max_new_tokens = params.max_new_tokens.min(8);
    }
    let slot = lock(&m.0, "model")?;
    let tok = slot.tokenizer.clone().ok_or_else(|| host("evaluate: the model has no tokenizer"))?;
    params.stop_token_ids.extend(tok.eos_ids());
    let tmpl = super::data::template(&get_str(opts, "template")?.unwrap_or_else(|| "raw".into()))?
        .unwrap_or_else(PromptTemplate::raw);
    let rep = eval::evaluate(
        &slot.model,
        &tok,
        &ds.examples()[..limit],
        &tmpl,
        &params,
        ExtractMode::Strict,
        64,
        &|_| {},
    )
    .map_err(host)?;
    Ok(from_json(&serde_json::json!({
        "avg": rep.overall.avg, "pass": rep.overall.pass, "mean_len": rep.overall.mean_len,
        "problems": rep.overall.problems, "n": rep.overall.samples_per_problem, "by_source": rep.by_source,
    })))
}

pub(super) fn register(engine: &mut Engine, host_: &Arc<Host>) {
    let h = host_.clone();
    func!(engine, "evaluate", "evaluate(model, data, opts) -> map\navg@n and pass@n on a dataset (path or Dataset). opts: #{n (4), temperature (1.0), top_p (1.0), max_tokens (256), limit, template, seed}. Returns #{avg, pass, mean_len, problems, n, by_source}.\nExample: `evaluate(m, \"data/arith/test.jsonl\", #{n: 4, limit: 50}).avg`", move |m: ModelHandle, data: Dynamic, opts: Map| evaluate(&h, &m, &data, &opts));
    let h = host_.clone();
    func!(
        engine,
        "evaluate",
        "evaluate(model, data) -> map\nSame with the default options.",
        move |m: ModelHandle, data: Dynamic| evaluate(&h, &m, &data, &Map::new())
    );
}
