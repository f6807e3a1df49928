//! Step 6 of the update: the optimizer step of a mini-batch, skipped (with a warning and
//! the reason in the metrics) when its loss, its gradient norm or the weights it would
//! write are not finite; the weights and moments are then left exactly as they were.

use candle_core::backprop::GradStore;

use super::metrics::{Totals, UpdateMetrics};
use super::phases::Phase;
use crate::dist::Comm;
use crate::train::optim::Optimizer;
use crate::Result;

/// The optimizer step of one mini-batch (skipped, with a warning, when its loss was not
/// finite or AdamW finds a non-finite gradient norm); the optimizer sums the gradients
/// over `comm`'s ranks. Records the optimizer's state bytes on this rank.
pub(super) fn optimizer_step(
    comm: &dyn Comm,
    opt: &mut dyn Optimizer,
    acc: &mut GradStore,
    lr: f64,
    loss: Option<f64>,
    metrics: &mut UpdateMetrics,
    totals: &mut Totals,
) -> Result<()> {
    let Some(loss) = loss else {
        metrics.warnings.push("non-finite loss; optimizer step skipped, weights unchanged".into());
        metrics.skip_reasons.push("loss is not finite".into());
        metrics.skipped_steps += 1;
        return Ok(());
    };
    let report = Phase::Optimizer.time(|| opt.step_on(comm, acc, lr))?;
    metrics.optimizer_bytes = opt.state_bytes() as u64;
    if report.skipped {
        let reason = match &report.nonfinite_param {
            Some(name) => format!("updated weights of `{name}` would not be finite (learning rate {lr:e})"),
            None => format!("gradient norm is {}", report.grad_norm),
        };
        metrics.warnings.push(format!("{reason}; optimizer step skipped (weights and moments unchanged)"));
        metrics.skip_reasons.push(reason);
        metrics.skipped_steps += 1;
    } else {
        metrics.optimizer_steps += 1;
        totals.loss_sum += loss;
        totals.grad_norm_sum += report.grad_norm;
    }
    Ok(())
}
