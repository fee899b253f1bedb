//! Optimizer state (vectors per parameter, f32 or bf16) in checkpoints.

use std::collections::{BTreeMap, HashMap};

use candle_core::{DType, Device, Tensor};
use half::bf16;

use super::core::Core;
use super::params::{GroupOptions, OptimParam};
use crate::checkpoint::{SavedState, TrainingState};
use crate::error::{Error, Result};

/// One named buffer per parameter (`exp_avg`, `momentum_buffer`, ...). Empty vectors are buffers not in
/// use (amsgrad off, no momentum) and are not saved.
pub(crate) struct Buffers {
    pub name: &'static str,
    pub values: Values,
    /// False for a kind the settings do not use (its vectors are empty; the kernels get null pointers).
    pub used: bool,
}

/// A buffer's vectors, one per parameter, in the dtype the optimizer keeps that state in.
#[derive(Clone)]
pub(crate) enum Values {
    F32(Vec<Vec<f32>>),
    Bf16(Vec<Vec<bf16>>),
}

impl std::fmt::Debug for Buffers {
    /// The name and size, not millions of values.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buffers({}: {} bytes)", self.name, self.bytes())
    }
}

impl Buffers {
    /// Zeroed f32 vectors of the parameters' sizes (empty when not `used`).
    pub(crate) fn zeros(name: &'static str, params: &[OptimParam], used: bool) -> Self {
        let values = Values::F32(zeroed(params, used));
        Buffers { name, values, used }
    }

    /// [`Buffers::zeros`] in bf16.
    pub(crate) fn zeros_bf16(name: &'static str, params: &[OptimParam], used: bool) -> Self {
        let values = Values::Bf16(zeroed(params, used));
        Buffers { name, values, used }
    }

    pub(crate) fn bytes(&self) -> usize {
        match &self.values {
            Values::F32(v) => v.iter().map(|v| 4 * v.len()).sum(),
            Values::Bf16(v) => v.iter().map(|v| 2 * v.len()).sum(),
        }
    }

    /// The f32 vectors: every optimizer's state but bf16 state (`StateDtype::Bf16`).
    pub(crate) fn f32_mut(&mut self) -> Result<&mut Vec<Vec<f32>>> {
        let name = self.name;
        match &mut self.values {
            Values::F32(v) => Ok(v),
            Values::Bf16(_) => Err(not_f32(name)),
        }
    }

    /// [`Buffers::f32_mut`], shared.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn f32(&self) -> Result<&Vec<Vec<f32>>> {
        match &self.values {
            Values::F32(v) => Ok(v),
            Values::Bf16(_) => Err(not_f32(self.name)),
        }
    }

    /// The bf16 vectors (`StateDtype::Bf16`: Adam's and LAMB's moments, SGD's momentum).
    pub(crate) fn bf16_mut(&mut self) -> Result<&mut Vec<Vec<bf16>>> {
        match &mut self.values {
            Values::Bf16(v) => Ok(v),
            Values::F32(_) => {
                Err(Error::Internal { what: format!("optimizer state `{}` is f32, not bf16", self.name) })
            }
        }
    }

    fn dtype(&self) -> DType {
        match self.values {
            Values::F32(_) => DType::F32,
            Values::Bf16(_) => DType::BF16,
        }
    }

    /// Parameter `i`'s vector as a tensor of the parameter's shape, or `None` when empty.
    fn tensor(&self, i: usize, param: &OptimParam) -> Result<Option<Tensor>> {
        let dims = param.master.dims();
        let tensor = match &self.values {
            Values::F32(v) if !v[i].is_empty() => Tensor::from_slice(&v[i], dims, &Device::Cpu)?,
            Values::Bf16(v) if !v[i].is_empty() => Tensor::from_slice(&v[i], dims, &Device::Cpu)?,
            _ => return Ok(None),
        };
        Ok(Some(tensor))
    }

    /// The number of values of parameter `i` (0 when not in use).
    fn len_of(&self, i: usize) -> usize {
        match &self.values {
            Values::F32(v) => v[i].len(),
            Values::Bf16(v) => v[i].len(),
        }
    }

    /// Replaces parameter `i`'s vector with a saved tensor's values (of this buffer's dtype, checked).
    fn set(&mut self, i: usize, t: &Tensor) -> Result<()> {
        let t = t.flatten_all()?;
        match &mut self.values {
            Values::F32(v) => v[i] = t.to_vec1()?,
            Values::Bf16(v) => v[i] = t.to_vec1()?,
        }
        Ok(())
    }
}

/// A bf16 buffer where an f32 one was expected: a bug, not a user's mistake.
fn not_f32(name: &str) -> Error {
    Error::Internal { what: format!("optimizer state `{name}` is bf16 where an f32 buffer was expected") }
}

/// Zeroed vectors of each parameter's size, or empty ones when not `used`.
fn zeroed<T: Copy + Default>(params: &[OptimParam], used: bool) -> Vec<Vec<T>> {
    params.iter().map(|p| if used { vec![T::default(); p.elem_count()] } else { Vec::new() }).collect()
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
        for (i, param) in params.iter().enumerate() {
            // In the parameter's shape, so that a load can tell parameters of one size apart.
            if let Some(tensor) = buffer.tensor(i, param)? {
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
        for (i, param) in params.iter().enumerate() {
            let len = buffer.len_of(i);
            if len == 0 {
                continue;
            }
            let name = format!("{}/{}", param.path, buffer.name);
            match by_name.get(name.as_str()) {
                None => return Err(bad(format!("`{name}` is missing: {MATCHED_BY_NAME}"))),
                Some(t) if t.elem_count() != len => {
                    return Err(bad(format!(
                        "`{name}` has {} values, the parameter {len}: {MATCHED_BY_NAME}",
                        t.elem_count(),
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
                Some(t) if t.dtype() != buffer.dtype() => {
                    return Err(bad(format!(
                        "`{name}` is {:?}, where the saved settings keep this state in {:?}: the checkpoint \
                         was not written by amp's optimizer, or was edited",
                        t.dtype(),
                        buffer.dtype()
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
        for (i, param) in params.iter().enumerate() {
            if let Some(t) = by_name.get(format!("{}/{}", param.path, buffer.name).as_str()) {
                buffer.set(i, t)?;
            }
        }
    }
    Ok(())
}

/// What a fused optimizer exposes so that one [`TrainingState`] implementation saves and restores all
/// of them: its [`Core`] (settings, applied steps, parameter groups, state buffers, device copy).
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
