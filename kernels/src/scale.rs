//! The dynamic loss scale's state machine: PyTorch's `_amp_update_scale_` with DeepSpeed's hysteresis,
//! a floor and a ceiling. Pure logic, written once: amp-runtime's scaler runs it on the host, and
//! `amp_scale_update` (`cuda/source/scale.cu`) mirrors it on the device, checked against this function.

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

/// The settings the scale follows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScaleRule {
    /// `false`: a static scale (nothing moves).
    pub dynamic: bool,
    /// Multiplier after `growth_interval` finite steps.
    pub growth_factor: f32,
    /// Multiplier on an overflow that hysteresis does not absorb.
    pub backoff_factor: f32,
    /// Finite steps between growths.
    pub growth_interval: u32,
    /// Overflows tolerated before a backoff (1: back off at once).
    pub hysteresis: u32,
    /// The floor.
    pub min_scale: f32,
    /// The ceiling.
    pub max_scale: f32,
}

/// What the rule moves: the scale and its two trackers.
#[derive(Debug)]
pub struct ScaleTrack<'a> {
    /// The loss scale.
    pub scale: &'a mut f32,
    /// Consecutive finite steps since the last growth or backoff.
    pub growth_tracker: &'a mut u32,
    /// Overflows still tolerated before a backoff.
    pub hysteresis_left: &'a mut u32,
}

impl ScaleTrack<'_> {
    /// Moves the scale after a step that overflowed (`overflow`) or did not.
    pub fn step(self, overflow: bool, rule: &ScaleRule) -> ScaleChange {
        if !rule.dynamic {
            return ScaleChange::Kept;
        }
        if overflow {
            *self.growth_tracker = 0;
            if *self.hysteresis_left > 1 {
                *self.hysteresis_left -= 1;
                return ScaleChange::Tolerated;
            }
            if *self.scale <= rule.min_scale {
                return ScaleChange::AtFloor;
            }
            *self.scale = (*self.scale * rule.backoff_factor).max(rule.min_scale);
            return ScaleChange::BackedOff;
        }
        *self.growth_tracker += 1;
        if *self.growth_tracker < rule.growth_interval {
            return ScaleChange::Kept;
        }
        *self.growth_tracker = 0;
        let grown = *self.scale * rule.growth_factor;
        // PyTorch skips growth that would not be finite in f32; the ceiling stops it too.
        if !grown.is_finite() || *self.scale >= rule.max_scale {
            return ScaleChange::Kept;
        }
        *self.scale = grown.min(rule.max_scale);
        *self.hysteresis_left = rule.hysteresis;
        ScaleChange::Grew
    }
}
