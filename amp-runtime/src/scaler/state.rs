//! The scale's state machine, separate from tensors so it can be tested exhaustively.

use amp_kernels::scale::ScaleTrack;

use super::config::{AtScaleFloor, ScalerConfig};

/// Everything that evolves as steps are taken. Saved and loaded with checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ScaleState {
    /// The current loss scale.
    pub scale: f32,
    /// Consecutive finite steps since the last growth or backoff.
    pub growth_tracker: u32,
    /// Overflows still tolerated before a backoff.
    pub hysteresis_left: u32,
    /// Steps taken (applied or skipped).
    pub steps: u64,
    /// Steps skipped.
    pub skipped: u64,
    /// Steps applied.
    pub applied: u64,
}

pub use amp_kernels::scale::ScaleChange;

impl ScaleState {
    /// The state before the first step.
    pub fn new(config: &ScalerConfig) -> Self {
        ScaleState {
            scale: config.init_scale.clamp(config.min_scale, config.max_scale),
            growth_tracker: 0,
            hysteresis_left: config.hysteresis,
            steps: 0,
            skipped: 0,
            applied: 0,
        }
    }

    /// Records one step: `overflow` when a non-finite value was found (the step was skipped).
    pub fn update(&mut self, overflow: bool, config: &ScalerConfig) -> ScaleChange {
        self.steps += 1;
        if overflow {
            self.skipped += 1;
        } else {
            self.applied += 1;
        }
        let track = ScaleTrack {
            scale: &mut self.scale,
            growth_tracker: &mut self.growth_tracker,
            hysteresis_left: &mut self.hysteresis_left,
        };
        track.step(overflow, &config.rule())
    }

    /// True when the floor policy says training must stop after this change.
    pub fn must_stop(change: ScaleChange, config: &ScalerConfig) -> bool {
        change == ScaleChange::AtFloor && config.at_floor == AtScaleFloor::Stop
    }
}
