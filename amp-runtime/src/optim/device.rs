//! The fused optimizers' step on a CUDA device (feature `cuda`): their state moves to the device on the
//! first step there and stays; checkpoints read it back; a restore drops it so the next step uploads the
//! restored values.

use candle_core::backprop::GradStore;
use candle_core::Device;

use super::params::ParamGroups;
use super::state::Buffers;
use crate::cuda::{DeviceOptimizer, Gate, Launch};
use crate::error::Result;

/// The CUDA device the optimizer's gradients are on, if they are on one.
pub(crate) fn cuda_device(groups: &ParamGroups, grads: &GradStore) -> Option<Device> {
    let grad = groups.params.iter().find_map(|p| p.grad(grads).ok().flatten())?;
    grad.device().is_cuda().then(|| grad.device().clone())
}

/// One step of every group on `device`: uploads the state on first use (`state`: each buffer and
/// whether it is in use; `applied`: steps applied before this one), calls `launch(group, ...)` per
/// group, and counts the step on the device unless `gate` skips it there.
#[allow(clippy::too_many_arguments)]
pub(crate) fn step(
    slot: &mut Option<DeviceOptimizer>,
    device: &Device,
    groups: &ParamGroups,
    state: &[Buffers],
    grads: &GradStore,
    gate: Gate<'_>,
    applied: u64,
    mut launch: impl FnMut(usize, Launch<'_>) -> Result<()>,
) -> Result<()> {
    let on_device = match slot {
        Some(on_device) => on_device,
        None => {
            let host: Vec<Option<&[Vec<f32>]>> = state
                .iter()
                .map(|b| b.used.then(|| b.f32().map(|v| &v[..])).transpose())
                .collect::<Result<_>>()?;
            slot.insert(DeviceOptimizer::new(device, groups, &host, applied)?)
        }
    };
    on_device.begin_step(gate)?;
    for group in 0..groups.groups.len() {
        on_device.launch_group(groups, grads, group, gate, |l| launch(group, l))?;
    }
    on_device.end_step(gate)?;
    crate::CastCache::clear();
    Ok(())
}

/// The buffers with the device's values where the state lives there, and the applied steps (for
/// checkpoints).
pub(crate) fn downloaded(on_device: &DeviceOptimizer, host: &[Buffers]) -> Result<(Vec<Buffers>, u64)> {
    let values = on_device.download()?;
    let buffers = host
        .iter()
        .zip(values)
        .map(|(buffer, values)| Buffers {
            name: buffer.name,
            values: values.map_or_else(|| buffer.values.clone(), super::state::Values::F32),
            used: buffer.used,
        })
        .collect();
    Ok((buffers, on_device.applied_steps()?))
}
