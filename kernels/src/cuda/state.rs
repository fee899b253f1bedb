//! The loss scale's state as the device keeps it (`amp_scale_state` in `scale.cu`): 14 32-bit words, so
//! kernels can be handed pointers to single fields (the inverse scale, the overflow flag).

use super::NO_BAD_TENSOR;
pub use crate::scale::ScaleChange;
use crate::scale::{ScaleRule, ScaleTrack};

/// Size of the device state in 32-bit words.
pub const STATE_WORDS: usize = 14;

/// The device-resident scaler state, decoded on the host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScaleState {
    /// The loss scale.
    pub scale: f32,
    /// `1 / scale`, what the unscale kernels multiply by.
    pub inv_scale: f32,
    /// Consecutive finite steps since the last growth or backoff.
    pub growth_tracker: u32,
    /// Overflows still tolerated before a backoff.
    pub hysteresis_left: u32,
    /// Steps recorded.
    pub steps: u64,
    /// Steps skipped.
    pub skipped: u64,
    /// Steps applied.
    pub applied: u64,
    /// Set by the kernels of the step in flight: the first tensor with a non-finite value.
    pub bad_tensor: Option<u32>,
    /// `bad_tensor` of the most recent skipped step (kept through applied steps, for a lazy report).
    pub last_bad_tensor: Option<u32>,
    /// What the last update did.
    pub last_change: ScaleChange,
    /// Overflows met at the minimum scale so far ([`ScaleChange::AtFloor`] updates).
    pub floor_hits: u32,
}

impl ScaleState {
    /// Word index of `scale`.
    pub const SCALE_WORD: usize = 0;
    /// Word index of `inv_scale`.
    pub const INV_SCALE_WORD: usize = 1;
    /// Word index of `bad_tensor`.
    pub const BAD_TENSOR_WORD: usize = 10;

    /// The state before the first step.
    #[must_use]
    pub fn new(scale: f32, hysteresis: u32) -> Self {
        ScaleState {
            scale,
            inv_scale: 1.0 / scale,
            growth_tracker: 0,
            hysteresis_left: hysteresis,
            steps: 0,
            skipped: 0,
            applied: 0,
            bad_tensor: None,
            last_bad_tensor: None,
            last_change: ScaleChange::Kept,
            floor_hits: 0,
        }
    }

    /// What `amp_scale_update` does to this state, done on the host: records the step in flight
    /// (skipped when `bad_tensor` is set, whose reason is then kept), moves the scale by `rule`, counts a
    /// floor hit, and clears the flag. The device's state machine is checked against this.
    pub fn record_step(&mut self, rule: &ScaleRule) -> ScaleChange {
        let overflow = self.bad_tensor.is_some();
        self.steps += 1;
        if overflow {
            self.skipped += 1;
            self.last_bad_tensor = self.bad_tensor;
        } else {
            self.applied += 1;
        }
        let track = ScaleTrack {
            scale: &mut self.scale,
            growth_tracker: &mut self.growth_tracker,
            hysteresis_left: &mut self.hysteresis_left,
        };
        self.last_change = track.step(overflow, rule);
        self.floor_hits += u32::from(self.last_change == ScaleChange::AtFloor);
        self.inv_scale = 1.0 / self.scale;
        self.bad_tensor = None;
        self.last_change
    }

    /// The words to upload.
    #[must_use]
    pub fn to_words(&self) -> [u32; STATE_WORDS] {
        let split = |x: u64| [x as u32, (x >> 32) as u32];
        let flag = |x: Option<u32>| x.map_or(NO_BAD_TENSOR as u32, |t| t);
        let [steps_lo, steps_hi] = split(self.steps);
        let [skipped_lo, skipped_hi] = split(self.skipped);
        let [applied_lo, applied_hi] = split(self.applied);
        [
            self.scale.to_bits(),
            self.inv_scale.to_bits(),
            self.growth_tracker,
            self.hysteresis_left,
            steps_lo,
            steps_hi,
            skipped_lo,
            skipped_hi,
            applied_lo,
            applied_hi,
            flag(self.bad_tensor),
            flag(self.last_bad_tensor),
            self.last_change as u32,
            self.floor_hits,
        ]
    }

    /// Decodes words read back from the device; `None` for a change code the device cannot write.
    #[must_use]
    pub fn from_words(w: &[u32; STATE_WORDS]) -> Option<Self> {
        let join = |lo: u32, hi: u32| u64::from(lo) | (u64::from(hi) << 32);
        let flag = |x: u32| (x != NO_BAD_TENSOR as u32).then_some(x);
        let last_change = match w[12] {
            0 => ScaleChange::Kept,
            1 => ScaleChange::Grew,
            2 => ScaleChange::BackedOff,
            3 => ScaleChange::Tolerated,
            4 => ScaleChange::AtFloor,
            _ => return None,
        };
        Some(ScaleState {
            scale: f32::from_bits(w[0]),
            inv_scale: f32::from_bits(w[1]),
            growth_tracker: w[2],
            hysteresis_left: w[3],
            steps: join(w[4], w[5]),
            skipped: join(w[6], w[7]),
            applied: join(w[8], w[9]),
            bad_tensor: flag(w[10]),
            last_bad_tensor: flag(w[11]),
            last_change,
            floor_hits: w[13],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip() {
        let mut state = ScaleState::new(65536.0, 2);
        state.steps = (1 << 40) + 3;
        state.skipped = 7;
        state.applied = (1 << 40) - 4;
        state.bad_tensor = Some(5);
        state.last_change = ScaleChange::Tolerated;
        state.floor_hits = 3;
        assert_eq!(ScaleState::from_words(&state.to_words()), Some(state));
        assert_eq!(state.to_words()[ScaleState::INV_SCALE_WORD], (1.0f32 / 65536.0).to_bits());
        assert_eq!(state.to_words()[ScaleState::BAD_TENSOR_WORD], 5);
        assert_eq!(ScaleState::new(1.0, 1).to_words()[ScaleState::BAD_TENSOR_WORD], i32::MAX as u32);
    }

    #[test]
    fn the_word_layout_is_the_device_struct() {
        // Field order of `amp_scale_state` in scale.cu, with its 64-bit counters at words 4, 6, 8.
        let source = include_str!("source/scale.cu");
        let fields = [
            "float scale;",
            "float inv_scale;",
            "unsigned int growth_tracker;",
            "unsigned int hysteresis_left;",
            "unsigned long long steps;",
            "unsigned long long skipped;",
            "unsigned long long applied;",
            "int bad_tensor;",
            "int last_bad_tensor;",
            "int last_change;",
            "unsigned int floor_hits;",
        ];
        let positions: Vec<usize> = fields.iter().map(|f| source.find(f).unwrap_or(usize::MAX)).collect();
        assert!(positions.windows(2).all(|w| w[0] < w[1] && w[1] != usize::MAX), "{positions:?}");
        let words: usize = fields.iter().map(|f| if f.contains("long long") { 2 } else { 1 }).sum();
        assert_eq!(words, STATE_WORDS);
    }
}
