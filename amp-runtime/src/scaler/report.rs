//! What a scaler step did, and rate-limited logging of skips.

use std::fmt;

use super::state::ScaleChange;

/// Why a step was skipped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SkipReason {
    /// A gradient held inf or NaN: an fp16 range problem, cured by a smaller scale.
    GradientOverflow {
        /// Path of the first parameter (in model order) whose gradient was not finite.
        param: String,
    },
    /// The loss itself was inf or NaN before scaling: not a range problem of fp16 but of the model or
    /// the data (a diverged model, a log of 0, a bad batch). The scale still backs off.
    NonFiniteLoss,
    /// Data-parallel training: the loss was not finite on `rank`, the lowest such rank; every rank of the
    /// group skipped the step.
    NonFiniteLossOnRank {
        /// The lowest rank whose loss was not finite.
        rank: usize,
    },
    /// Data-parallel training: a gradient held inf or NaN; every rank of the group skipped the step.
    GroupGradientOverflow {
        /// The lowest rank whose own gradient (before the all-reduce) held inf/NaN; `None` when every
        /// rank's own gradients were finite and only their reduced sum was not: it overflowed on the
        /// wire (set a predivide factor, or reduce in fp32).
        rank: Option<usize>,
        /// The first parameter (in model order) with the non-finite gradient, as this rank saw it:
        /// known on `rank` itself (and on every rank for an overflow of the sum), `None` elsewhere.
        param: Option<String>,
    },
}

/// The result of one optimizer step through the scaler.
#[derive(Clone, Debug, PartialEq)]
pub struct StepReport {
    /// 1-based count of steps taken by this scaler.
    pub step: u64,
    /// `None` when the step was applied, else why it was skipped.
    pub skipped: Option<SkipReason>,
    /// The scale the gradients carried.
    pub scale_before: f32,
    /// The scale for the next step.
    pub scale_after: f32,
    /// How the scale moved.
    pub change: ScaleChange,
    /// True for skips before the first applied step: the dynamic scale starts high on purpose and
    /// settles by backing off, so these are expected.
    pub warmup: bool,
}

impl SkipReason {
    /// What a data-parallel skip reason says, in words (empty for the others).
    pub(crate) fn group_words(&self) -> String {
        match self {
            SkipReason::NonFiniteLossOnRank { rank } => format!("the loss is not finite on rank {rank}"),
            SkipReason::GroupGradientOverflow { rank, param } => {
                let first = param.as_ref().map(|p| format!(", first in `{p}`")).unwrap_or_default();
                match rank {
                    Some(rank) => format!("non-finite gradient on rank {rank}{first}"),
                    None => format!(
                        "the all-reduced gradient is not finite though every rank's own was{first}: the \
                         sum overflowed on the wire (set a predivide factor or reduce in fp32)"
                    ),
                }
            }
            SkipReason::GradientOverflow { .. } | SkipReason::NonFiniteLoss => String::new(),
        }
    }
}

impl StepReport {
    /// True when the optimizer updated the weights. A learning-rate schedule should advance only then.
    pub fn applied(&self) -> bool {
        self.skipped.is_none()
    }
}

impl fmt::Display for StepReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.skipped {
            None => write!(f, "step {} applied", self.step)?,
            Some(SkipReason::GradientOverflow { param }) => {
                write!(f, "step {} skipped: non-finite gradient, first in `{param}`", self.step)?
            }
            Some(SkipReason::NonFiniteLoss) => {
                write!(f, "step {} skipped: the loss is not finite", self.step)?
            }
            Some(reason) => write!(f, "step {} skipped on every rank: {}", self.step, reason.group_words())?,
        }
        if self.warmup {
            write!(f, " (warm-up, expected)")?;
        }
        write!(f, "; scale {} -> {}", self.scale_before, self.scale_after)
    }
}

/// Counts skips and logs a summary at most once per `every` steps, never once per skip.
#[derive(Clone, Debug)]
pub(crate) struct SkipLog {
    every: u64,
    window_start: u64,
    skips: u64,
    warmup_skips: u64,
    last: Option<SkipReason>,
}

impl SkipLog {
    pub(crate) fn new(every: u64) -> Self {
        SkipLog { every: every.max(1), window_start: 0, skips: 0, warmup_skips: 0, last: None }
    }

    pub(crate) fn record(&mut self, report: &StepReport) {
        match (&report.skipped, report.warmup) {
            (Some(_), true) => {
                self.warmup_skips += 1;
                tracing::debug!("{report}");
            }
            (Some(reason), false) => {
                self.skips += 1;
                self.last = Some(reason.clone());
            }
            (None, _) if self.warmup_skips > 0 => {
                tracing::info!(
                    "loss scale settled at {} after {} warm-up skips (expected)",
                    report.scale_after,
                    self.warmup_skips
                );
                self.warmup_skips = 0;
            }
            (None, _) => {}
        }
        if report.change == ScaleChange::AtFloor {
            tracing::warn!("{report}: the scale is at its floor and cannot remove this non-finite value");
        }
        self.summarise(report.step, report.scale_after);
    }

    /// Starts a new window at `step` (a restored state's count, which may be behind the window's start).
    pub(crate) fn restart(&mut self, step: u64) {
        self.window_start = step;
        self.skips = 0;
        self.last = None;
    }

    /// Counts the skips of deferred steps, read at once (`step` is the scaler's count after them).
    #[cfg(feature = "cuda")]
    pub(crate) fn record_settled(&mut self, settled: &super::Settled, step: u64) {
        if settled.skipped > 0 {
            self.skips += settled.skipped;
            self.last.clone_from(&settled.last_skip);
        }
        self.summarise(step, settled.scale_after);
    }

    /// Logs the window's skips when it is `every` steps long.
    fn summarise(&mut self, step: u64, scale: f32) {
        if step - self.window_start >= self.every {
            if self.skips > 0 {
                let last = match &self.last {
                    Some(SkipReason::GradientOverflow { param }) => format!("last in `{param}`"),
                    Some(SkipReason::NonFiniteLoss) => "last from a non-finite loss".to_string(),
                    Some(reason) => format!("last: {}", reason.group_words()),
                    None => String::new(),
                };
                tracing::warn!(
                    "{} of the last {} steps skipped for non-finite values ({last}); loss scale now {scale}",
                    self.skips,
                    step - self.window_start,
                );
            }
            self.window_start = step;
            self.skips = 0;
        }
    }
}
