//! The run folder: `run_config.json`, `metrics.jsonl` and `eval.jsonl` (one line per
//! step or evaluation), `eval/step-NNNNNN.jsonl` (the samples), `tb/` (TensorBoard),
//! `rollouts/`, `checkpoints/step-NNNNNN/` with `checkpoints/latest`, the figures and
//! `silenced_tokens.tsv`. Every file a crash could leave half-written is written
//! atomically; rank 0 alone writes (the callers run these under [`dist::on_root`]).
//!
//! Depends on `data` (the sampler's state), `eval` (reports), `rollout` (the saved
//! rollouts), `train::plot`, `train::spurious`, `train::tensorboard`, `files` and the
//! step's metrics (`metrics.rs`).
//!
//! [`dist::on_root`]: crate::dist::on_root

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::metrics::StepMetrics;
use crate::data::SamplerState;
use crate::eval::{self, EvalReport};
use crate::files::{append_line, write_file_atomically};
use crate::rollout::RolloutBatch;
use crate::train::plot::{self, RunCurves};
use crate::train::spurious::{SilencedContexts, SpuriousLog};
use crate::train::tensorboard::Board;
use crate::train::RunConfig;
use crate::{Error, Result};

/// Saved with each checkpoint: where the run stood.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct TrainerState {
    /// Steps completed when the checkpoint was written.
    pub step: u64,
    /// Where the epoch sampler stands in the training set.
    pub sampler: SamplerState,
    /// Times each token was silenced over the run, most frequent first.
    pub silenced_totals: Vec<(String, usize)>,
    /// A few contexts of each silenced token.
    #[serde(default)]
    pub silenced_contexts: SilencedContexts,
}

/// A run folder being written, and the held-out evaluations recorded in it.
pub struct RunFolder {
    dir: PathBuf,
    /// `tb/`: every metrics and eval row again as TensorBoard scalars.
    tb: Board,
    /// (step, avg@n, pass@n) of every held-out evaluation of this run.
    evals: Vec<(u64, f64, f64)>,
}

impl RunFolder {
    /// Makes `dir` a new run folder holding `cfg`; an error if it already holds a run.
    pub fn create(dir: &Path, cfg: &RunConfig) -> Result<()> {
        if dir.join("run_config.json").exists() {
            return Err(Error::invalid(format!(
                "{} already holds a run; resume it or pick another folder",
                dir.display()
            )));
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let text = serde_json::to_string_pretty(cfg).map_err(|e| Error::invalid(e.to_string()))?;
        write_file_atomically(&dir.join("run_config.json"), text.as_bytes())
    }

    /// The configuration `dir` was created with (through [`RunConfig::from_json`], so a
    /// file of the old flat layout is an error naming the new place of its first key).
    pub fn read_config(dir: &Path) -> Result<RunConfig> {
        let path = dir.join("run_config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Parse {
            path: path.clone(),
            line: e.line(),
            msg: e.to_string(),
        })?;
        RunConfig::from_json(&v).map_err(|e| match e {
            Error::Config { field, msg, .. } => {
                Error::Config { file: path.display().to_string(), field, msg }
            }
            other => other,
        })
    }

    /// Replaces the configuration of `dir` by `cfg` (a resume that applies changes), keeping
    /// the previous file as `run_config-step-NNNNNN.json` (`step`: where the run resumes).
    pub fn replace_config(dir: &Path, cfg: &RunConfig, step: u64) -> Result<()> {
        let path = dir.join("run_config.json");
        let keep = dir.join(format!("run_config-step-{step:06}.json"));
        std::fs::copy(&path, &keep).map_err(|e| Error::io(&keep, e))?;
        let text = serde_json::to_string_pretty(cfg).map_err(|e| Error::invalid(e.to_string()))?;
        write_file_atomically(&path, text.as_bytes())
    }

    /// The folder of the latest checkpoint.
    pub fn latest_checkpoint(dir: &Path) -> Result<PathBuf> {
        let latest = dir.join("checkpoints/latest");
        let name = std::fs::read_to_string(&latest).map_err(|e| Error::io(&latest, e))?;
        Ok(dir.join("checkpoints").join(name.trim()))
    }

    /// The trainer state saved in checkpoint `ckpt`.
    pub(super) fn read_state(ckpt: &Path) -> Result<TrainerState> {
        read_json(&ckpt.join("trainer_state.json"))
    }

    /// The folder `dir` for writing; a run resumed at `resumed` keeps the evaluations
    /// recorded up to that step (a new run has none: reading eval.jsonl there raced with
    /// rank 0's step-0 evaluation in a data-parallel run).
    pub fn open(dir: &Path, resumed: Option<u64>) -> Self {
        let evals = resumed.map(|s| read_evals(&dir.join("eval.jsonl"), s)).unwrap_or_default();
        Self { dir: dir.to_path_buf(), tb: Board::new(dir), evals }
    }

    /// The run folder's path.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// (step, avg@n, pass@n) of every held-out evaluation so far.
    pub fn evals(&self) -> &[(u64, f64, f64)] {
        &self.evals
    }

