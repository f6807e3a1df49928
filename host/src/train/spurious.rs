//! STAPO's token-level analysis of an update: where the tokens of positive-advantage
//! responses sit by probability p and entropy H, how large their logit gradients are,
//! which ones the S2T mask silenced (the paper's Figure 2/3 argument: the gradient norm
//! `|A|·sqrt((1 - p_y)² + Σ_{j≠y} p_j²)` grows as p and H fall), and readable contexts
//! of silenced tokens (`…12+7=1⟦9⟧\n\boxed…`).
//!
//! Everything here is bounded in memory: a run keeps every S2T candidate up to
//! [`MAX_MARKED`] points and a uniform reservoir sample of [`RESERVOIR`] other
//! tokens, and at most [`CONTEXTS_PER_TOKEN`] contexts for each of the first
//! [`MAX_CONTEXT_TOKENS`] distinct silenced tokens.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::data::Tokenizer;
use crate::rollout::Sample;
use crate::train::update::UpdateRecord;

/// The paper's tau_p: tokens below it are kept in full by [`SpuriousPoints`] whatever
/// the run's own thresholds, so S2T-less runs show the same low-probability tail.
pub const PAPER_TAU_P: f32 = 0.002;
/// Candidates and silenced tokens kept per run.
pub const MAX_MARKED: usize = 20_000;
/// Other positive-advantage tokens kept per run (uniform reservoir sample).
pub const RESERVOIR: usize = 4_000;
/// Tokens either side of a silenced token in its context.
pub const CONTEXT_TOKENS: usize = 4;
/// Contexts kept per silenced token string, and distinct token strings with contexts.
pub const CONTEXTS_PER_TOKEN: usize = 3;
/// Distinct token strings whose contexts are kept (see `CONTEXTS_PER_TOKEN`).
pub const MAX_CONTEXT_TOKENS: usize = 2_000;
/// Silenced tokens reported per step in their context.
pub const STEP_EXAMPLES: usize = 8;

/// A run's spurious-token log: how often each token string was silenced, a few of its
/// contexts, and the points of `spurious.png`. Totals and contexts are saved with each
/// checkpoint; the points belong to the updates of this process.
#[derive(Debug, Clone, Default)]
pub struct SpuriousLog {
    totals: HashMap<String, usize>,
    contexts: SilencedContexts,
    points: SpuriousPoints,
}

/// What one step adds to the log, for its metrics line.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepSilenced {
    /// The step's silenced tokens as text, most frequent first.
    pub tokens: Vec<(String, usize)>,
    /// Up to [`STEP_EXAMPLES`] of them in their response (`…12+7=1⟦9⟧\n\boxed…`).
    pub examples: Vec<String>,
}

impl SpuriousLog {
    /// The log as a checkpoint left it.
    pub fn restore(totals: &[(String, usize)], contexts: SilencedContexts) -> Self {
        Self { totals: totals.iter().cloned().collect(), contexts, points: SpuriousPoints::default() }
    }

    /// Adds one update: `silenced` are its silenced token ids with counts, `record` is
    /// indexed like `samples`.
    pub fn add(
        &mut self,
        tok: &Tokenizer,
        silenced: &[(u32, usize)],
        samples: &[Sample],
        record: &UpdateRecord,
    ) -> StepSilenced {
        let tokens: Vec<(String, usize)> = silenced.iter().map(|&(id, c)| (tok.token_str(id), c)).collect();
        for (t, c) in &tokens {
            *self.totals.entry(t.clone()).or_default() += c;
        }
        let mut examples = Vec::new();
        for (s, sil) in samples.iter().zip(&record.silenced) {
            for (j, _) in sil.iter().enumerate().filter(|(_, &x)| x) {
                let ctx = token_context(tok, &s.response_ids, j);
                if examples.len() < STEP_EXAMPLES {
                    examples.push(ctx.clone());
                }
                self.contexts.add(&tok.token_str(s.response_ids[j]), ctx);
            }
        }
        self.points.add(record);
        StepSilenced { tokens, examples }
    }

    /// Silenced tokens over the whole run, most frequent first.
    pub fn totals(&self) -> Vec<(String, usize)> {
        let mut v: Vec<(String, usize)> = self.totals.iter().map(|(k, c)| (k.clone(), *c)).collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        v
    }

    /// Up to [`CONTEXTS_PER_TOKEN`] readable contexts of a silenced token string.
    pub fn contexts(&self, token: &str) -> &[String] {
        self.contexts.get(token)
    }

    /// Every context kept, for the checkpoint.
    pub fn all_contexts(&self) -> &SilencedContexts {
        &self.contexts
    }

    /// The token points `spurious.png` draws.
    pub fn points(&self) -> &SpuriousPoints {
        &self.points
    }

