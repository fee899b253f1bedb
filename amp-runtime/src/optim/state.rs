//! Optimizer state (fp32 vectors per parameter) in checkpoints.

use std::collections::{BTreeMap, HashMap};

use candle_core::{Device, Tensor};

use super::core::Core;
use super::params::{GroupOptions, OptimParam};
use crate::checkpoint::{SavedState, TrainingState};
use crate::error::{Error, Result};

/// One named fp32 buffer per parameter (`exp_avg`, `momentum_buffer`, ...). Empty vectors are buffers
/// not in use (amsgrad off, no momentum) and are not saved.
pub(crate) struct Buffers {
    pub name: &'static str,
    pub values: Vec<Vec<f32>>,
    /// False for a kind the settings do not use (its vectors are empty; the kernels get null pointers).
    pub used: bool,
}

impl std::fmt::Debug for Buffers {
    /// The name and size, not millions of values.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buffers({}: {} bytes)", self.name, self.bytes())
    }
}

impl Buffers {
    pub(crate) fn zeros(name: &'static str, params: &[OptimParam], used: bool) -> Self {
        let values =
            params.iter().map(|p| if used { vec![0.0; p.elem_count()] } else { Vec::new() }).collect();
        Buffers { name, values, used }
    }

    pub(crate) fn bytes(&self) -> usize {
        self.values.iter().map(|v| 4 * v.len()).sum()
    }
}

/// The saved form: JSON of `settings`, one tensor per used buffer and parameter (`{path}/{name}`).
pub(crate) fn save<S: serde::Serialize>(
    settings: &S,
    params: &[OptimParam],
    buffers: &[Buffers],
) -> Result<SavedState> {
    let json = serde_json::to_string(settings).map_err(|e| Error::Internal { what: e.to_string() })?;
    let mut tensors = Vec::new();
    for buffer in buffers.iter().filter(|b| b.used) {
        for (param, values) in params.iter().zip(&buffer.values) {
            if !values.is_empty() {
                // In the parameter's shape, so that a load can tell parameters of one size apart.
                let tensor = Tensor::from_slice(values, param.master.dims(), &Device::Cpu)?;
                tensors.push((format!("{}/{}", param.path, buffer.name), tensor));
            }
        }
    }
    Ok(SavedState { json, tensors })
}

/// Parses the settings and checks that every buffer in use has the right length, changing nothing.
pub(crate) fn check<S: serde::de::DeserializeOwned>(
    key: &str,
    state: &SavedState,
    params: &[OptimParam],
    buffers: &[Buffers],
) -> Result<S> {
    let bad = |reason: String| Error::OptimizerState { reason };
    let settings = serde_json::from_str(&state.json)
        .map_err(|source| Error::SavedStateUnreadable { key: key.to_string(), source })?;
    let by_name: HashMap<&str, &Tensor> = state.tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    for buffer in buffers.iter().filter(|b| b.used) {
        for (param, values) in params.iter().zip(&buffer.values) {
            if values.is_empty() {
                continue;
            }
            let name = format!("{}/{}", param.path, buffer.name);
            match by_name.get(name.as_str()) {
                None => return Err(bad(format!("`{name}` is missing: {MATCHED_BY_NAME}"))),
                Some(t) if t.elem_count() != values.len() => {
                    return Err(bad(format!(
                        "`{name}` has {} values, the parameter {}: {MATCHED_BY_NAME}",
                        t.elem_count(),
                        values.len()
                    )))
                }
                // Flat: saved before states kept their parameter's shape.
                Some(t) if t.rank() > 1 && t.dims() != param.master.dims() => {
                    return Err(bad(format!(
                        "`{name}` has shape {:?}, the parameter {:?}: {MATCHED_BY_NAME}",
                        t.dims(),
                        param.master.dims()
                    )))
                }
                Some(t) if t.dtype() != candle_core::DType::F32 => {
                    return Err(bad(format!(
                        "`{name}` is {:?}, where optimizer state is F32: the checkpoint was not written by \
                         amp's optimizer, or was edited",
                        t.dtype()
                    )))
                }
                Some(_) => {}
            }
        }
    }
    Ok(settings)
}

/// What a state that does not fit its parameter most likely means, and what to do.
const MATCHED_BY_NAME: &str = "saved state is matched to parameters by name, and these are not the \
     parameters it was saved with; build the optimizer's groups as when saving (`ParamGroups::from_model` \
     or `from_varmap` name parameters by path; `from_vars` names them by position)";

/// Copies the saved buffers in (after [`check`] passed).
pub(crate) fn restore(state: &SavedState, params: &[OptimParam], buffers: &mut [Buffers]) -> Result<()> {
    let by_name: HashMap<&str, &Tensor> = state.tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    for buffer in buffers.iter_mut().filter(|b| b.used) {
        for (param, values) in params.iter().zip(buffer.values.iter_mut()) {
            if let Some(t) = by_name.get(format!("{}/{}", param.path, buffer.name).as_str()) {
                *values = t.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1()?;
            }
        }
    }
    Ok(())
}

