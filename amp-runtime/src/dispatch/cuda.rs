//! cuBLAS settings, tensor-core shape rules and the padding policy for CUDA products (through
//! candle's matmul).
//!
//! candle's "reduced precision" switches choose cuBLAS's compute type: for f16 on, products accumulate
//! in f16 (`CUBLAS_COMPUTE_16F`); for bf16 on, `CUBLAS_COMPUTE_32F_FAST_16BF`; for f32 on, TF32
//! (`CUBLAS_COMPUTE_32F_FAST_TF32`). amp's contract is f32 accumulation for half products, so the half
//! switches stay off; TF32 for f32 products is an opt-in of the policy, as in PyTorch
//! (`allow_tf32`).

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};

use amp_kernels::gemm::Dims;

use super::{Choice, MatmulKernel};
use crate::Precision;

/// The cuBLAS compute types amp asks candle for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaGemmSettings {
    /// f16 products accumulate in f16 (never under amp).
    pub f16_reduced: bool,
    /// bf16 products use cuBLAS's fast-16BF compute type (never under amp).
    pub bf16_reduced: bool,
    /// f32 products may use TF32 tensor cores.
    pub tf32: bool,
}

impl CudaGemmSettings {
    /// The settings for a policy that does (`tf32`) or does not allow TF32 for f32 products.
    #[must_use]
    pub fn for_policy(tf32: bool) -> CudaGemmSettings {
        CudaGemmSettings { f16_reduced: false, bf16_reduced: false, tf32 }
    }
}

impl fmt::Display for CudaGemmSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let half = if self.f16_reduced || self.bf16_reduced {
            "half accumulation"
        } else {
            "f32 accumulation for f16/bf16"
        };
        write!(f, "{half}, {}", if self.tf32 { "TF32 for f32" } else { "full f32" })
    }
}

/// Applies amp's cuBLAS settings to candle's process-wide switches (no effect in a build without CUDA)
/// and returns what they were.
pub fn cuda_gemm_settings(settings: CudaGemmSettings) -> CudaGemmSettings {
    use candle_core::cuda;
    let before = CudaGemmSettings {
        f16_reduced: cuda::gemm_reduced_precision_f16(),
        bf16_reduced: cuda::gemm_reduced_precision_bf16(),
        tf32: cuda::gemm_reduced_precision_f32(),
    };
    cuda::set_gemm_reduced_precision_f16(settings.f16_reduced);
    cuda::set_gemm_reduced_precision_bf16(settings.bf16_reduced);
    cuda::set_gemm_reduced_precision_f32(settings.tf32);
    before
}

/// The TF32 policy for f32 products on CUDA (off by default, as PyTorch's `allow_tf32` for matmuls
/// since 1.12): on, f32 products use TF32 tensor cores (10-bit mantissa products, f32 accumulation).
/// Half products keep f32 accumulation either way. Returns the previous setting.
pub fn allow_tf32(allow: bool) -> bool {
    cuda_gemm_settings(CudaGemmSettings::for_policy(allow)).tf32
}

/// The most padding may add to a product's multiply-adds: 1/8, within which padding one dimension of
/// 56 or more always stays. A smaller dimension is a few steps of the tensor cores, and its product
/// small enough that moving the operands, not multiplying them, sets its time.
pub const MAX_PADDING_EXTRA: f64 = 0.125;

static PAD: AtomicBool = AtomicBool::new(false);

/// The padding policy for products on CUDA (off by default). On, a product whose m, n or k is not a
/// multiple of the tensor cores' step ([`tensor_core_step`]) runs on operands zero-padded to the next
/// multiples, and its result is cut back to the product's size: the same terms summed, since every
/// added one is a product with zero (cuBLAS may sum a padded shape in another order). A padded operand is a copy, made per product, so where a model can, a
/// dimension it chooses (a vocabulary, a hidden size) is better made a multiple of 8 in the model
/// itself. Products that padding would grow by more than [`MAX_PADDING_EXTRA`] are left as they are.
/// [`super::explain`] says, per shape, whether a product is padded and what that costs. Returns the
/// previous setting.
pub fn pad_for_tensor_cores(pad: bool) -> bool {
    PAD.swap(pad, Ordering::Relaxed)
}