    /// `silenced_tokens.tsv`: token (quoted), count, contexts; most frequent first.
    pub fn tsv(&self) -> String {
        self.totals()
            .iter()
            .map(|(t, c)| format!("{t:?}\t{c}\t{}\n", self.contexts(t).join("  |  ")))
            .collect()
    }
}

/// One row of `silenced_tokens.tsv`, read back: the token as the file writes it (quoted,
/// escapes kept: `"\\n"`), how often it was silenced, and the contexts kept for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SilencedRow {
    /// The token, quoted as in the file.
    pub token: String,
    /// Times silenced over the run.
    pub count: usize,
    /// Readable contexts (`…12+7=1⟦9⟧\n…`).
    pub contexts: Vec<String>,
}

/// Reads `silenced_tokens.tsv` as [`SpuriousLog::tsv`] writes it; a malformed line is an
/// error naming `path:LINE`.
pub fn read_silenced_tsv(path: &std::path::Path) -> crate::Result<Vec<SilencedRow>> {
    let text = std::fs::read_to_string(path).map_err(|e| crate::Error::io(path, e))?;
    let bad = |line: usize, msg: String| crate::Error::Parse { path: path.to_path_buf(), line, msg };
    let mut rows = Vec::new();
    for (i, l) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let mut f = l.splitn(3, '\t');
        let (token, count) = (f.next().unwrap_or_default(), f.next());
        if !(token.len() >= 2 && token.starts_with('"') && token.ends_with('"')) {
            return Err(bad(i + 1, format!("expected a quoted token first, found {token:?}")));
        }
        let count = count
            .and_then(|c| c.trim().parse::<usize>().ok())
            .ok_or_else(|| bad(i + 1, "expected a count after the token".into()))?;
        let contexts =
            f.next().map(|c| c.split("  |  ").filter(|c| !c.is_empty()).map(str::to_string).collect());
        rows.push(SilencedRow { token: token.to_string(), count, contexts: contexts.unwrap_or_default() });
    }
    Ok(rows)
}

/// One response token of a positive-advantage response.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TokenPoint {
    /// Probability of the sampled token and entropy (nats) at its position.
    pub p: f32,
    /// Full-vocabulary entropy (nats) at the token's position.
    pub h: f32,
    /// Logit-gradient norm `|A|·sqrt((1 - p_y)² + Σ_{j≠y} p_j²)`.
    pub grad: f32,
    /// True when the S2T mask silenced the token.
    pub silenced: bool,
}

/// The S2T region `p < tau_p, H < tau_h` to draw.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Region {
    /// The probability threshold.
    pub tau_p: f32,
    /// The entropy threshold.
    pub tau_h: f32,
}

/// The positive-advantage tokens of one update (first epoch, active sequences) with
/// their gradient norms, and its S2T region: tau_p and the mean tau_h of the
/// mini-batches that had candidates (`None` without S2T, or when no mini-batch had
/// candidates). Empty when the update recorded no gradient norms.
pub fn record_points(rec: &UpdateRecord) -> (Vec<TokenPoint>, Option<Region>) {
    let mut pts = Vec::new();
    for (i, &a) in rec.advantages.iter().enumerate() {
        if a <= 0.0 || !rec.active.get(i).copied().unwrap_or(false) {
            continue;
        }
        let (p, h, g) = (&rec.p[i], &rec.entropy[i], &rec.grad_norm[i]);
        if g.len() != p.len() || h.len() != p.len() {
            continue;
        }
        let sil = rec.silenced.get(i);
        for j in 0..p.len() {
            let silenced = sil.and_then(|s| s.get(j)).copied().unwrap_or(false);
            pts.push(TokenPoint { p: p[j], h: h[j], grad: g[j], silenced });
        }
    }
    (pts, region(rec))
}

/// The S2T region of an update (see [`record_points`]).
pub fn region(rec: &UpdateRecord) -> Option<Region> {
    let th = &rec.thresholds;
    let hs: Vec<f32> = th.iter().filter_map(|t| t.tau_h).collect();
    let tau_p = th.last()?.tau_p;
    (!hs.is_empty()).then(|| Region { tau_p, tau_h: hs.iter().sum::<f32>() / hs.len() as f32 })
}

/// Token points accumulated over a run, bounded: every token with p below the larger of
/// the run's tau_p and the paper's (the region the figure is about) up to
/// [`MAX_MARKED`], plus a uniform reservoir sample of the others, and the latest S2T
/// region seen.
#[derive(Debug, Clone)]
pub struct SpuriousPoints {
    marked: Vec<TokenPoint>,
    reservoir: Vec<TokenPoint>,
    /// Unmarked points offered to the reservoir so far.
    seen: u64,
    rng: u64,
    /// The latest S2T region seen (`None` without S2T).
    pub region: Option<Region>,
    /// Steps added.
    pub steps: usize,
}

