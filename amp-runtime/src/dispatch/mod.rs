//! Which kernel computes a matrix product, and why.
//!
//! On the CPU, products of f32, f16 and bf16 operands run on amp's GEMM ([`amp_kernels::gemm`]): the
//! best path the CPU has ([`GemmPath::choose`]: AMX tiles for bf16 where the CPU has them, `vdpbf16ps`
//! for bf16 on AVX512-BF16 where it outruns the FMA, zmm or ymm FMA
//! otherwise, f16 always through f32), with operands rounded to the compute precision while they are
//! packed, so no separate cast pass runs. f64 and integer products go to candle.
//!
//! On CUDA, products run on cuBLAS through candle, with f32 accumulation for f16 and bf16 (candle's
//! "reduced precision" switches off; [`cuda_gemm_settings`]) and TF32 for f32 only when a policy asks.
//! Tensor cores take their fastest route when m, n and k are multiples of 16 bytes of the operands
//! ([`tensor_core_step`]: 8 halves, 4 floats under TF32); the opt-in padding policy
//! ([`pad_for_tensor_cores`]) runs other products on zero-padded operands where that adds at most an
//! eighth to their work, and [`explain`] says which route a shape takes and what padding it would cost.
//! [`crate::cuda::prepare`] applies these settings; [`allow_tf32`] is the TF32 opt-in.
//!
//! [`explain`] returns the choice with its reason; a debug log line (`tracing`, target
//! `amp::dispatch`) reports each new (shape, precision, choice) once; [`set_override`] forces candle or
//! one GEMM path for the whole process, [`with_override`] for one thread's products inside a closure
//! (tests, benchmarks, or a user who wants candle's kernel).

mod cuda;
mod log;

pub use amp_kernels::gemm::{Compute, Dims, GemmPath};
pub use cuda::{
    allow_tf32, cuda_gemm_settings, pad_for_tensor_cores, pads_for_tensor_cores, tensor_core_padding,
    tensor_core_shape, tensor_core_step, CudaGemmSettings, MAX_PADDING_EXTRA,
};

use std::cell::Cell;
use std::fmt;
use std::sync::RwLock;

use amp_kernels::Dtype;
use candle_core::Device;

use crate::Precision;

/// What computes a product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MatmulKernel {
    /// amp's CPU GEMM on this path.
    Amp(GemmPath),
    /// candle's matmul: the `gemm` crate on the CPU, cuBLAS on CUDA.
    Candle,
}

impl fmt::Display for MatmulKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MatmulKernel::Amp(path) => write!(f, "amp gemm, {path}"),
            MatmulKernel::Candle => f.write_str("candle matmul"),
        }
    }
}

/// A dispatch decision and the reason for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    /// The kernel that runs.
    pub kernel: MatmulKernel,
    /// Why, in a sentence.
    pub reason: String,
    /// The sizes the product runs at when its operands are zero-padded for the tensor cores (on CUDA,
    /// under [`pad_for_tensor_cores`]); `None`: at its own.
    pub padded: Option<Dims>,
}

impl fmt::Display for Choice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kernel, self.reason)
    }
}

/// A process-wide override of the automatic choice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Override {
    /// Decide from device, precision and CPU features.
    #[default]
    Auto,
    /// Always candle's matmul.
    Candle,
    /// This GEMM path for every CPU product it can compute (the `vdpbf16ps` paths compute bf16 products
    /// only; other products then take the automatic choice).
    Path(GemmPath),
}

static OVERRIDE: RwLock<Override> = RwLock::new(Override::Auto);

thread_local! {
    /// An override for the products this thread dispatches, ahead of the process-wide one.
    static SCOPED: Cell<Option<Override>> = const { Cell::new(None) };
}

fn validate(new: Override) -> crate::Result<()> {
    match new {
        Override::Path(path) if !path.is_supported() => {
            Err(crate::Error::GemmPathUnsupported { path, features: path.isa().features() })
        }
        _ => Ok(()),
    }
}

/// Forces the choice for the whole process; returns the previous override.
///
/// # Errors
/// [`crate::Error::GemmPathUnsupported`] if `Override::Path` names a path this CPU cannot run; the
/// override is then unchanged.
pub fn set_override(new: Override) -> crate::Result<Override> {
    validate(new)?;
    let mut current = OVERRIDE.write().unwrap_or_else(std::sync::PoisonError::into_inner);
    Ok(std::mem::replace(&mut *current, new))
}