/// Whether [`pad_for_tensor_cores`] is on.
#[must_use]
pub fn pads_for_tensor_cores() -> bool {
    PAD.load(Ordering::Relaxed)
}

/// The step, in elements, at which tensor cores take their fastest route for a product computed in
/// `precision`: 16 bytes of its operands (NVIDIA's "Matrix Multiplication Background": multiples of 8
/// for f16 and bf16, of 4 for TF32). `None` for f32 without TF32, which tensor cores do not run.
#[must_use]
pub fn tensor_core_step(precision: Precision, tf32: bool) -> Option<usize> {
    match precision {
        Precision::Fp16 | Precision::Bf16 => Some(8),
        Precision::Fp32 if tf32 => Some(4),
        Precision::Fp32 => None,
    }
}

/// Whether m, n and k are all multiples of `step`.
#[must_use]
pub fn tensor_core_shape(dims: Dims, step: usize) -> bool {
    [dims.m, dims.n, dims.k].iter().all(|d| d % step == 0)
}

/// A product's sizes with m, n and k rounded up to multiples of `step`, and the fraction of
/// multiply-adds that adds (0 for an empty product).
#[must_use]
pub fn tensor_core_padding(dims: Dims, step: usize) -> (Dims, f64) {
    let padded = Dims {
        m: dims.m.next_multiple_of(step),
        n: dims.n.next_multiple_of(step),
        k: dims.k.next_multiple_of(step),
        ..dims
    };
    let extra = if dims.flops() == 0.0 { 0.0 } else { padded.flops() / dims.flops() - 1.0 };
    (padded, extra)
}