impl Default for SpuriousPoints {
    fn default() -> Self {
        Self { marked: Vec::new(), reservoir: Vec::new(), seen: 0, rng: 0x5eed_5eed, region: None, steps: 0 }
    }
}

impl SpuriousPoints {
    /// Adds the positive-advantage tokens of one update.
    pub fn add(&mut self, rec: &UpdateRecord) {
        let (pts, region) = record_points(rec);
        if pts.is_empty() {
            return;
        }
        self.steps += 1;
        if region.is_some() {
            self.region = region;
        }
        let cut = self.region.map_or(PAPER_TAU_P, |r| r.tau_p.max(PAPER_TAU_P));
        for q in pts {
            if (q.silenced || q.p < cut) && self.marked.len() < MAX_MARKED {
                self.marked.push(q);
                continue;
            }
            // Reservoir sampling (Vitter's algorithm R) over the remaining points.
            self.seen += 1;
            if self.reservoir.len() < RESERVOIR {
                self.reservoir.push(q);
            } else {
                self.rng = crate::seed::splitmix64(self.rng);
                let j = self.rng % self.seen;
                if (j as usize) < RESERVOIR {
                    self.reservoir[j as usize] = q;
                }
            }
        }
    }

    /// Every kept point (marked first).
    pub fn points(&self) -> Vec<TokenPoint> {
        self.marked.iter().chain(&self.reservoir).copied().collect()
    }

    /// True when no point was added.
    pub fn is_empty(&self) -> bool {
        self.marked.is_empty() && self.reservoir.is_empty()
    }
}

/// A silenced token in its response: `…left⟦token⟧right…` with [`CONTEXT_TOKENS`] tokens
/// either side, decoded, on one line (newlines as `\n`).
pub fn token_context(tok: &Tokenizer, ids: &[u32], pos: usize) -> String {
    let pos = pos.min(ids.len().saturating_sub(1));
    let lo = pos.saturating_sub(CONTEXT_TOKENS);
    let hi = (pos + 1 + CONTEXT_TOKENS).min(ids.len());
    let text = |s: &[u32]| one_line(&tok.decode(s, false).unwrap_or_default());
    let token = ids.get(pos).map_or(String::new(), |&id| one_line(&tok.token_str(id)));
    format!(
        "{}{}⟦{token}⟧{}{}",
        if lo > 0 { "…" } else { "" },
        text(&ids[lo..pos]),
        text(&ids[(pos + 1).min(hi)..hi]),
        if hi < ids.len() { "…" } else { "" }
    )
}

fn one_line(s: &str) -> String {
    s.replace('\n', "\\n").replace('\t', "\\t").replace('\r', "\\r")
}

/// Contexts of silenced tokens over a run, by token string (bounded, see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SilencedContexts(pub HashMap<String, Vec<String>>);

impl SilencedContexts {
    /// Records `context` for `token` if there is room; returns whether it was kept.
    pub fn add(&mut self, token: &str, context: String) -> bool {
        let full = self.0.len() >= MAX_CONTEXT_TOKENS;
        match self.0.get_mut(token) {
            Some(v) if v.len() < CONTEXTS_PER_TOKEN && !v.contains(&context) => {
                v.push(context);
                true
            }
            None if !full => {
                self.0.insert(token.to_string(), vec![context]);
                true
            }
            _ => false,
        }
    }

    /// The contexts kept for `token` (empty when it was never silenced).
    pub fn get(&self, token: &str) -> &[String] {
        self.0.get(token).map_or(&[], |v| v.as_slice())
    }
}

#[cfg(test)]
mod tests {
    /// The file as `tsv()` writes it (a token needing escapes, one without contexts) reads back
    /// row by row; a line without a count names its line.
    #[test]
    fn silenced_tokens_tsv_reads_back() {
        let mut log = super::SpuriousLog::default();
        log.totals.insert("\n".into(), 3);
        log.totals.insert("7".into(), 5);
        log.contexts.add("7", "…12+⟦7⟧=19\\n…".into());
        log.contexts.add("7", "3*⟦7⟧=21".into());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("silenced_tokens.tsv");
        std::fs::write(&path, log.tsv()).unwrap();
        let rows = super::read_silenced_tsv(&path).unwrap();
        let want = [
            super::SilencedRow {
                token: "\"7\"".into(),
                count: 5,
                contexts: vec!["…12+⟦7⟧=19\\n…".into(), "3*⟦7⟧=21".into()],
            },
            super::SilencedRow { token: "\"\\n\"".into(), count: 3, contexts: vec![] },
        ];
        assert_eq!(rows, want);
        std::fs::write(&path, "\"7\"\t5\tctx\n\"8\"\n").unwrap();
        let err = super::read_silenced_tsv(&path).unwrap_err().to_string();
        assert!(err.contains("silenced_tokens.tsv") && err.contains('2'), "{err}");
    }

