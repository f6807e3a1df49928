//! Bindings for rollouts: sample groups of responses with sampling options
//! from a map, and inspect them (texts, samples, the per-token table).

use std::sync::{Arc, Mutex};

use rhai::plugin::{export_module, exported_module};
use rhai::{Array, Dynamic, Engine, Map};

use super::{lock, ModelHandle, RolloutHandle, RolloutState};
use crate::algo::{AdvEstimator, StdKind};
use crate::data::Prompt;
use crate::rollout::{GenerateOptions, Generator, PromptInfo, RolloutBatch, Sample, SamplingParams};
use crate::script::convert::{get_str, sampling_from_map, to_dynamic, to_json};
use crate::script::error::{bad_arg, host, RhaiResult};
use crate::script::shared_state::Host;
use crate::script::table::{format_sample, token_rows, TokenRow};
use crate::train::spurious::TokenPoint;
use crate::train::update::logit_grad_norm;
use crate::train::{token_analysis, Sequence};

/// Samples shown when a rollout is printed.
const PRINT_SAMPLES: usize = 4;

fn run_rollout(host_: &Host, m: &ModelHandle, prompts: &Array, opts: &Map) -> RhaiResult<RolloutHandle> {
    let slot = lock(&m.0, "model")?;
    let tok = slot.tokenizer.clone().ok_or_else(|| host("rollout: the model has no tokenizer"))?;
    let gen = Generator::new(&slot.model, &tok, &super::data::template_opt(opts)?).map_err(host)?;
    if let Some(note) = gen.note() {
        host_.println(note);
    }
    let mut problems = Vec::with_capacity(prompts.len());
    let mut infos = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let (problem, id, answer) = if p.is_string() {
            (Prompt::Text(p.to_string()), format!("prompt-{i}"), None)
        } else if p.is_map() {
            let pm = p.clone().cast::<Map>();
            let problem =
                pm.get("prompt").or_else(|| pm.get("problem")).filter(|v| !v.is_unit()).ok_or_else(|| {
                    bad_arg("rollout", format!("prompt {i}: a map needs `problem` (or `prompt`)"))
                })?;
            let problem: Prompt = serde_json::from_value(to_json("problem", problem)?).map_err(|e| {
                bad_arg("rollout", format!("prompt {i}: `problem` must be a string or a list of #{{role, content}} messages: {e}"))
            })?;
            let answer = pm.get("answer").filter(|a| !a.is_unit()).map(|a| a.to_string());
            (problem, get_str(&pm, "id")?.unwrap_or_else(|| format!("prompt-{i}")), answer)
        } else {
            return Err(bad_arg(
                "rollout",
                format!("prompt {i}: expected a string or a map with `problem`, found {}", p.type_name()),
            ));
        };
        problems.push(problem);
        infos.push(PromptInfo { id, text: String::new(), answer });
    }
    let params = sampling_from_map(&SamplingParams::default(), opts)?;
    let opts = GenerateOptions { cancel: Some(host_.cancel_flag()), ..GenerateOptions::default() };
    let out = gen.generate(&problems, &params, &opts).map_err(host)?;
    for (info, text) in infos.iter_mut().zip(out.prompt_texts) {
        info.text = text;
    }
    let st = RolloutState::new(RolloutBatch::new(out.samples, infos), Some(tok.clone()));
    Ok(RolloutHandle(Arc::new(Mutex::new(st))))
}

/// Sample `i` of a rollout and its token-table rows; `what` names the caller in errors.
fn sample_rows<'a>(st: &'a RolloutState, what: &str, i: usize) -> RhaiResult<(&'a Sample, Vec<TokenRow>)> {
    let n = st.batch.len();
    let s = st.batch.samples.get(i).ok_or_else(|| bad_arg(what, format!("sample {i} is outside 0..{n}")))?;
    let adv = st.advantages.as_ref().and_then(|a| a.get(i).copied());
    let sil = st.silenced.as_ref().and_then(|v| v.get(i)).map(|v| v.as_slice());
    Ok((s, token_rows(s, st.tokenizer.as_ref(), adv, sil)))
}

/// The token table of sample `i`.
pub fn table(r: &RolloutHandle, i: usize) -> RhaiResult<String> {
    let st = lock(&r.0, "rollout")?;
    let (s, rows) = sample_rows(&st, "table", i)?;
    Ok(format_sample(i, s, &rows))
}

