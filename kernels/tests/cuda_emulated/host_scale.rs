//! The host's loss-scale bookkeeping around amp-kernels' state machine (what amp-runtime's `ScaleState`
//! does), which `amp_scale_update` must follow bit for bit.

use amp_kernels::scale::{ScaleChange, ScaleRule, ScaleTrack};

/// amp-runtime's `ScaleState`: the scale, its trackers and the step counts.
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
    pub fn new(scale: f32, rule: &ScaleRule) -> Self {
        HostScale {
            scale,
            growth_tracker: 0,
            hysteresis_left: rule.hysteresis,
            steps: 0,
            skipped: 0,
            applied: 0,
        }
    }

    /// amp-runtime's `ScaleState::update`: counts the step, then the state machine.
    pub fn update(&mut self, overflow: bool, rule: &ScaleRule) -> ScaleChange {
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
        track.step(overflow, rule)
    }
}
