//! Bindings for data: datasets, prompt sampling and templates, the arithmetic
//! task generator, and building `models/tiny-qwen3`.

use std::path::PathBuf;
use std::sync::Arc;

use rhai::{Array, Dynamic, Engine, Map};

use super::DatasetHandle;
use crate::data::{task, Dataset, DatasetOptions, EpochSampler, Example, PromptTemplate, TaskConfig};
use crate::script::convert::{options, overlay, to_dynamic, to_json, u64_arg, usize_arg};
use crate::script::error::{bad_arg, host, RhaiResult};
use crate::script::shared_state::Host;
use crate::train::TinyConfig;

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

/// Builds the tiny model; smoke mode shrinks everything and writes under the run folder.
fn pretrain_tiny(h: &Host, cfg: &Map) -> RhaiResult<Dynamic> {
    let mut c: TinyConfig = options("pretrain_tiny", cfg)?;
    if h.opts.smoke {
        c.max_steps = c.max_steps.min(2);
        c.warmup_steps = c.warmup_steps.min(1);
        c.eval_every = c.eval_every.min(1);
        c.n_train = c.n_train.min(32);
        c.n_test = c.n_test.min(8);
        c.eval_problems = c.eval_problems.min(4);
        c.eval_samples = c.eval_samples.min(2);
        c.batch_size = c.batch_size.min(4);
        c.final_eval = false;
        // Never overwrite a real model folder from a smoke run.
        let base =
            h.claimed_run_dir().map_err(host)?.unwrap_or_else(|| std::env::temp_dir().join("stapo-smoke"));
        c.model_dir = base.join("tiny-model");
        c.data_dir = Some(base.join("tiny-data"));
    }
    let report = crate::train::pretrain_tiny(&c, &mut |line: &str| h.println(line)).map_err(host)?;
    to_dynamic(&report)
}

pub(super) fn register(engine: &mut Engine, host_: &Arc<Host>) {
    let h = host_.clone();
    func! { engine, "load_data", r#"
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
    "#,
        move |path: &str| load_data(&h, path, &Map::new())
    }
    let h = host_.clone();
    func! { engine, "load_data", r#"
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
    "#,
        move |path: &str, opts: Map| load_data(&h, path, &opts)
    }
    getter! { engine, "len", r#"
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
    "#,
        |d: &mut DatasetHandle| d.0.len() as i64
    }
    func! { engine, "get", r#"
        /// dataset.get(i) -> map
        ///
        /// Example `i` as #{id, problem, answer, source}.
        ///
        /// # Example
        ///
        /// ```rhai
        /// ds.get(0).answer
        /// ```
    "#,
        |d: &mut DatasetHandle, i: i64| -> RhaiResult<Dynamic> {
            let e = usize::try_from(i)
                .ok()
                .and_then(|i| d.0.get(i))
                .ok_or_else(|| bad_arg("get", format!("index {i} is outside 0..{}", d.0.len())))?;
            Ok(example_map(e))
        }
    }
    func! { engine, "sample_prompts", r#"
        /// sample_prompts(dataset, n, seed) -> array of map
        ///
        /// `n` examples drawn without replacement (seeded), as #{id, problem, answer, source}.
        ///
        /// # Example
        ///
        /// ```rhai
        /// let ps = sample_prompts(ds, 4, 0);
        /// ```
    "#,
        |d: DatasetHandle, n: i64, seed: i64| sample(&d, n, seed)
    }
    func! { engine, "sample", r#"
        /// dataset.sample(n, seed) -> array of map
        ///
        /// Same as `sample_prompts(dataset, n, seed)`.
        ///
        /// # Example
        ///
        /// ```rhai
        /// let ps = ds.sample(4, 0);
        /// ```
    "#,
        |d: &mut DatasetHandle, n: i64, seed: i64| sample(d, n, seed)
    }
    func! { engine, "to_string", r#"
        /// to_string(dataset) -> string
        ///
        /// # Example
        ///
        /// ```rhai
        /// print(ds);
        /// ```
    "#,
        |d: &mut DatasetHandle| format!("Dataset({}, {} examples)", d.0.path().display(), d.0.len())
    }
    func! { engine, "render_prompt", r#"
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
    "#,
        |problem: &str, t: Dynamic| -> RhaiResult<String> {
            let p = crate::data::Prompter::standalone(&template(&t)?).map_err(host)?;
            p.render(&problem.into()).map_err(host)
        }
    }
    func! { engine, "render_prompt", r#"
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
    "#,
        |m: super::ModelHandle, problem: &str, t: Dynamic| -> RhaiResult<String> {
            let slot = super::lock(&m.0, "model")?;
            let tok =
                slot.tokenizer.as_ref().ok_or_else(|| host("render_prompt: the model has no tokenizer"))?;
            tok.prompter(&template(&t)?).map_err(host)?.render(&problem.into()).map_err(host)
        }
    }
    func! { engine, "arith_problems", r#"
        /// arith_problems(n, seed) -> array of map
        ///
        /// `n` generated arithmetic problems #{id, problem, answer, source, solution}.
        ///
        /// # Example
        ///
        /// ```rhai
        /// let ps = arith_problems(8, 0);
        /// ```
    "#,
        |n: i64, seed: i64| arith(n, seed, &Map::new())
    }
    func! { engine, "arith_problems", r#"
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
    "#,
        |n: i64, seed: i64, cfg: Map| arith(n, seed, &cfg)
    }
    func! { engine, "write_jsonl", r#"
        /// write_jsonl(path, rows) -> int
        ///
        /// Writes an array of maps as JSON lines (atomically); returns the row count.
        ///
        /// # Example
        ///
        /// ```rhai
        /// write_jsonl("data/mine.jsonl", arith_problems(100, 1));
        /// ```
    "#,
        |path: &str, rows: Array| -> RhaiResult<i64> {
            let mut text = String::new();
            for r in &rows {
                text.push_str(&to_json("rows", r)?.to_string());
                text.push('\n');
            }
            crate::files::write_file_atomically(&PathBuf::from(path), text.as_bytes()).map_err(host)?;
            Ok(rows.len() as i64)
        }
    }
    let h = host_.clone();
    func! { engine, "pretrain_tiny", r#"
        /// pretrain_tiny(cfg) -> map
        ///
        /// Builds a tiny model from scratch (task data, BPE tokenizer, SFT until the target accuracy);
        /// cfg keys as TinyConfig (model_dir, data_dir, n_train, max_steps, target_accuracy, ...).
        /// Returns the report.
        ///
        /// # Example
        ///
        /// ```rhai
        /// pretrain_tiny(#{model_dir: "models/tiny-qwen3", max_steps: 200})
        /// ```
    "#,
        move |cfg: Map| pretrain_tiny(&h, &cfg)
    }
}
