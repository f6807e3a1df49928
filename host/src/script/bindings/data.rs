//! Bindings for data: datasets, prompt sampling and templates, and the
//! arithmetic task generator.

use std::sync::Arc;

use rhai::plugin::{export_module, exported_module};
use rhai::{Array, Dynamic, Engine, Map};

use super::DatasetHandle;
use crate::data::{task, Dataset, DatasetOptions, EpochSampler, Example, PromptTemplate, TaskConfig};
use crate::script::convert::{overlay, to_dynamic, to_json, u64_arg, usize_arg};
use crate::script::error::{bad_arg, host, RhaiResult};
use crate::script::shared_state::Host;

/// An example as a script map: `#{id, problem, answer, source}`, plus
/// `messages` (array of `#{role, content}`) when the dataset gave chat messages.
pub fn example_map(e: &Example) -> Dynamic {
    let mut m = Map::new();
    m.insert("id".into(), e.id.clone().into());
    m.insert("problem".into(), e.problem.clone().into());
    m.insert("answer".into(), e.answer.clone().into());
    m.insert("source".into(), e.source.clone().into());
    if let Some(msgs) = &e.messages {
        let arr: Array = msgs
            .iter()
            .map(|x| {
                let mut mm = Map::new();
                mm.insert("role".into(), x.role.clone().into());
                mm.insert("content".into(), x.content.clone().into());
                Dynamic::from_map(mm)
            })
            .collect();
        m.insert("messages".into(), arr.into());
    }
    Dynamic::from_map(m)
}

/// A prompt template as a script gives it: a name (`"model"`, `"none"`,
/// `"raw"`, `"chat"`, `"chat-think"`) or a map (`#{kind: "raw", suffix: ""}`).
pub fn template(v: &Dynamic) -> RhaiResult<PromptTemplate> {
    PromptTemplate::from_json(&to_json("template", v)?).map_err(|e| bad_arg("template", e))
}

/// The `template` entry of an option map (`"model"` when absent).
pub fn template_opt(opts: &Map) -> RhaiResult<PromptTemplate> {
    opts.get("template").filter(|v| !v.is_unit()).map_or(Ok(PromptTemplate::Model), template)
}

fn sample(ds: &DatasetHandle, n: i64, seed: i64) -> RhaiResult<Array> {
    let mut s = EpochSampler::new(ds.0.len(), u64_arg("seed", seed)?).map_err(host)?;
    let idx = s.next_batch(usize_arg("n", n)?).map_err(host)?;
    Ok(ds.0.select(&idx).map_err(host)?.into_iter().map(example_map).collect())
}

/// `load_data`: the dataset, with one warning per skipped record shown as train and eval
/// show theirs (records are never dropped silently).
fn load_data(h: &Host, path: &str, opts: &Map) -> RhaiResult<DatasetHandle> {
    let o: DatasetOptions = overlay(
        "load_data",
        &DatasetOptions::default(),
        to_json("load_data", &Dynamic::from_map(opts.clone()))?,
    )?;
    let (ds, warnings) = Dataset::load(path, &o).map_err(host)?;
    for w in &warnings {
        h.notice(&format!("warning: load_data: skipped {w}"));
    }
    if !warnings.is_empty() {
        h.notice(&format!(
            "warning: load_data(\"{path}\"): {} record(s) skipped, {} loaded",
            warnings.len(),
            ds.len()
        ));
    }
    Ok(DatasetHandle(Arc::new(ds)))
}

fn arith(n: i64, seed: i64, cfg: &Map) -> RhaiResult<Array> {
    let tc: TaskConfig =
        overlay("task", &TaskConfig::default(), to_json("task", &Dynamic::from_map(cfg.clone()))?)?;
    let probs = task::generate(usize_arg("n", n)?, u64_arg("seed", seed)?, &tc).map_err(host)?;
    probs.iter().map(to_dynamic).collect()
}

/// Registers the data functions.
pub(super) fn register(engine: &mut Engine) {
    engine.register_global_module(exported_module!(fns).into());
}

/// The script-visible data functions.
#[export_module]
mod fns {
    use std::path::PathBuf;

    use rhai::{Array, Dynamic, Map, NativeCallContext};

    use super::{example_map, template, DatasetHandle};
    use crate::script::bindings::{host_of, lock, ModelHandle};
    use crate::script::convert::to_json;
    use crate::script::error::{bad_arg, host, RhaiResult};

    /// load_data(path) -> Dataset
    ///
    /// Loads a task dataset: a JSONL or Parquet file (verl's schema understood: `prompt` chat
    /// messages, `reward_model.ground_truth`, `data_source`, `extra_info.index`), a folder of
    /// Hugging Face shards, or a `*` pattern; bad records are skipped with a warning.
    ///
    /// # Example
    ///
    /// ```rhai
    /// let ds = load_data("data/arith/train.jsonl");
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn load_data(ctx: NativeCallContext, path: &str) -> RhaiResult<DatasetHandle> {
        super::load_data(&*host_of(&ctx)?, path, &Map::new())
    }

    /// load_data(path, options) -> Dataset
    ///
    /// options: #{problem_fields, answer_fields, id_fields, source_fields (a name or a list;
    /// dotted names reach into structs), strip_instruction, dedupe, split, bad_lines:
    /// "skip"|"reject"}.
    ///
    /// # Example
    ///
    /// ```rhai
    /// load_data("my.parquet", #{problem_fields: "question", answer_fields: "meta.gold"})
    /// ```
    #[rhai_fn(name = "load_data", volatile, return_raw)]
    pub fn load_data_with(ctx: NativeCallContext, path: &str, options: Map) -> RhaiResult<DatasetHandle> {
        super::load_data(&*host_of(&ctx)?, path, &options)
    }

