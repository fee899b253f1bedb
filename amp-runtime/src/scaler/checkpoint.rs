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
    if !(saved.state.scale.is_finite() && saved.state.scale > 0.0) {
        return Err(Error::InvalidScalerConfig {
            reason: format!("saved scale {} is not usable", saved.state.scale),
        });
    }
    Ok(saved)
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