/// What a fused optimizer exposes so that one [`TrainingState`] implementation saves and restores all
/// of them: its [`Core`] (settings, applied steps, parameter groups, fp32 buffers, device copy).
pub(crate) trait Checkpointed {
    /// The optimizer's settings.
    type Config: Copy + serde::Serialize + serde::de::DeserializeOwned;
    /// Its state buffers, in a fixed order.
    type State: AsRef<[Buffers]> + AsMut<[Buffers]>;
    fn core(&self) -> &Core<Self::Config, Self::State>;
    fn core_mut(&mut self) -> &mut Core<Self::Config, Self::State>;
    /// Checks settings (from a checkpoint), naming the field out of range.
    fn validate_config(config: &Self::Config) -> Result<()>;
    /// Zeroed state buffers for `config` (which buffers are in use depends on it: AMSGrad, momentum).
    fn fresh_state(config: &Self::Config, params: &[OptimParam]) -> Self::State;
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Settings<C> {
    config: C,
    step: u64,
    groups: Vec<GroupOptions>,
    /// Each parameter's group, by path (absent in checkpoints written before it was saved).
    #[serde(default)]
    group_of: Option<BTreeMap<String, usize>>,
}

/// Each parameter's group, by path.
fn group_of(params: &[OptimParam]) -> BTreeMap<String, usize> {
    params.iter().map(|p| (p.path.clone(), p.group)).collect()
}

/// Refuses saved settings that put one of this optimizer's parameters in another group, or that did
/// not have it: the groups' options (learning rate, weight decay) would land on the wrong parameters.
/// Saved parameters this optimizer lacks are not refused: a ZeRO-1 rank's optimizer holds its shard
/// of a whole run's state.
fn check_membership(saved: &BTreeMap<String, usize>, params: &[OptimParam]) -> Result<()> {
    let bad = |reason: String| Error::OptimizerState { reason };
    let advice = "build the groups (`with_group`) as when saving";
    for p in params {
        match saved.get(&p.path) {
            None => {
                return Err(bad(format!("`{}` was not one of its parameters when saved: {advice}", p.path)))
            }
            Some(&g) if g != p.group => {
                return Err(bad(format!(
                    "`{}` was in parameter group {g} when saved and is in group {} now: {advice}",
                    p.path, p.group
                )))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// The saved settings and the state buffers they use (zeroed), after checks that the settings are in
/// range and describe the same parameter groups and that every buffer they use is there ([`check`]).
fn checked_settings<T: Checkpointed>(
    saved: &SavedState,
    core: &Core<T::Config, T::State>,
) -> Result<(Settings<T::Config>, T::State)> {
    let bad = |reason: String| Error::OptimizerState { reason };
    let settings: Settings<T::Config> = serde_json::from_str(&saved.json)
        .map_err(|source| Error::SavedStateUnreadable { key: core.key.clone(), source })?;
    T::validate_config(&settings.config)?;
    super::validate::groups(&settings.groups)?;
    if settings.step == u64::MAX {
        return Err(bad("its step count is at u64::MAX, which no training reaches: the file is damaged or \
             was not written by amp; load another checkpoint"
            .into()));
    }
    if settings.groups.len() != core.groups.groups.len() {
        return Err(bad(format!(
            "it has {} parameter group(s), this optimizer {}: build the optimizer's groups as when saving \
             (the same `ParamGroups::with_group` calls, in the same order)",
            settings.groups.len(),
            core.groups.groups.len()
        )));
    }
    if let Some(saved_groups) = &settings.group_of {
        check_membership(saved_groups, &core.groups.params)?;
    }
    let state = T::fresh_state(&settings.config, &core.groups.params);
    check::<Settings<T::Config>>(&core.key, saved, &core.groups.params, state.as_ref())?;
    Ok((settings, state))
}

impl<T: Checkpointed> TrainingState for T {
    fn state_key(&self) -> String {
        self.core().key.clone()
    }

    fn save_state(&self) -> Result<SavedState> {
        let core = self.core();
        let settings = Settings {
            config: core.config,
            step: core.step,
            groups: core.groups.groups.clone(),
            group_of: Some(group_of(&core.groups.params)),
        };
        #[cfg(feature = "cuda")]
        if let Some(on_device) = &core.on_device {
            let (buffers, step) = super::device::downloaded(on_device, core.state.as_ref())?;
            let settings = Settings { step, ..settings };
            return save(&settings, &core.groups.params, &buffers);
        }
        save(&settings, &core.groups.params, core.state.as_ref())
    }

    fn check_state(&self, saved: &SavedState) -> Result<()> {
        checked_settings::<T>(saved, self.core()).map(|_| ())
    }

    fn restore_state(&mut self, saved: SavedState) -> Result<()> {
        let (settings, mut state) = checked_settings::<T>(&saved, self.core())?;
        restore(&saved, &self.core().groups.params, state.as_mut())?;
        let core = self.core_mut();
        (core.config, core.step) = (settings.config, settings.step);
        for (mine, restored) in core.groups.groups.iter_mut().zip(settings.groups) {
            *mine = restored;
        }
        // The restored values are uploaded by the next step on the device.
        #[cfg(feature = "cuda")]
        {
            core.on_device = None;
        }
        core.state = state;
        Ok(())
    }
}