    use super::*;
    use crate::train::update::AppliedThresholds;

    fn record() -> UpdateRecord {
        // Two sequences: A = +1 (three tokens, one silenced) and A = -1.
        UpdateRecord {
            advantages: vec![1.0, -1.0],
            active: vec![true, true],
            p: vec![vec![0.9, 0.001, 0.5], vec![0.2]],
            entropy: vec![vec![0.1, 0.05, 1.0], vec![0.3]],
            grad_norm: vec![vec![0.1, 1.4, 0.6], vec![0.8]],
            silenced: vec![vec![false, true, false], vec![false]],
            thresholds: vec![
                AppliedThresholds {
                    epoch: 0,
                    mini_batch: 0,
                    tau_p: 0.002,
                    tau_h: Some(0.2),
                    population: None,
                    candidates: 1,
                    silenced: 1,
                },
                AppliedThresholds {
                    epoch: 0,
                    mini_batch: 1,
                    tau_p: 0.002,
                    tau_h: Some(0.4),
                    population: None,
                    candidates: 1,
                    silenced: 1,
                },
            ],
            ..Default::default()
        }
    }

    #[test]
    fn points_are_the_positive_advantage_tokens_with_the_mean_region() {
        let (pts, region) = record_points(&record());
        assert_eq!(pts.len(), 3);
        assert_eq!(pts[1], TokenPoint { p: 0.001, h: 0.05, grad: 1.4, silenced: true });
        let r = region.unwrap();
        assert_eq!(r.tau_p, 0.002);
        assert!((r.tau_h - 0.3).abs() < 1e-6);
    }

    #[test]
    fn accumulation_keeps_every_low_p_token_and_a_bounded_reservoir() {
        let mut acc = SpuriousPoints::default();
        let mut rec = record();
        // Many ordinary tokens in the positive response.
        let n = 3 * RESERVOIR;
        rec.p[0] = (0..n).map(|i| if i % 1000 == 0 { 1e-4 } else { 0.5 }).collect();
        rec.entropy[0] = vec![0.3; n];
        rec.grad_norm[0] = vec![0.5; n];
        rec.silenced[0] = vec![false; n];
        for _ in 0..3 {
            acc.add(&rec);
        }
        let pts = acc.points();
        let low = pts.iter().filter(|q| q.p < PAPER_TAU_P).count();
        assert_eq!(low, 3 * n.div_ceil(1000), "every low-p token is kept");
        assert_eq!(pts.len(), low + RESERVOIR);
        assert_eq!(acc.steps, 3);
        assert!(acc.region.is_some());
    }

    #[test]
    fn a_context_shows_the_token_between_its_neighbours() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tiny-qwen3/tokenizer.json");
        let tok = Tokenizer::from_file(path).unwrap();
        // Digits are one token each in the tiny tokenizer.
        let ids = tok.encode("17+25=42\n42-9=33\n\\boxed{33}", false).unwrap();
        let text = tok.decode(&ids, false).unwrap();
        let pos = ids.len() / 2;
        let c = token_context(&tok, &ids, pos);
        let (l, rest) = c.split_once('⟦').unwrap();
        let (mid, r) = rest.split_once('⟧').unwrap();
        assert!(l.starts_with('…') && r.ends_with('…'), "{c}");
        let joined = format!("{}{mid}{}", &l[3..], &r[..r.len() - 3]).replace("\\n", "\n");
        assert!(text.contains(&joined), "{c} not in {text:?}");
        assert_eq!(mid, tok.token_str(ids[pos]).replace('\n', "\\n"));
        // At the start: no leading ellipsis, and exactly CONTEXT_TOKENS tokens on the right.
        let c0 = token_context(&tok, &ids, 0);
        assert!(c0.starts_with('⟦'), "{c0}");
        assert_eq!(
            c0.split_once('⟧').unwrap().1,
            format!("{}…", tok.decode(&ids[1..1 + CONTEXT_TOKENS], false).unwrap())
        );
    }

    #[test]
    fn contexts_are_bounded_per_token_and_overall() {
        let mut c = SilencedContexts::default();
        for i in 0..5 {
            c.add("7", format!("ctx {i}"));
        }
        assert_eq!(c.get("7"), ["ctx 0", "ctx 1", "ctx 2"]);
        assert!(!c.add("7", "ctx 0".into()));
        for i in 0..MAX_CONTEXT_TOKENS + 10 {
            c.add(&format!("t{i}"), "x".into());
        }
        assert_eq!(c.0.len(), MAX_CONTEXT_TOKENS);
    }
}
