//! What deferred steps did, read when the host asks ([`GradScaler::settle`](super::GradScaler::settle)).

use std::fmt;

use super::report::{SkipReason, StepReport};

/// The steps queued with [`GradScaler::step_fused_deferred`](super::GradScaler::step_fused_deferred)
/// since the previous settle, summed up: the device keeps counts and the most recent skip, not a
/// report per step.
#[derive(Clone, Debug, PartialEq)]
pub struct Settled {
    /// Steps settled.
    pub steps: u64,
    /// Of which applied.
    pub applied: u64,
    /// Of which skipped.
    pub skipped: u64,
    /// Why the most recent of the skipped steps was skipped.
    pub last_skip: Option<SkipReason>,
    /// The scale the first of them carried.
    pub scale_before: f32,
    /// The scale for the next step.
    pub scale_after: f32,
}

impl Settled {
    /// No steps, at `scale`.
    pub(crate) fn none(scale: f32) -> Self {
        Settled { steps: 0, applied: 0, skipped: 0, last_skip: None, scale_before: scale, scale_after: scale }
    }

    /// Adds one step taken on the host.
    pub(crate) fn add_report(&mut self, report: &StepReport) {
        self.add(Settled {
            steps: 1,
            applied: u64::from(report.applied()),
            skipped: u64::from(!report.applied()),
            last_skip: report.skipped.clone(),
            scale_before: report.scale_before,
            scale_after: report.scale_after,
        });
    }

    /// Adds the steps of `later`, which came after these.
    pub(crate) fn add(&mut self, later: Settled) {
        if self.steps == 0 {
            self.scale_before = later.scale_before;
        }
        self.steps += later.steps;
        self.applied += later.applied;
        self.skipped += later.skipped;
        if later.last_skip.is_some() {
            self.last_skip = later.last_skip;
        }
        self.scale_after = later.scale_after;
    }
}

impl fmt::Display for Settled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} step(s): {} applied, {} skipped", self.steps, self.applied, self.skipped)?;
        match &self.last_skip {
            Some(SkipReason::GradientOverflow { param }) => {
                write!(f, " (last: non-finite gradient in `{param}`)")?
            }
            Some(SkipReason::NonFiniteLoss) => write!(f, " (last: the loss was not finite)")?,
            Some(reason) => write!(f, " (last: {})", reason.group_words())?,
            None => {}
        }
        write!(f, "; scale {} -> {}", self.scale_before, self.scale_after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scaler::ScaleChange;

    fn report(step: u64, skipped: Option<SkipReason>, before: f32, after: f32) -> StepReport {
        StepReport {
            step,
            skipped,
            scale_before: before,
            scale_after: after,
            change: ScaleChange::Kept,
            warmup: false,
        }
    }

    #[test]
    fn steps_add_up_and_the_most_recent_skip_is_kept() {
        let mut window = Settled::none(8.0);
        assert_eq!(window.to_string(), "0 step(s): 0 applied, 0 skipped; scale 8 -> 8");
        let overflow = SkipReason::GradientOverflow { param: "fc.weight".into() };
        window.add_report(&report(1, Some(SkipReason::NonFiniteLoss), 16.0, 8.0));
        window.add_report(&report(2, Some(overflow.clone()), 8.0, 4.0));
        window.add_report(&report(3, None, 4.0, 4.0));
        assert_eq!((window.steps, window.applied, window.skipped), (3, 1, 2));
        assert_eq!(window.last_skip, Some(overflow));
        assert_eq!((window.scale_before, window.scale_after), (16.0, 4.0));
        assert_eq!(
            window.to_string(),
            "3 step(s): 1 applied, 2 skipped (last: non-finite gradient in `fc.weight`); scale 16 -> 4"
        );
    }
}
