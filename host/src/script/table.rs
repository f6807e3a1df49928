//! Plain-text tables for the REPL and logs: the per-token table of a sampled
//! response (token, p, H, advantage, silenced?) that shows why STAPO's S2T
//! mask silenced a token, with each silenced token shown again in its context,
//! and one-line metric summaries.

use std::fmt::Write;

use crate::data::Tokenizer;
use crate::rollout::Sample;
use crate::train::spurious::token_context;

/// One row of a token table.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenRow {
    /// Position of the token in the response.
    pub pos: usize,
    /// The token's id.
    pub id: u32,
    /// The token as text.
    pub token: String,
    /// Probability of the sampled token under the untempered policy at sampling time.
    pub p: f32,
    /// Full-vocabulary entropy (nats) at this position.
    pub h: f32,
    /// The response's advantage, once computed.
    pub advantage: Option<f32>,
    /// Whether S2T silenced the token, once a mask was computed.
    pub silenced: Option<bool>,
    /// For a silenced token: the token between its neighbours (`…12+7=1⟦9⟧\n\boxed…`).
    pub context: Option<String>,
}

/// The rows of sample `s`.
pub fn token_rows(
    s: &Sample,
    tok: Option<&Tokenizer>,
    advantage: Option<f32>,
    silenced: Option<&[bool]>,
) -> Vec<TokenRow> {
    s.response_ids
        .iter()
        .enumerate()
        .map(|(t, &id)| TokenRow {
            pos: t,
            id,
            token: tok.map(|k| k.token_str(id)).unwrap_or_else(|| format!("<{id}>")),
            p: s.old_logprobs.get(t).map_or(f32::NAN, |l| l.exp()),
            h: s.entropies.get(t).copied().unwrap_or(f32::NAN),
            advantage,
            silenced: silenced.and_then(|v| v.get(t).copied()),
            context: match (silenced.and_then(|v| v.get(t).copied()), tok) {
                (Some(true), Some(k)) => Some(token_context(k, &s.response_ids, t)),
                _ => None,
            },
        })
        .collect()
}

/// A token as a table cell: escaped, at most 14 characters.
fn cell(token: &str) -> String {
    let esc: String = token.escape_debug().collect();
    if esc.chars().count() > 14 {
        format!("{}…", esc.chars().take(13).collect::<String>())
    } else {
        esc
    }
}

/// The table of one sample, with a header line.
pub fn format_sample(index: usize, s: &Sample, rows: &[TokenRow]) -> String {
    let mut out = String::new();
    let reward = s.reward.map_or("-".to_string(), |r| format!("{r}"));
    let adv = rows.first().and_then(|r| r.advantage).map_or("-".to_string(), |a| format!("{a:+.3}"));
    let _ = writeln!(
        out,
        "sample {index} (group {}, reward {reward}, A {adv}, {} tokens, {:?}{})",
        s.group,
        s.response_ids.len(),
        s.finish,
        if s.truncated { ", truncated" } else { "" }
    );
    let _ = writeln!(out, "  {:>4}  {:<16} {:>8} {:>7} {:>7}  S2T", "pos", "token", "p", "H", "A");
    for r in rows {
        let a = r.advantage.map_or("-".to_string(), |a| format!("{a:+.3}"));
        let s2t = match r.silenced {
            Some(true) => "SILENCED",
            Some(false) => "",
            None => "?",
        };
        let _ = writeln!(
            out,
            "  {:>4}  {:<16} {:>8.4} {:>7.3} {:>7}  {}",
            r.pos,
            format!("\"{}\"", cell(&r.token)),
            r.p,
            r.h,
            a,
            s2t
        );
    }
    // Silenced tokens once more in their context, so a person can read them.
    for r in rows.iter().filter(|r| r.context.is_some()) {
        let _ = writeln!(out, "  silenced at {:>4}: {}", r.pos, r.context.as_deref().unwrap_or_default());
    }
    out
}

/// `key=value` pairs of the usual step metrics, in a fixed order.
pub fn metrics_line(step: u64, pairs: &[(&str, f64)]) -> String {
    let mut s = format!("step {step:>5}");
    for (k, v) in pairs {
        let _ = write!(s, "  {k}={v:.4}");
    }
    s
}
