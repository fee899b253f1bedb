//! `amp::initialize`: turns a model built with fp32 weights into its mixed-precision form.

use std::collections::HashMap;

use candle_core::TensorId;

use crate::error::{Error, Result};
use crate::{AmpConfig, AmpModule, Cursor, Layer, LayerPrecision, LayerSite, Param, ParamStorage, Precision};

/// Applies an optimisation level to `model`: sets every layer's compute and output precision from its
/// attributes and the level, and converts parameter storage (half working copies with fp32 masters
/// under O2, half parameters under O3). Idempotent, and reversible: initializing with O0 afterwards
/// restores fp32 parameters from the masters.
///
/// Precedence per layer: fp32-pinned layers always compute in fp32; at O0 everything is fp32 (the
/// baseline ignores attributes); otherwise the innermost `#[amp(...)]` on the layer's path, else the
/// level's compute precision (`half`, resolved by `config.half`).
///
/// A parameter that several layers share (tied weights: one variable) stays shared: converted once,
/// every layer then holds the same master and working copy.
///
/// # Errors
/// [`Error::StorageFixed`] for a model built through an `AmpVarMap` asked for another level;
/// [`Error::TiedStorageDiffers`] when the layers that share a parameter ask for different storage;
/// candle's errors from the conversion. A model may be left partly converted: initialize it again.
pub fn initialize<M: AmpModule + ?Sized>(model: &mut M, config: AmpConfig) -> Result<()> {
    let policy = config.opt_level.policy();
    let output = Some(config.activation_precision());
    let mut first_error = None;
    // Each variable converted so far (by the id of its master before conversion): where it was met
    // first, the storage it got, and the converted parameter that later layers sharing it take.
    let mut converted: HashMap<TensorId, (String, ParamStorage, Param)> = HashMap::new();
    let mut apply = |site: LayerSite<'_>, layer: &mut dyn Layer| {
        if first_error.is_some() {
            return;
        }
        let compute = if layer.pinned_fp32() || !config.opt_level.mixed() {
            Precision::Fp32
        } else {
            site.requested.unwrap_or(policy.compute).resolve(config.half)
        };
        layer.set_precision(LayerPrecision { compute, output });
        let storage = match (compute.is_half(), config.opt_level.half_parameters()) {
            (true, true) if config.opt_level.master_weights() => ParamStorage::MasterAndWorking(compute),
            (true, true) => ParamStorage::Half(compute),
            _ => ParamStorage::Fp32,
        };
        let fixed = layer.storage_fixed();
        for (name, param) in layer.params_mut() {
            let key = param.master().as_tensor().id();
            if let Some((tied_to, tied_storage, shared)) = converted.get(&key) {
                if *tied_storage != storage {
                    let (path, tied_to, tied_storage) =
                        (site.param_path(name), tied_to.clone(), *tied_storage);
                    first_error = Some(Error::TiedStorageDiffers { path, tied_to, storage, tied_storage });
                    return;
                }
                *param = shared.clone();
                param.link().record_compute(compute, false);
                continue;
            }
            if fixed && param.storage() != storage {
                let (path, from, to) = (site.param_path(name), param.storage(), storage);
                first_error = Some(Error::StorageFixed { path, from, to });
                return;
            }
            if let Err(err) = param.set_storage(storage) {
                first_error = Some(err);
                return;
            }
            param.link().record_compute(compute, true);
            converted.insert(key, (site.param_path(name), storage, param.clone()));
        }
    };
    model.visit_mut(&mut Cursor::new(), &mut apply);
    first_error.map_or(Ok(()), Err)
}
