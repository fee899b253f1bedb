//! Exports for inference: each weight in the precision its layer computes in, in safetensors with
//! candle-nn's names.
//!
//! A checkpoint ([`save_with`](super::save_with)) holds fp32 masters, the source of truth of training.
//! What a trained mixed-precision model computes with is something else: under O2 the half working
//! copies (each master rounded once), under O1 the same rounding made at each use, and fp32 for the
//! layers pinned there (norms). [`export`] writes exactly that: bf16 or fp16 weights for half layers,
//! fp32 for the others and for buffers (BatchNorm's running statistics). The file is about half the
//! size of a checkpoint, and a model loaded from it ([`load_export`]) at the same precision level
//! computes what the trained model computed, bit for bit. candle-nn reads it as any safetensors file
//! (`VarBuilder::from_mmaped_safetensors`, which converts each tensor to the dtype asked).
//!
//! Nothing is silently corrupted: an fp16 weight beyond 65504 would become inf, so the export is
//! refused naming those weights; values too small for the half type that round to zero are counted in
//! the [`ExportReport`].

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use candle_core::{DType, Tensor};

use super::{apply, stage, write_file, FileKind, LoadOptions};
use crate::error::{Error, Result};
use crate::module::for_each_layer;
use crate::{AmpModule, AmpModuleExt};

/// The metadata key that marks a file as an export (its value: `"inference"`).
const EXPORT_KEY: &str = "amp_export";

/// Whether a file's metadata marks it as an export.
pub(super) fn is_export(metadata: &HashMap<String, String>) -> bool {
    metadata.contains_key(EXPORT_KEY)
}

/// What [`export`] wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExportReport {
    /// Every tensor written: its name and dtype, in the file's order (parameters in the model's
    /// order, then buffers).
    pub tensors: Vec<(String, DType)>,
    /// Bytes of tensor data written.
    pub bytes: usize,
    /// Bytes the same tensors take in fp32.
    pub bytes_fp32: usize,
    /// Parameters with non-zero values that became zero in their half type (too small for it), and how
    /// many; empty when none did.
    pub flushed_to_zero: Vec<(String, usize)>,
}

impl fmt::Display for ExportReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let count = |dtype: DType| self.tensors.iter().filter(|(_, d)| *d == dtype).count();
        write!(
            f,
            "exported {} tensors ({} bf16, {} f16, {} f32): {} bytes, {:.2}x of fp32",
            self.tensors.len(),
            count(DType::BF16),
            count(DType::F16),
            count(DType::F32),
            self.bytes,
            self.bytes as f64 / self.bytes_fp32.max(1) as f64
        )?;
        for (name, n) in &self.flushed_to_zero {
            write!(f, "\n  `{name}`: {n} non-zero value(s) too small for its half type became 0")?;
        }
        Ok(())
    }
}

/// Writes `model` for inference to `path`: each parameter in the precision its layer computes in
/// (the plan's `compute`: bf16 or fp16 for half layers, f32 for the others), buffers in f32, under
/// candle-nn's names, durably (as [`save`](super::save)). An O0 model exports in fp32: initialise a
/// copy at O2 (`amp::initialize`) first for a half export.
///
/// # Errors
/// [`Error::ExportOverflow`] (nothing written) when a weight would become inf in its layer's half type
/// (fp16 beyond 65504; bf16 only past 3.39e38); those of writing the file.
pub fn export<M: AmpModule + ?Sized>(model: &M, path: impl AsRef<Path>) -> Result<ExportReport> {
    let path = path.as_ref();
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    let mut report = ExportReport::default();
    let mut overflowing = Vec::new();
    let mut failed = None;
    for_each_layer(model, |site, layer| {
        let dtype = layer.precision().compute.dtype();
        for (name, param) in layer.params() {
            let path = site.param_path(name);
            match rounded(param.master().as_tensor(), dtype) {
                Ok(Rounded { tensor, overflowed, flushed }) => {
                    if overflowed > 0 {
                        overflowing.push(format!("`{path}` ({overflowed} in {dtype:?})"));
                    }
                    if flushed > 0 {
                        report.flushed_to_zero.push((path.clone(), flushed));
                    }
                    tensors.push((path, tensor));
                }
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    if !overflowing.is_empty() {
        let overflowing = overflowing.join(", ");
        return Err(Error::ExportOverflow { path: path.to_path_buf(), overflowing });
    }
    for (name, buffer) in model.named_buffers() {
        tensors.push((name, buffer.as_tensor().to_dtype(DType::F32)?));
    }
    for (name, t) in &tensors {
        report.tensors.push((name.clone(), t.dtype()));
        report.bytes += t.elem_count() * t.dtype().size_in_bytes();
        report.bytes_fp32 += t.elem_count() * 4;
    }
    let metadata = HashMap::from([(EXPORT_KEY.to_string(), "inference".to_string())]);
    write_file(path, &tensors, metadata)?;
    Ok(report)
}

/// A master rounded to its export dtype, with what the rounding lost.
struct Rounded {
    tensor: Tensor,
    /// Finite values that became infinite.
    overflowed: usize,
    /// Non-zero values that became zero.
    flushed: usize,
}

fn rounded(master: &Tensor, dtype: DType) -> Result<Rounded> {
    let tensor = master.to_dtype(dtype)?;
    if dtype == master.dtype() || dtype == DType::F32 {
        return Ok(Rounded { tensor, overflowed: 0, flushed: 0 });
    }
    let before = master.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let after = tensor.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let overflowed = before.iter().zip(&after).filter(|(b, a)| b.is_finite() && !a.is_finite()).count();
    let flushed = before.iter().zip(&after).filter(|(b, a)| **b != 0.0 && **a == 0.0).count();
    Ok(Rounded { tensor, overflowed, flushed })
}

/// Loads an export ([`export`]), or a checkpoint's parameters, into `model`: half tensors widen into
/// fp32 masters exactly and refresh the working copies; the same checks as [`load`](super::load)
/// (names, shapes, dtypes, inf/NaN, checksums), and nothing changes unless every tensor fits. For
/// inference: an export holds no optimizer or scaler state, and half-rounded weights make poor
/// masters to resume training from.
pub fn load_export<M: AmpModule + ?Sized>(model: &mut M, path: impl AsRef<Path>) -> Result<()> {
    let staged = stage(model, &[], path.as_ref(), LoadOptions::default(), FileKind::Export)?;
    apply(model, &mut [], staged)
}