/// The choice for a product on CUDA: candle's matmul on cuBLAS under these switches, padded for the
/// tensor cores when `pad` is on and the padding is worth it (what [`super::explain`] returns there).
pub(super) fn cuda_choice(precision: Precision, dims: Dims, settings: CudaGemmSettings, pad: bool) -> Choice {
    let mut reason = format!("not a CPU device: cuBLAS through candle, {settings}");
    let mut padded = None;
    match tensor_core_step(precision, settings.tf32) {
        None => reason.push_str("; no tensor cores for f32 without TF32"),
        Some(step) if tensor_core_shape(dims, step) => {
            reason.push_str(&format!("; m, n and k multiples of {step}: the tensor cores' fastest route"));
        }
        Some(step) => {
            let (to, extra) = tensor_core_padding(dims, step);
            let uneven = [("m", dims.m, to.m), ("n", dims.n, to.n), ("k", dims.k, to.k)]
                .into_iter()
                .filter(|(_, from, to)| from != to)
                .map(|(name, from, to)| format!("{name} {from} -> {to}"))
                .collect::<Vec<_>>()
                .join(", ");
            let extra_pct = 100.0 * extra;
            if !pad {
                reason.push_str(&format!(
                    "; not multiples of {step}, the tensor cores' slower route (dispatch::pad_for_tensor_cores \
                     would pad {uneven}: {extra_pct:+.2}% multiply-adds)"
                ));
            } else if extra > MAX_PADDING_EXTRA {
                reason.push_str(&format!(
                    "; not multiples of {step}, not padded: {uneven} would add {extra_pct:.1}% multiply-adds \
                     (at most {:.1}%)",
                    100.0 * MAX_PADDING_EXTRA
                ));
            } else {
                reason.push_str(&format!(
                    "; padded for the tensor cores, {uneven} ({extra_pct:+.2}% multiply-adds)"
                ));
                padded = Some(to);
            }
        }
    }
    Choice { kernel: MatmulKernel::Candle, reason, padded }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_products_keep_f32_accumulation_and_tf32_is_opt_in() {
        let s = CudaGemmSettings::for_policy(false);
        assert!(!s.f16_reduced && !s.bf16_reduced && !s.tf32);
        assert!(CudaGemmSettings::for_policy(true).tf32);
        assert_eq!(s.to_string(), "f32 accumulation for f16/bf16, full f32");
    }

    /// Needs the `cuda` build: without it candle's switches are stand-ins that ignore writes.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_tf32_policy_sets_candles_switches_and_keeps_half_accumulation_in_f32() {
        let before = allow_tf32(false);
        let settings = cuda_gemm_settings(CudaGemmSettings::for_policy(false));
        assert!(!settings.f16_reduced && !settings.bf16_reduced && !settings.tf32);
        allow_tf32(before);
    }

    #[test]
    fn tensor_cores_step_by_sixteen_bytes_of_the_operands() {
        assert_eq!(tensor_core_step(Precision::Bf16, false), Some(8));
        assert_eq!(tensor_core_step(Precision::Fp16, true), Some(8));
        assert_eq!(tensor_core_step(Precision::Fp32, true), Some(4));
        assert_eq!(tensor_core_step(Precision::Fp32, false), None);
        assert!(tensor_core_shape(Dims::new(128, 64, 768), 8));
        assert!(!tensor_core_shape(Dims::new(128, 50257, 768), 8));
        assert!(tensor_core_shape(Dims::new(12, 20, 36), 4));
        let (padded, extra) = tensor_core_padding(Dims::batched(3, 4096, 50257, 768), 8);
        assert_eq!(padded, Dims::batched(3, 4096, 50264, 768));
        assert!((extra - 7.0 / 50257.0).abs() < 1e-12, "{extra}");
        let (padded, extra) = tensor_core_padding(Dims::new(5, 13, 7), 8);
        assert_eq!(padded, Dims::new(8, 16, 8));
        assert!((extra - (8.0 * 16.0 * 8.0) / (5.0 * 13.0 * 7.0) + 1.0).abs() < 1e-12, "{extra}");
        assert_eq!(tensor_core_padding(Dims::new(0, 3, 3), 8).1, 0.0);
    }

    #[test]
    fn a_product_is_padded_only_under_the_policy_and_only_when_that_is_cheap() {
        let half = CudaGemmSettings::for_policy(false);
        let vocab = Dims::new(4096, 50257, 768);
        let off = cuda_choice(Precision::Bf16, vocab, half, false);
        assert_eq!((off.kernel, off.padded), (MatmulKernel::Candle, None));
        assert!(off.reason.contains("pad_for_tensor_cores would pad n 50257 -> 50264"), "{off}");
        let on = cuda_choice(Precision::Bf16, vocab, half, true);
        assert_eq!(on.padded, Some(Dims::new(4096, 50264, 768)), "{on}");
        assert!(on.reason.contains("padded for the tensor cores, n 50257 -> 50264 (+0.01%"), "{on}");
        // A 3-wide input would make the product 2.7x larger: left alone, and said so.
        let narrow = cuda_choice(Precision::Fp16, Dims::new(4096, 256, 3), half, true);
        assert_eq!(narrow.padded, None);
        assert!(narrow.reason.contains("k 3 -> 8 would add 166.7% multiply-adds"), "{narrow}");
        // Aligned products and f32 without TF32 have nothing to pad.
        let aligned = cuda_choice(Precision::Fp16, Dims::new(64, 64, 64), half, true);
        assert_eq!(aligned.padded, None);
        assert!(aligned.reason.contains("fastest route"), "{aligned}");
        let f32 = cuda_choice(Precision::Fp32, vocab, half, true);
        assert_eq!(f32.padded, None);
        assert!(f32.reason.contains("no tensor cores"), "{f32}");
        // With TF32 an f32 product steps by 4.
        let tf32 = cuda_choice(
            Precision::Fp32,
            Dims::new(4096, 50258, 768),
            CudaGemmSettings::for_policy(true),
            true,
        );
        assert_eq!(tf32.padded, Some(Dims::new(4096, 50260, 768)), "{tf32}");
    }

    #[test]
    fn the_padding_policy_is_off_until_asked_and_returns_the_previous_setting() {
        let before = pad_for_tensor_cores(true);
        assert!(pads_for_tensor_cores());
        assert!(pad_for_tensor_cores(before));
        assert_eq!(pads_for_tensor_cores(), before);
    }
}
