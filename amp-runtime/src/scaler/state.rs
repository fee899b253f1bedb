//! The scale's state machine, separate from tensors so it can be tested exhaustively.

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

/// How one update moved the scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleChange {
    /// Unchanged.
    Kept,
    /// Multiplied by the growth factor.
    Grew,
    /// Multiplied by the backoff factor.
    BackedOff,
    /// An overflow absorbed by hysteresis.
    Tolerated,
    /// An overflow at the floor (the scale cannot go lower).
    AtFloor,
}

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
        if !config.dynamic {
            return ScaleChange::Kept;
        }
        if overflow {
            self.growth_tracker = 0;
            if self.hysteresis_left > 1 {
                self.hysteresis_left -= 1;
                return ScaleChange::Tolerated;
            }
            if self.scale <= config.min_scale {
                return ScaleChange::AtFloor;
            }
            self.scale = (self.scale * config.backoff_factor).max(config.min_scale);
            return ScaleChange::BackedOff;
        }
        self.growth_tracker += 1;
        if self.growth_tracker < config.growth_interval {
            return ScaleChange::Kept;
        }
        self.growth_tracker = 0;
        let grown = self.scale * config.growth_factor;
        // PyTorch skips growth that would not be finite in f32; we also stop at max_scale.
        if !grown.is_finite() || self.scale >= config.max_scale {
            return ScaleChange::Kept;
        }
        self.scale = grown.min(config.max_scale);
        self.hysteresis_left = config.hysteresis;
        ScaleChange::Grew
    }

    /// True when the floor policy says training must stop after this change.
    pub fn must_stop(change: ScaleChange, config: &ScalerConfig) -> bool {
        change == ScaleChange::AtFloor && config.at_floor == AtScaleFloor::Stop
    }
}