/// The token table of sample `i` as maps.
fn tokens(r: &RolloutHandle, i: usize) -> RhaiResult<Array> {
    let st = lock(&r.0, "rollout")?;
    let (_, rows) = sample_rows(&st, "tokens", i)?;
    let opt = |x: Option<f32>| x.map_or(Dynamic::UNIT, |a| Dynamic::from(a as f64));
    let row = |t: TokenRow| {
        let mut m = Map::new();
        m.insert("pos".into(), (t.pos as i64).into());
        m.insert("id".into(), (t.id as i64).into());
        m.insert("token".into(), t.token.into());
        m.insert("p".into(), (t.p as f64).into());
        m.insert("H".into(), (t.h as f64).into());
        m.insert("advantage".into(), opt(t.advantage));
        m.insert("silenced".into(), t.silenced.map_or(Dynamic::UNIT, Dynamic::from));
        m.insert("context".into(), t.context.map_or(Dynamic::UNIT, Dynamic::from));
        Dynamic::from_map(m)
    };
    Ok(rows.into_iter().map(row).collect())
}

/// The printed form of a rollout: a summary, then the token tables of the first samples.
pub fn describe(r: &RolloutHandle) -> String {
    let (n, mean, tokens) = match r.0.lock() {
        Ok(st) => (st.batch.len(), st.batch.mean_reward(), st.batch.num_response_tokens()),
        Err(_) => return "Rollout(<unusable>)".into(),
    };
    let mut out = format!(
        "Rollout: {n} samples, {tokens} response tokens, mean reward {}\n",
        mean.map_or("- (not scored: score(r))".to_string(), |m| format!("{m:.3}"))
    );
    for i in 0..n.min(PRINT_SAMPLES) {
        if let Ok(t) = table(r, i) {
            out.push_str(&t);
        }
    }
    if n > PRINT_SAMPLES {
        out.push_str(&format!("... {} more (r.table(i) shows sample i)\n", n - PRINT_SAMPLES));
    }
    out
}

/// `spurious_plot(rollout, path)` and `spurious_plot(model, rollout, path)`: STAPO's token
/// scatter of the rollout's positive-advantage responses (see `train::plot::spurious`).
fn spurious_plot(r: &RolloutHandle, model: Option<&ModelHandle>, path: &str) -> RhaiResult<Map> {
    let (points, region, n) = {
        let mut st = lock(&r.0, "rollout")?;
        let n = st.batch.len();
        match (model, &st.points) {
            (None, Some(p)) => (p.clone(), st.region, n),
            (None, None) => {
                return Err(bad_arg(
                    "spurious_plot",
                    "this rollout has no per-token gradient norms (a run's rollout, run.rollout, has \
                     them): use spurious_plot(model, rollout, path)",
                ))
            }
            (Some(m), _) => {
                if st.advantages.is_none() {
                    st.compute_advantages(AdvEstimator::Grpo, StdKind::Sample)
                        .map_err(|e| bad_arg("spurious_plot", e))?;
                }
                let adv = st.advantages.clone().unwrap_or_default();
                let seqs: Vec<Sequence> = st
                    .batch
                    .samples
                    .iter()
                    .map(|s| Sequence::from_sample(s, s.reward.unwrap_or(0.0)))
                    .collect();
                let slot = lock(&m.0, "model")?;
                let pad = slot.tokenizer.as_ref().map_or(0, |t| t.pad_id());
                let an = token_analysis(&slot.model, &seqs, pad, 1.0, 16).map_err(host)?;
                let mut pts = Vec::new();
                for (i, (a, t)) in adv.iter().zip(&an).enumerate().filter(|(_, (&a, _))| a > 0.0) {
                    let sil = st.silenced.as_ref().and_then(|v| v.get(i));
                    for j in 0..t.p.len() {
                        pts.push(TokenPoint {
                            p: t.p[j],
                            h: t.entropy[j],
                            grad: logit_grad_norm(*a, t.p[j], t.collision[j]),
                            silenced: sil.and_then(|v| v.get(j)).copied().unwrap_or(false),
                        });
                    }
                }
                (pts, st.region, n)
            }
        }
    };
    let title = format!("tokens of positive-advantage responses ({n} samples)");
    let (png, svg) =
        crate::train::plot::spurious(&points, region, &title, std::path::Path::new(path)).map_err(host)?;
    let mut m = Map::new();
    m.insert("png".into(), png.display().to_string().into());
    m.insert("svg".into(), svg.display().to_string().into());
    m.insert("points".into(), (points.len() as i64).into());
    m.insert("silenced".into(), (points.iter().filter(|q| q.silenced).count() as i64).into());
    Ok(m)
}

fn sample_map(st: &RolloutState, i: usize) -> RhaiResult<Dynamic> {
    let s = st
        .batch
        .samples
        .get(i)
        .ok_or_else(|| bad_arg("sample", format!("sample {i} is outside 0..{}", st.batch.len())))?;
    let mut m = to_dynamic(s)?.cast::<Map>();
    if let Some(a) = st.advantages.as_ref().and_then(|a| a.get(i)) {
        m.insert("advantage".into(), (*a as f64).into());
    }
    if let Some(p) = st.batch.prompts.get(s.prompt_index) {
        m.insert("prompt".into(), p.text.clone().into());
        m.insert("answer".into(), p.answer.clone().map_or(Dynamic::UNIT, Dynamic::from));
    }
    Ok(Dynamic::from_map(m))
}