/// Runs `f` with `over` forced for the products dispatched from this thread (other threads keep theirs;
/// restored when `f` returns or panics).
///
/// # Errors
/// As [`set_override`]; `f` does not run then.
pub fn with_override<R>(over: Override, f: impl FnOnce() -> R) -> crate::Result<R> {
    validate(over)?;
    Ok(with_scoped(Some(over), f))
}

/// The override scoped on this thread ([`with_override`]), if any.
pub(crate) fn scoped_override() -> Option<Override> {
    SCOPED.get()
}

/// Runs `f` with `scoped` as this thread's scoped override (none: the process's holds), restored after.
pub(crate) fn with_scoped<R>(scoped: Option<Override>, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Override>);
    impl Drop for Restore {
        fn drop(&mut self) {
            SCOPED.set(self.0);
        }
    }
    let _restore = Restore(SCOPED.replace(scoped));
    f()
}

/// The override in force on this thread: its scoped one ([`with_override`]), else the process's.
#[must_use]
pub fn current_override() -> Override {
    SCOPED.get().unwrap_or_else(|| *OVERRIDE.read().unwrap_or_else(std::sync::PoisonError::into_inner))
}

/// The GEMM compute precision of a training precision.
#[must_use]
pub fn compute_of(precision: Precision) -> Compute {
    match precision {
        Precision::Fp32 => Compute::F32,
        Precision::Fp16 => Compute::F16,
        Precision::Bf16 => Compute::Bf16,
    }
}

/// The kernel for a product of `dims` computed in `precision` on `device`, under the current override.
#[must_use]
pub fn explain(device: &Device, precision: Precision, dims: Dims) -> Choice {
    choose(device, precision, dims, current_override())
}

/// [`explain`] under an explicit override (what the unit tests drive).
#[must_use]
pub fn choose(device: &Device, precision: Precision, dims: Dims, over: Override) -> Choice {
    let choice = if device.is_cpu() {
        with_in_place_clause(cpu_choice(precision, over), compute_of(precision), dims)
    } else {
        let tf32 = candle_core::cuda::gemm_reduced_precision_f32();
        cuda::cuda_choice(precision, dims, CudaGemmSettings::for_policy(tf32), pads_for_tensor_cores())
    };
    log::once(device, precision, dims, &choice);
    choice
}

/// Whether a product in `precision` on `device` runs on amp's GEMM under the current override (no log
/// line: what a layer asks before it picks the operands it hands the product).
pub(crate) fn runs_on_amp_gemm(device: &Device, precision: Precision) -> bool {
    device.is_cpu() && matches!(cpu_choice(precision, current_override()).kernel, MatmulKernel::Amp(_))
}

fn cpu_choice(precision: Precision, over: Override) -> Choice {
    let compute = compute_of(precision);
    match over {
        Override::Candle => Choice {
            kernel: MatmulKernel::Candle,
            reason: "forced by dispatch::set_override(Override::Candle)".into(),
            padded: None,
        },
        Override::Path(path) if !path.is_bf16_dot() || compute == Compute::Bf16 => Choice {
            kernel: MatmulKernel::Amp(path),
            reason: format!("forced by dispatch::set_override(Override::Path({path:?}))"),
            padded: None,
        },
        Override::Path(_) | Override::Auto => automatic(compute),
    }
}

fn automatic(compute: Compute) -> Choice {
    let path = GemmPath::choose(compute);
    let speedup = amp_kernels::gemm::dot_product_speedup();
    let reason = match (compute, path, speedup) {
        (Compute::Bf16, GemmPath::AmxBf16, _) => {
            "bf16 products on AMX tiles (tdpbf16ps, 16 x 16 x 32 per instruction)".to_string()
        }
        (Compute::Bf16, GemmPath::Avx512Bf16, Some(r)) => {
            format!("bf16 products on vdpbf16ps, measured at {r:.2}x the zmm FMA's flop rate on this CPU")
        }
        (Compute::Bf16, _, Some(r)) => format!(
            "vdpbf16ps measured at {r:.2}x the zmm FMA's flop rate on this CPU (below {}x): bf16 operands \
             widened while packing, {path}",
            amp_kernels::gemm::DOT_PAYS
        ),
        (Compute::Bf16, _, None) => {
            format!("no AVX512-BF16 on this CPU: bf16 operands widened while packing, {path}")
        }
        (Compute::F16, _, _) => {
            format!("f16 operands widened while packing (no CPU multiplies f16 fast), {path}")
        }
        (Compute::F32, _, _) => format!("f32 on {path}"),
    };
    Choice { kernel: MatmulKernel::Amp(path), reason, padded: None }
}

