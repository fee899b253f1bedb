//! cuBLAS settings and tensor-core shape rules for CUDA products (through candle's matmul).
//!
//! candle's "reduced precision" switches choose cuBLAS's compute type: for f16 on, products accumulate
//! in f16 (`CUBLAS_COMPUTE_16F`); for bf16 on, `CUBLAS_COMPUTE_32F_FAST_16BF`; for f32 on, TF32
//! (`CUBLAS_COMPUTE_32F_FAST_TF32`). amp's contract is f32 accumulation for half products, so the half
//! switches stay off; TF32 for f32 products is an opt-in of the policy, as in PyTorch
//! (`allow_tf32`).

use std::fmt;

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

/// Whether tensor cores take their fastest route for a half product of this shape: m, n and k
/// multiples of 8 (16-byte aligned rows of f16/bf16; NVIDIA's "Matrix Multiplication Background").
#[must_use]
pub fn tensor_core_shape(m: usize, n: usize, k: usize) -> bool {
    [m, n, k].iter().all(|d| d % 8 == 0)
}

/// The size a dimension is padded to under a padding policy (the next multiple of 8), and the fraction
/// of extra work that costs.
#[must_use]
pub fn tensor_core_padding(dim: usize) -> (usize, f64) {
    let padded = dim.next_multiple_of(8);
    (padded, if dim == 0 { 0.0 } else { padded as f64 / dim as f64 - 1.0 })
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
    fn tensor_core_rules_are_multiples_of_eight() {
        assert!(tensor_core_shape(128, 64, 768));
        assert!(!tensor_core_shape(128, 64, 50257));
        let (padded, extra) = tensor_core_padding(50257);
        assert_eq!(padded, 50264);
        assert!((extra - 7.0 / 50257.0).abs() < 1e-12);
        assert_eq!(tensor_core_padding(64), (64, 0.0));
    }
}