/// Registers the rollout functions.
pub(super) fn register(engine: &mut Engine) {
    engine.register_global_module(exported_module!(fns).into());
}

/// The script-visible rollout functions.
#[export_module]
mod fns {
    use rhai::{Array, Dynamic, Map, NativeCallContext};

    use super::{lock, sample_map, ModelHandle, RolloutHandle};
    use crate::script::bindings::host_of;
    use crate::script::convert::usize_arg;
    use crate::script::error::{host, RhaiResult};

    /// rollout(model, prompts, opts) -> Rollout
    ///
    /// Samples `opts.n` responses per prompt. prompts: strings or maps with `problem` (a string
    /// or a list of #{role, content} messages; and `answer`, used by `score`). opts: #{n,
    /// temperature, top_p, top_k, min_p, max_tokens, stop, seed, template}; template: "model" (default:
    /// what the model folder declares) | "none" | "raw" | "chat" | "chat-think" | #{kind, suffix,
    /// system, enable_thinking}.
    ///
    /// # Example
    ///
    /// ```rhai
    /// let r = rollout(m, sample_prompts(ds, 2, 0), #{n: 4, max_tokens: 32});
    /// ```
    #[rhai_fn(name = "rollout", volatile, return_raw)]
    pub fn rollout_with(
        ctx: NativeCallContext,
        m: ModelHandle,
        prompts: Array,
        opts: Map,
    ) -> RhaiResult<RolloutHandle> {
        super::run_rollout(&*host_of(&ctx)?, &m, &prompts, &opts)
    }

    /// rollout(model, prompts) -> Rollout
    ///
    /// Same with the default sampling (n 8, temperature 1, top-p 1, 256 tokens).
    ///
    /// # Example
    ///
    /// ```rhai
    /// let r = rollout(m, ["Compute 2+3."]);
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn rollout(ctx: NativeCallContext, m: ModelHandle, prompts: Array) -> RhaiResult<RolloutHandle> {
        super::run_rollout(&*host_of(&ctx)?, &m, &prompts, &Map::new())
    }

    /// rollout.len -> int
    ///
    /// Number of samples.
    ///
    /// # Example
    ///
    /// ```rhai
    /// print(r.len);
    /// ```
    #[rhai_fn(get = "len", pure, volatile, return_raw)]
    pub fn len(r: &mut RolloutHandle) -> RhaiResult<i64> {
        Ok(lock(&r.0, "rollout")?.batch.len() as i64)
    }

    /// rollout.texts -> array of string
    ///
    /// The response texts.
    ///
    /// # Example
    ///
    /// ```rhai
    /// for t in r.texts { print(t); }
    /// ```
    #[rhai_fn(get = "texts", pure, volatile, return_raw)]
    pub fn texts(r: &mut RolloutHandle) -> RhaiResult<Array> {
        Ok(lock(&r.0, "rollout")?.batch.samples.iter().map(|s| Dynamic::from(s.text.clone())).collect())
    }

    /// rollout.rewards -> array
    ///
    /// Rewards per sample (() before `score`).
    ///
    /// # Example
    ///
    /// ```rhai
    /// score(r);
    /// print(r.rewards);
    /// ```
    #[rhai_fn(get = "rewards", pure, volatile, return_raw)]
    pub fn rewards(r: &mut RolloutHandle) -> RhaiResult<Array> {
        let st = lock(&r.0, "rollout")?;
        Ok(st
            .batch
            .samples
            .iter()
            .map(|s| s.reward.map_or(Dynamic::UNIT, |x| Dynamic::from(x as f64)))
            .collect())
    }

    /// rollout.mean_reward -> float or ()
    ///
    /// Mean reward over the samples.
    ///
    /// # Example
    ///
    /// ```rhai
    /// score(r);
    /// print(r.mean_reward);
    /// ```
    #[rhai_fn(get = "mean_reward", pure, volatile, return_raw)]
    pub fn mean_reward(r: &mut RolloutHandle) -> RhaiResult<Dynamic> {
        Ok(lock(&r.0, "rollout")?.batch.mean_reward().map_or(Dynamic::UNIT, Dynamic::from))
    }

    /// rollout.sample(i) -> map
    ///
    /// Sample i: #{text, response_ids, old_logprobs, entropies, reward, group, prompt, answer,
    /// advantage, ...}.
    ///
    /// # Example
    ///
    /// ```rhai
    /// r.sample(0).text
    /// ```
    #[rhai_fn(pure, volatile, return_raw)]
    pub fn sample(r: &mut RolloutHandle, i: i64) -> RhaiResult<Dynamic> {
        let st = lock(&r.0, "rollout")?;
        sample_map(&st, usize_arg("i", i)?)
    }

