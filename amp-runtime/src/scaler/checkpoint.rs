//! The scaler's state in checkpoints: settings and scale state as JSON, no tensors.

use super::{GradScaler, ScaleState, ScalerConfig};
use crate::checkpoint::{SavedState, TrainingState};
use crate::error::{Error, Result};

#[derive(serde::Serialize, serde::Deserialize)]
struct Saved {
    config: ScalerConfig,
    state: ScaleState,
    enabled: bool,
}

fn parse(key: &str, state: &SavedState) -> Result<Saved> {
    let saved: Saved = serde_json::from_str(&state.json)
        .map_err(|source| Error::SavedStateUnreadable { key: key.to_string(), source })?;
    saved.config.validate()?;
    check_state(&saved.state, &saved.config)
        .map_err(|what| Error::InvalidScalerConfig { reason: format!("saved scaler state: {what}") })?;
    Ok(saved)
}

/// The invariants the scaler keeps: a state that breaks one was not written by it.
pub(super) fn check_state(state: &ScaleState, config: &ScalerConfig) -> std::result::Result<(), String> {
    let scale = state.scale;
    if !(scale.is_finite() && scale >= config.min_scale && scale <= config.max_scale) {
        return Err(format!(
            "scale {scale} is outside [min_scale, max_scale] = [{}, {}]",
            config.min_scale, config.max_scale
        ));
    }
    if state.growth_tracker >= config.growth_interval {
        return Err(format!(
            "growth_tracker {} is not below growth_interval {}",
            state.growth_tracker, config.growth_interval
        ));
    }
    if state.hysteresis_left > config.hysteresis {
        return Err(format!(
            "hysteresis_left {} is above hysteresis {}",
            state.hysteresis_left, config.hysteresis
        ));
    }
    if state.skipped.checked_add(state.applied) != Some(state.steps) || state.steps == u64::MAX {
        return Err(format!(
            "steps {} is not skipped {} + applied {}",
            state.steps, state.skipped, state.applied
        ));
    }
    Ok(())
}

impl TrainingState for GradScaler {
    fn state_key(&self) -> String {
        self.key.clone()
    }

    fn save_state(&self) -> Result<SavedState> {
        let saved = Saved { config: self.config, state: self.current_state()?, enabled: self.enabled };
        let json = serde_json::to_string(&saved).map_err(|e| Error::Internal { what: e.to_string() })?;
        Ok(SavedState { json, tensors: Vec::new() })
    }

    fn check_state(&self, state: &SavedState) -> Result<()> {
        parse(&self.key, state).map(|_| ())
    }

    fn restore_state(&mut self, state: SavedState) -> Result<()> {
        let saved = parse(&self.key, &state)?;
        self.config = saved.config;
        self.state = saved.state;
        self.enabled = saved.enabled;
        self.finite_guard |= saved.enabled;
        self.forget_deferred();
        Ok(())
    }
}
