//! One debug line per new (device, shape, precision, choice, padding).

use std::collections::HashSet;
use std::sync::Mutex;

use amp_kernels::gemm::Dims;
use candle_core::Device;

use super::{Choice, MatmulKernel};
use crate::Precision;

type Key = (bool, Dims, Precision, MatmulKernel, Option<Dims>);

static SEEN: Mutex<Option<HashSet<Key>>> = Mutex::new(None);

/// Logs `choice` at debug level the first time this combination is seen (only when the level is on).
pub(super) fn once(device: &Device, precision: Precision, dims: Dims, choice: &Choice) {
    if !tracing::enabled!(target: "amp::dispatch", tracing::Level::DEBUG) {
        return;
    }
    let key = (device.is_cpu(), dims, precision, choice.kernel, choice.padded);
    let mut seen = SEEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if seen.get_or_insert_with(HashSet::new).insert(key) {
        tracing::debug!(
            target: "amp::dispatch",
            "matmul batch {} m {} n {} k {} in {precision}: {choice}",
            dims.batch, dims.m, dims.n, dims.k
        );
    }
}
