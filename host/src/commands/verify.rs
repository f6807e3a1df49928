//! `stapo verify`: check answers against references with the math checker.

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use stapo::reward::{self, ExtractMode};

#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// Reference answer (with --pred).
    #[arg(long, requires = "pred", conflicts_with = "input")]
    pub gold: Option<String>,
    /// A model response or bare answer (with --gold).
    #[arg(long, requires = "gold")]
    pub pred: Option<String>,
    /// JSONL file with fields `gold` and `pred`; writes one JSON line per input.
    #[arg(long, required_unless_present = "gold")]
    pub input: Option<PathBuf>,
    /// Answer extraction: strict (last \boxed{} only, the paper's setting), flexible, or answer_line
    /// (the last "Answer:" line, as verl's math_dapo reward reads DAPO-Math responses).
    #[arg(long, default_value = "strict")]
    pub mode: ExtractMode,
}

pub fn run(a: VerifyArgs) -> anyhow::Result<()> {
    match (&a.gold, &a.pred, &a.input) {
        (Some(gold), Some(pred), _) => {
            let v = reward::verify(gold, pred, a.mode);
            // A bare answer without \boxed{} is compared as it stands.
            let v = if v.extracted.is_none() {
                reward::Verdict { correct: reward::is_equivalent(gold, pred), extracted: Some(pred.clone()) }
            } else {
                v
            };
            println!(
                "{}",
                serde_json::json!({"gold": gold, "pred": pred, "extracted": v.extracted, "correct": v.correct})
            );
            Ok(())
        }
        (_, _, Some(input)) => {
            let stdout = std::io::stdout();
            let mut out = stdout.lock();
            let (ok, n) = reward::verify_jsonl(input, a.mode, &mut out)?;
            out.flush()?;
            eprintln!("{ok}/{n} correct ({:.1}%)", 100.0 * ok as f64 / n.max(1) as f64);
            Ok(())
        }
        _ => anyhow::bail!("give --gold and --pred, or --input pairs.jsonl"),
    }
}
