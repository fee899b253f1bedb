//! Settings of the loss scaler.

/// What the scaler does when an overflow would take the scale below its floor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum AtScaleFloor {
    /// Return [`crate::Error::ScaleAtFloor`]: training is producing non-finite values that no scale
    /// can remove (a NaN loss, a diverged model), and continuing would skip every step.
    Stop,
    /// Keep the scale at the floor, keep skipping non-finite steps, and report it once per summary.
    Continue,
}

/// How the loss scale moves. Defaults are PyTorch's `GradScaler` with a floor of 1.0.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ScalerConfig {
    /// Scale of the first step (2^16).
    pub init_scale: f32,
    /// Factor applied after `growth_interval` consecutive finite steps (2.0).
    pub growth_factor: f32,
    /// Factor applied on overflow (0.5).
    pub backoff_factor: f32,
    /// Finite steps between growths (2000).
    pub growth_interval: u32,
    /// Smallest scale (1.0): below it fp16 gradients underflow more than scaling helps.
    pub min_scale: f32,
    /// Largest scale (2^24, Apex's cap); growth stops there.
    pub max_scale: f32,
    /// Overflows tolerated before backing off (DeepSpeed's hysteresis; 1 backs off on the first). The
    /// count of tolerated overflows refills when the scale grows.
    pub hysteresis: u32,
    /// What to do when an overflow happens at the floor.
    pub at_floor: AtScaleFloor,
    /// A `Static` scaler never changes its scale (Apex `loss_scale=128.0`); it still skips non-finite steps.
    pub dynamic: bool,
}

impl Default for ScalerConfig {
    fn default() -> Self {
        ScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            min_scale: 1.0,
            max_scale: 16_777_216.0,
            hysteresis: 1,
            at_floor: AtScaleFloor::Stop,
            dynamic: true,
        }
    }
}

impl ScalerConfig {
    /// A fixed scale: no growth, no backoff (the bounds widened to include it, so 0.5 stays 0.5).
    pub fn fixed(scale: f32) -> Self {
        let default = Self::default();
        ScalerConfig {
            init_scale: scale,
            dynamic: false,
            min_scale: default.min_scale.min(scale),
            max_scale: default.max_scale.max(scale),
            ..default
        }
    }

    /// The rule the scale follows (amp-kernels' form, shared with the device's state machine).
    pub fn rule(&self) -> amp_kernels::scale::ScaleRule {
        amp_kernels::scale::ScaleRule {
            dynamic: self.dynamic,
            growth_factor: self.growth_factor,
            backoff_factor: self.backoff_factor,
            growth_interval: self.growth_interval,
            hysteresis: self.hysteresis,
            min_scale: self.min_scale,
            max_scale: self.max_scale,
        }
    }

    /// Checks the settings, saying which is wrong.
    pub fn validate(&self) -> crate::Result<()> {
        let bad = |what: &str| Err(crate::Error::InvalidScalerConfig { reason: what.to_string() });
        if !(self.init_scale.is_finite() && self.init_scale > 0.0) {
            return bad("init_scale must be finite and positive");
        }
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            return bad("growth_factor must be finite and greater than 1");
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return bad("backoff_factor must be between 0 and 1 (exclusive)");
        }
        if self.growth_interval == 0 {
            return bad("growth_interval must be at least 1");
        }
        if !(self.min_scale > 0.0 && self.min_scale <= self.max_scale && self.max_scale.is_finite()) {
            return bad("need 0 < min_scale <= max_scale < inf");
        }
        if !(self.min_scale..=self.max_scale).contains(&self.init_scale) {
            return Err(crate::Error::InvalidScalerConfig {
                reason: format!(
                    "init_scale {} is outside [min_scale, max_scale] = [{}, {}], where the scale would be \
                     moved without a word: lower min_scale or raise max_scale to include it",
                    self.init_scale, self.min_scale, self.max_scale
                ),
            });
        }
        if self.hysteresis == 0 {
            return bad("hysteresis must be at least 1 (1 backs off on the first overflow)");
        }
        Ok(())
    }
}