    /// dataset.len -> int
    ///
    /// Number of examples.
    ///
    /// # Example
    ///
    /// ```rhai
    /// let ds = load_data("data/arith/train.jsonl");
    /// print(ds.len);
    /// ```
    #[rhai_fn(get = "len", pure, volatile)]
    pub fn len(d: &mut DatasetHandle) -> i64 {
        d.0.len() as i64
    }

    /// dataset.get(i) -> map
    ///
    /// Example `i` as #{id, problem, answer, source}.
    ///
    /// # Example
    ///
    /// ```rhai
    /// ds.get(0).answer
    /// ```
    #[rhai_fn(pure, volatile, return_raw)]
    pub fn get(d: &mut DatasetHandle, i: i64) -> RhaiResult<Dynamic> {
        let e = usize::try_from(i)
            .ok()
            .and_then(|i| d.0.get(i))
            .ok_or_else(|| bad_arg("get", format!("index {i} is outside 0..{}", d.0.len())))?;
        Ok(example_map(e))
    }

    /// sample_prompts(dataset, n, seed) -> array of map
    ///
    /// `n` examples drawn without replacement (seeded), as #{id, problem, answer, source}.
    ///
    /// # Example
    ///
    /// ```rhai
    /// let ps = sample_prompts(ds, 4, 0);
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn sample_prompts(d: DatasetHandle, n: i64, seed: i64) -> RhaiResult<Array> {
        super::sample(&d, n, seed)
    }

    /// dataset.sample(n, seed) -> array of map
    ///
    /// Same as `sample_prompts(dataset, n, seed)`.
    ///
    /// # Example
    ///
    /// ```rhai
    /// let ps = ds.sample(4, 0);
    /// ```
    #[rhai_fn(pure, volatile, return_raw)]
    pub fn sample(d: &mut DatasetHandle, n: i64, seed: i64) -> RhaiResult<Array> {
        super::sample(d, n, seed)
    }

    /// to_string(dataset) -> string
    ///
    /// # Example
    ///
    /// ```rhai
    /// print(ds);
    /// ```
    #[rhai_fn(name = "to_string", pure, volatile)]
    pub fn dataset_to_string(d: &mut DatasetHandle) -> String {
        format!("Dataset({}, {} examples)", d.0.path().display(), d.0.len())
    }

    /// render_prompt(problem, template) -> string
    ///
    /// The prompt text for a problem, for a model that declares nothing: template "none" |
    /// "raw" | "chat" (the built-in Qwen3 chat template) | "chat-think" | a map #{kind, suffix,
    /// system, enable_thinking}.
    ///
    /// # Example
    ///
    /// ```rhai
    /// render_prompt("Compute 1+2.", "raw")
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn render_prompt(problem: &str, template: Dynamic) -> RhaiResult<String> {
        let p = crate::data::Prompter::standalone(&super::template(&template)?).map_err(host)?;
        p.render(&problem.into()).map_err(host)
    }

    /// render_prompt(model, problem, template) -> string
    ///
    /// The prompt text a model gets for a problem: template "model" (the folder's own format) |
    /// "none" | "raw" | "chat" | "chat-think" | a map.
    ///
    /// # Example
    ///
    /// ```rhai
    /// render_prompt(m, "Compute 1+2.", "model")
    /// ```
    #[rhai_fn(name = "render_prompt", volatile, return_raw)]
    pub fn render_prompt_for(m: ModelHandle, problem: &str, t: Dynamic) -> RhaiResult<String> {
        let slot = lock(&m.0, "model")?;
        let tok = slot.tokenizer.as_ref().ok_or_else(|| host("render_prompt: the model has no tokenizer"))?;
        tok.prompter(&template(&t)?).map_err(host)?.render(&problem.into()).map_err(host)
    }

    /// arith_problems(n, seed) -> array of map
    ///
    /// `n` generated arithmetic problems #{id, problem, answer, source, solution}.
    ///
    /// # Example
    ///
    /// ```rhai
    /// let ps = arith_problems(8, 0);
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn arith_problems(n: i64, seed: i64) -> RhaiResult<Array> {
        super::arith(n, seed, &Map::new())
    }

    /// arith_problems(n, seed, task) -> array of map
    ///
    /// task: #{min_operands, max_operands, min_value, max_value, max_factor, ops: "+-*",
    /// allow_negative}.
    ///
    /// # Example
    ///
    /// ```rhai
    /// arith_problems(8, 0, #{ops: "+-*"})
    /// ```
    #[rhai_fn(name = "arith_problems", volatile, return_raw)]
    pub fn arith_problems_with(n: i64, seed: i64, task: Map) -> RhaiResult<Array> {
        super::arith(n, seed, &task)
    }

    /// write_jsonl(path, rows) -> int
    ///
    /// Writes an array of maps as JSON lines (atomically); returns the row count.
    ///
    /// # Example
    ///
    /// ```rhai
    /// write_jsonl("data/mine.jsonl", arith_problems(100, 1));
    /// ```
    #[rhai_fn(volatile, return_raw)]
    pub fn write_jsonl(path: &str, rows: Array) -> RhaiResult<i64> {
        let mut text = String::new();
        for r in &rows {
            text.push_str(&to_json("rows", r)?.to_string());
            text.push('\n');
        }
        crate::files::write_file_atomically(&PathBuf::from(path), text.as_bytes()).map_err(host)?;
        Ok(rows.len() as i64)
    }
}
