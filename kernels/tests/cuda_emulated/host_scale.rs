//! The host's loss-scale state machine, which `amp_scale_update` must follow bit for bit.

use amp_kernels::cuda::ScaleChange;

/// The dynamic scale's settings (`ScaleConfig` of the cuda feature, `ScalerConfig` of amp-runtime).
#[derive(Clone, Copy, Debug)]
pub struct ScaleConfig {
    pub dynamic: bool,
    pub growth_factor: f32,
    pub backoff_factor: f32,
    pub growth_interval: u32,
    pub hysteresis: u32,
    pub min_scale: f32,
    pub max_scale: f32,
}

/// amp-runtime's `ScaleState` (amp-runtime/src/scaler/state.rs), copied: amp-runtime is not a dependency
/// of amp-kernels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HostScale {
    pub scale: f32,
    pub growth_tracker: u32,
    pub hysteresis_left: u32,
    pub steps: u64,
    pub skipped: u64,
    pub applied: u64,
}

impl HostScale {
    pub fn new(scale: f32, config: &ScaleConfig) -> Self {
        HostScale {
            scale,
            growth_tracker: 0,
            hysteresis_left: config.hysteresis,
            steps: 0,
            skipped: 0,
            applied: 0,
        }
    }

    /// amp-runtime's `ScaleState::update`.
    pub fn update(&mut self, overflow: bool, config: &ScaleConfig) -> ScaleChange {
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
        if !grown.is_finite() || self.scale >= config.max_scale {
            return ScaleChange::Kept;
        }
        self.scale = grown.min(config.max_scale);
        self.hysteresis_left = config.hysteresis;
        ScaleChange::Grew
    }
}