/// `choice` with a clause on how a product of `dims` reads its weight, where its path reads a weight of
/// the precision's own type in place for that few rows (a Linear's forward on a small batch).
fn with_in_place_clause(mut choice: Choice, compute: Compute, dims: Dims) -> Choice {
    let weight = match compute {
        Compute::F32 => Dtype::F32,
        Compute::F16 => Dtype::F16,
        Compute::Bf16 => Dtype::Bf16,
    };
    if let MatmulKernel::Amp(path) = choice.kernel {
        if let Some(rows) = path.rows_read_in_place(compute, weight, dims.k).filter(|&rows| dims.m <= rows) {
            let m = match dims.m {
                1 => "1 row".to_string(),
                m => format!("{m} rows"),
            };
            choice.reason.push_str(&format!(
                "; with {m} (at most {rows} at this k), a weight stored along k is read where it lies, not packed"
            ));
        }
    }
    choice
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_products_run_on_the_amp_gemm_with_the_path_the_cpu_has() {
        let dims = Dims::new(8, 8, 8);
        for precision in Precision::ALL {
            let choice = choose(&Device::Cpu, precision, dims, Override::Auto);
            assert_eq!(choice.kernel, MatmulKernel::Amp(GemmPath::choose(compute_of(precision))), "{choice}");
        }
        let f16 = choose(&Device::Cpu, Precision::Fp16, dims, Override::Auto);
        assert!(f16.reason.contains("widened"), "{f16}");
        // A product of few rows reads its weight in place on every path; the reason says so for such
        // a product only.
        let k = 1024;
        let rows = GemmPath::choose(Compute::F32).rows_read_in_place(Compute::F32, Dtype::F32, k);
        let rows = rows.expect("an FMA path reads an f32 weight of a few rows in place");
        let few = choose(&Device::Cpu, Precision::Fp32, Dims::new(rows, 64, k), Override::Auto);
        let clause = format!(
            "with {rows} rows (at most {rows} at this k), a weight stored along k is read where it lies"
        );
        assert!(few.reason.contains(&clause), "{few}");
        let one = choose(&Device::Cpu, Precision::Bf16, Dims::new(1, 64, k), Override::Auto);
        assert!(one.reason.contains("; with 1 row (at most"), "{one}");
        let many = choose(&Device::Cpu, Precision::Fp32, Dims::new(rows + 1, 64, k), Override::Auto);
        assert!(!many.reason.contains("where it lies"), "{many}");
    }

    #[test]
    fn overrides_force_candle_or_a_path_and_bf16_only_paths_keep_other_precisions_automatic() {
        let dims = Dims::new(8, 8, 8);
        let candle = choose(&Device::Cpu, Precision::Bf16, dims, Override::Candle);
        assert_eq!(candle.kernel, MatmulKernel::Candle);
        assert!(candle.reason.contains("forced"), "{candle}");
        let model = Override::Path(GemmPath::Avx512Bf16Model);
        assert_eq!(
            choose(&Device::Cpu, Precision::Bf16, dims, model).kernel,
            MatmulKernel::Amp(GemmPath::Avx512Bf16Model)
        );
        let f32 = choose(&Device::Cpu, Precision::Fp32, dims, model);
        assert_eq!(f32.kernel, MatmulKernel::Amp(GemmPath::choose(Compute::F32)), "{f32}");
    }

    #[test]
    fn forcing_a_path_the_cpu_lacks_is_refused_and_changes_nothing() {
        let before = current_override();
        let inside = with_override(Override::Path(GemmPath::Portable), current_override).unwrap();
        assert_eq!((inside, current_override()), (Override::Path(GemmPath::Portable), before));
        for path in GemmPath::ALL.into_iter().filter(|p| !p.is_supported()) {
            let err = set_override(Override::Path(path)).unwrap_err();
            assert!(err.to_string().contains("this CPU lacks"), "{err}");
            assert_eq!(current_override(), before);
        }
    }
}