    /// rollout.samples -> array of map
    ///
    /// Every sample as in `rollout.sample(i)`.
    ///
    /// # Example
    ///
    /// ```rhai
    /// let lens = r.samples.map(|s| s.response_ids.len());
    /// ```
    #[rhai_fn(get = "samples", pure, volatile, return_raw)]
    pub fn samples(r: &mut RolloutHandle) -> RhaiResult<Array> {
        let st = lock(&r.0, "rollout")?;
        (0..st.batch.len()).map(|i| sample_map(&st, i)).collect()
    }

    /// rollout.table(i) -> string
    ///
    /// The token table of sample i: token, p (pi_old), H (entropy), advantage, silenced by S2T;
    /// then each silenced token in its context (a few tokens either side).
    ///
    /// # Example
    ///
    /// ```rhai
    /// print(r.table(0));
    /// ```
    #[rhai_fn(pure, volatile, return_raw)]
    pub fn table(r: &mut RolloutHandle, i: i64) -> RhaiResult<String> {
        super::table(r, usize_arg("i", i)?)
    }

    /// rollout.tokens(i) -> array of map
    ///
    /// The token table of sample i as data: #{pos, id, token, p, H, advantage, silenced,
    /// context} (context: for a silenced token, `…left⟦token⟧right…`).
    ///
    /// # Example
    ///
    /// ```rhai
    /// r.tokens(0).filter(|t| t.silenced)
    /// ```
    #[rhai_fn(pure, volatile, return_raw)]
    pub fn tokens(r: &mut RolloutHandle, i: i64) -> RhaiResult<Array> {
        super::tokens(r, usize_arg("i", i)?)
    }

    /// spurious_plot(rollout, path) -> map
    ///
    /// STAPO's token scatter of a run's rollout (`run.rollout`): every token of a positive-advantage
    /// response placed by p (log axis) and entropy H as the update saw them, coloured by its
    /// logit-gradient norm |A|·sqrt((1 - p)² + Σ_{j≠y} p_j²), the S2T region (p < tau_p, H < tau_h)
    /// shaded, silenced tokens ringed. Writes `path` + `.png` and `.svg`; returns #{png, svg,
    /// points, silenced}. For any other rollout use spurious_plot(model, rollout, path).
    ///
    /// # Example
    ///
    /// ```rhai
    /// let t = trainer(#{model: "models/tiny-qwen3", data: "data/arith/train.jsonl"}); t.step();
    /// spurious_plot(t.rollout, t.run_dir + "/spurious-last");
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn spurious_plot(r: RolloutHandle, path: &str) -> RhaiResult<Map> {
        super::spurious_plot(&r, None, path)
    }

    /// spurious_plot(model, rollout, path) -> map
    ///
    /// The same scatter for any scored rollout, with p, H and the collision probability from a
    /// forward pass of `model` (temperature 1) and the rollout's advantages (GRPO's if none were
    /// computed); the S2T region and silenced tokens are those of the last `s2t(r, ..)`.
    ///
    /// # Example
    ///
    /// ```rhai
    /// let r = rollout(m, sample_prompts(ds, 8, 0), #{n: 8, max_tokens: 64});
    /// score(r); s2t(r, #{tau_p: 0.01});
    /// print(spurious_plot(m, r, "spurious"));
    /// ```
    #[rhai_fn(name = "spurious_plot", volatile, return_raw)]
    pub fn spurious_plot_with(m: ModelHandle, r: RolloutHandle, path: &str) -> RhaiResult<Map> {
        super::spurious_plot(&r, Some(&m), path)
    }

    /// rollout.save(path)
    ///
    /// Writes the batch as JSONL (replayable with `stapo update`).
    ///
    /// # Example
    ///
    /// ```rhai
    /// r.save("rollouts.jsonl");
    /// ```
    #[rhai_fn(pure, volatile, return_raw)]
    pub fn save(r: &mut RolloutHandle, path: &str) -> RhaiResult<()> {
        lock(&r.0, "rollout")?.batch.save_jsonl(std::path::Path::new(path)).map_err(host)
    }

    /// to_string(rollout) -> string
    ///
    /// A summary and the token tables of the first samples.
    ///
    /// # Example
    ///
    /// ```rhai
    /// print(r);
    /// ```
    #[rhai_fn(name = "to_string", pure, volatile)]
    pub fn rollout_to_string(r: &mut RolloutHandle) -> String {
        super::describe(r)
    }

    /// to_debug(rollout) -> string
    ///
    /// # Example
    ///
    /// ```rhai
    /// debug(r);
    /// ```
    #[rhai_fn(name = "to_debug", pure, volatile)]
    pub fn rollout_to_debug(r: &mut RolloutHandle) -> String {
        super::describe(r)
    }
}
