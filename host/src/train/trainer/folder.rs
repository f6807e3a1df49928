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
use super::partial::PartialState;
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
    /// The factor on the learning rate after divergence rollbacks (1 without any).
    #[serde(default = "one")]
    pub lr_scale: f64,
    /// Rollbacks so far.
    #[serde(default)]
    pub rollbacks: usize,
    /// Under partial rollouts: the groups in flight, their unfinished responses and
    /// problems, continued by a resumed run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial: Option<PartialState>,
}

fn one() -> f64 {
    1.0
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
    /// Makes `dir` a new run folder holding `cfg`; an error if it already holds a run with
    /// a checkpoint. A run that ended there before its first checkpoint is replaced: its
    /// configuration and the metrics and evaluations it logged (steps that run again) are
    /// dropped; returns a note saying so.
    pub fn create(dir: &Path, cfg: &RunConfig) -> Result<Option<String>> {
        let note = if crate::guard::folder::holds_unsaved_run(dir) {
            let logged = std::fs::read_to_string(dir.join("metrics.jsonl"))
                .map(|t| t.lines().filter(|l| !l.trim().is_empty()).count())
                .unwrap_or(0);
            for f in ["metrics.jsonl", "eval.jsonl"] {
                let p = dir.join(f);
                if p.exists() {
                    std::fs::remove_file(&p).map_err(|e| Error::io(&p, e))?;
                }
            }
            std::fs::remove_file(dir.join("run_config.json"))
                .map_err(|e| Error::io(dir.join("run_config.json"), e))?;
            Some(format!(
                "{}: the run there ended before its first checkpoint; it starts again from step 0 \
                 ({logged} step(s) it had logged dropped)",
                dir.display()
            ))
        } else {
            None
        };
        if dir.join("run_config.json").exists() {
            return Err(Error::invalid(format!(
                "{} already holds a run; resume it or pick another folder",
                dir.display()
            )));
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let text = serde_json::to_string_pretty(cfg).map_err(|e| Error::invalid(e.to_string()))?;
        write_file_atomically(&dir.join("run_config.json"), text.as_bytes())?;
        Ok(note)
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

    /// The step of the checkpoint `checkpoints/latest` names, if there is one.
    pub fn latest_step(dir: &Path) -> Option<u64> {
        let name = std::fs::read_to_string(dir.join("checkpoints/latest")).ok()?;
        name.trim().strip_prefix("step-")?.parse().ok()
    }

    /// The steps of the checkpoints in `dir` (`checkpoints/step-NNNNNN/`), in order.
    fn checkpoint_steps(dir: &Path) -> Vec<u64> {
        let Ok(rd) = std::fs::read_dir(dir.join("checkpoints")) else { return Vec::new() };
        let mut steps: Vec<u64> = rd
            .flatten()
            .filter(|e| e.path().is_dir())
            .filter_map(|e| e.file_name().to_string_lossy().strip_prefix("step-")?.parse().ok())
            .collect();
        steps.sort_unstable();
        steps
    }

    /// The newest checkpoint of `dir` at step `max` or before.
    pub fn newest_checkpoint_upto(dir: &Path, max: u64) -> Option<u64> {
        Self::checkpoint_steps(dir).into_iter().rfind(|&s| s <= max)
    }

    /// Sets aside the checkpoints after step `good` (all of them when `None`) as
    /// `checkpoints/diverged-step-NNNNNN/` and points `latest` at `good` (no `latest` when
    /// `None`: the run then starts again from step 0).
    pub fn set_aside_after(dir: &Path, good: Option<u64>) -> Result<()> {
        let ck = dir.join("checkpoints");
        for s in Self::checkpoint_steps(dir).into_iter().filter(|&s| good.is_none_or(|g| s > g)) {
            let from = ck.join(format!("step-{s:06}"));
            let to = ck.join(format!("diverged-step-{s:06}"));
            if to.exists() {
                std::fs::remove_dir_all(&to).map_err(|e| Error::io(&to, e))?;
            }
            std::fs::rename(&from, &to).map_err(|e| Error::io(&from, e))?;
        }
        let latest = ck.join("latest");
        match good {
            Some(g) => write_file_atomically(&latest, format!("step-{g:06}").as_bytes()),
            None if latest.exists() => std::fs::remove_file(&latest).map_err(|e| Error::io(&latest, e)),
            None => Ok(()),
        }
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

    /// Drops the metrics lines of steps from `step` on (a resumed run runs them again). A
    /// damaged line (cut by a crash, edited by hand: not a JSON object with a `step`) is an
    /// error naming `metrics.jsonl:LINE`; with `repair` the file is cut back to the last
    /// whole step before it instead, and the note returned says what was cut.
    pub fn drop_metrics_from(&self, step: u64, repair: bool) -> Result<Option<String>> {
        let path = self.dir.join("metrics.jsonl");
        let Ok(text) = std::fs::read_to_string(&path) else { return Ok(None) };
        let mut kept = String::new();
        let mut note = None;
        for (i, l) in text.lines().enumerate() {
            if l.trim().is_empty() {
                continue;
            }
            let parsed = serde_json::from_str::<serde_json::Value>(l)
                .map_err(|e| e.to_string())
                .and_then(|v| v["step"].as_u64().ok_or_else(|| "no `step` field".to_string()));
            match parsed {
                Ok(s) if s < step => {
                    kept.push_str(l);
                    kept.push('\n');
                }
                Ok(_) => {}
                Err(why) if repair => {
                    let total = text.lines().filter(|l| !l.trim().is_empty()).count();
                    let whole = kept.lines().count();
                    note = Some(format!(
                        "--repair-metrics: {}:{} was damaged ({why}); metrics.jsonl cut back to the \
                         {whole} whole step line(s) before it ({} line(s) dropped){}",
                        path.display(),
                        i + 1,
                        total - whole,
                        if (whole as u64) < step {
                            format!("; steps {whole}-{} have no metrics line", step - 1)
                        } else {
                            String::new()
                        }
                    ));
                    break;
                }
                Err(why) => {
                    return Err(Error::Parse {
                        path: path.clone(),
                        line: i + 1,
                        msg: format!(
                            "damaged metrics line ({why}); resume with --repair-metrics to cut the \
                             file back to the last whole step before it"
                        ),
                    })
                }
            }
        }
        write_file_atomically(&path, kept.as_bytes())?;
        Ok(note)
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