    /// Drops the metrics lines of steps from `step` on (a resumed run runs them again).
    pub fn drop_metrics_from(&self, step: u64) -> Result<()> {
        let path = self.dir.join("metrics.jsonl");
        let Ok(text) = std::fs::read_to_string(&path) else { return Ok(()) };
        let kept: String = text
            .lines()
            .filter(|l| {
                serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v["step"].as_u64())
                    .is_some_and(|s| s < step)
            })
            .map(|l| format!("{l}\n"))
            .collect();
        write_file_atomically(&path, kept.as_bytes())
    }

    /// Appends a step's metrics to `metrics.jsonl` and TensorBoard.
    pub fn log_step(&mut self, m: &StepMetrics) -> Result<()> {
        let line = serde_json::to_string(m).map_err(|e| Error::invalid(e.to_string()))?;
        append_line(&self.dir.join("metrics.jsonl"), &line)?;
        self.tb.metrics(m)
    }

    /// Writes an evaluation at `step` sampled at `temperature` / `top_p`: its samples, a
    /// line (with the two) of `eval.jsonl` and TensorBoard for the run's configured
    /// setting; with `extra` (another setting, `run.evaluate(#{temperature, top_p})`) a
    /// line of `eval-t<T>-p<top_p>.jsonl` and samples `eval/step-NNNNNN-t<T>-p<top_p>.jsonl`,
    /// so that each file holds one setting and the curves stay the configured one's.
    pub fn log_eval(
        &mut self,
        step: u64,
        report: &EvalReport,
        (temperature, top_p): (f64, f64),
        extra: bool,
    ) -> Result<()> {
        let tag = if extra { format!("-t{temperature}-p{top_p}") } else { String::new() };
        eval::write_samples(
            &self.dir.join("eval").join(format!("step-{step:06}{tag}.jsonl")),
            &report.samples,
        )?;
        let summary = serde_json::json!({"step": step, "temperature": temperature, "top_p": top_p,
            "overall": report.overall, "by_source": report.by_source});
        append_line(&self.dir.join(format!("eval{tag}.jsonl")), &summary.to_string())?;
        if extra {
            return Ok(());
        }
        self.tb.eval(step, report)
    }

    /// Records an evaluation's figures (every rank, after rank 0 wrote it).
    pub fn note_eval(&mut self, step: u64, report: &EvalReport) {
        self.evals.push((step, report.overall.avg, report.overall.pass));
    }

    /// Writes checkpoint `step` atomically (`fill` writes the model and optimizer files into
    /// a temporary folder; the trainer state goes beside them), points `latest` at it and
    /// keeps the newest `keep` checkpoints.
    pub(super) fn checkpoint(
        &self,
        state: &TrainerState,
        keep: usize,
        fill: impl FnOnce(&Path) -> Result<()>,
    ) -> Result<PathBuf> {
        let dir = self.dir.join("checkpoints");
        let name = format!("step-{:06}", state.step);
        let path = dir.join(&name);
        crate::model::checkpoint::write_atomically(&path, |tmp| {
            fill(tmp)?;
            let text = serde_json::to_string_pretty(state).map_err(|e| Error::invalid(e.to_string()))?;
            std::fs::write(tmp.join("trainer_state.json"), text)
                .map_err(|e| Error::io(tmp.join("trainer_state.json"), e))
        })?;
        write_file_atomically(&dir.join("latest"), name.as_bytes())?;
        let mut all: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map_err(|e| Error::io(&dir, e))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_dir() && p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("step-")))
            .collect();
        all.sort();
        let keep = keep.max(1);
        if all.len() > keep {
            for old in &all[..all.len() - keep] {
                let _ = std::fs::remove_dir_all(old);
            }
        }
        Ok(path)
    }

    /// Saves the rollouts of `step` as `rollouts/step-NNNNNN.jsonl`.
    pub fn save_rollouts(&self, step: u64, batch: &RolloutBatch) -> Result<()> {
        let dir = self.dir.join("rollouts");
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        batch.save_jsonl(&dir.join(format!("step-{step:06}.jsonl")))
    }

    /// Writes `silenced_tokens.tsv` from the run's spurious-token log.
    pub fn write_silenced(&self, log: &SpuriousLog) -> Result<()> {
        write_file_atomically(&self.dir.join("silenced_tokens.tsv"), log.tsv().as_bytes())
    }

    /// Draws `curves.png`/`.svg` (labelled `label`) and, once the log has points,
    /// `spurious.png`/`.svg` (see [`super::Trainer::plot`]).
    pub fn plot(&self, label: &str, log: &SpuriousLog) -> Result<(PathBuf, PathBuf)> {
        let points = log.points();
        if !points.is_empty() {
            let title = format!(
                "{label}: tokens of positive-advantage responses of {} update{}",
                points.steps,
                if points.steps == 1 { "" } else { "s" }
            );
            plot::spurious(&points.points(), points.region, &title, &self.dir.join("spurious"))?;
        }
        let runs = [RunCurves {
            label: label.to_string(),
            metrics: self.dir.join("metrics.jsonl"),
            eval: Some(self.dir.join("eval.jsonl")),
        }];
        if !runs[0].metrics.is_file() {
            return Err(Error::invalid(format!("{}: no metrics yet", runs[0].metrics.display())));
        }
        plot::plot(&plot::standard_panels(&runs)?, &self.dir.join("curves"))
    }
}

/// A JSON file of the run folder, parse errors naming its line.
fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::Parse {
        path: path.to_path_buf(),
        line: e.line(),
        msg: e.to_string(),
    })
}

/// Evaluations recorded in `eval.jsonl` up to `before_step` (a resumed run re-runs later
/// steps).
fn read_evals(path: &Path, before_step: u64) -> Vec<(u64, f64, f64)> {
    let Ok(text) = std::fs::read_to_string(path) else { return Vec::new() };
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| {
            Some((v["step"].as_u64()?, v["overall"]["avg"].as_f64()?, v["overall"]["pass"].as_f64()?))
        })
        .filter(|e| e.0 <= before_step)
        .collect()
}
