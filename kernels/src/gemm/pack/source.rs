//! The operand element types packing reads, and how each rounds to the compute precision.

use half::{bf16, f16};

use crate::branchless as bits;
use crate::gemm::row_load::Load;
use crate::gemm::Compute;

/// An operand element type.
pub(crate) trait Source: Copy + Send + Sync {
    /// The value rounded to `compute`, as f32 (exact widening).
    fn rounded(self, compute: Compute) -> f32;
    /// The value rounded to bf16, as bits.
    fn bf16_bits(self) -> u16;
    /// How a run of this type becomes its packed words for `compute` (`k_per_step` elements a word) in
    /// registers, so that it can be transposed into a panel where it lies: a plain load where it holds
    /// them already (f32 for f32 compute, bf16 pairs), else a conversion; `None` where there is none.
    fn register_load(compute: Compute, k_per_step: usize) -> Option<Load>;
}

impl Source for f32 {
    #[inline(always)]
    fn rounded(self, compute: Compute) -> f32 {
        match compute {
            Compute::F32 => self,
            Compute::F16 => bits::f16_rounded(self),
            Compute::Bf16 => f32::from_bits(u32::from(bits::bf16_bits(self)) << 16),
        }
    }
    #[inline(always)]
    fn bf16_bits(self) -> u16 {
        bits::bf16_bits(self)
    }
    #[inline(always)]
    fn register_load(compute: Compute, k_per_step: usize) -> Option<Load> {
        (k_per_step == 1).then(|| Load::from_f32(compute))
    }
}

impl Source for f16 {
    #[inline(always)]
    fn rounded(self, compute: Compute) -> f32 {
        match compute {
            Compute::F32 | Compute::F16 => bits::f16_to_f32(self),
            Compute::Bf16 => f32::from_bits(u32::from(bits::bf16_bits(bits::f16_to_f32(self))) << 16),
        }
    }
    #[inline(always)]
    fn bf16_bits(self) -> u16 {
        bits::bf16_bits(bits::f16_to_f32(self))
    }
    #[inline(always)]
    fn register_load(compute: Compute, k_per_step: usize) -> Option<Load> {
        (k_per_step == 1 && compute != Compute::Bf16).then_some(Load::F16ToF32)
    }
}

impl Source for bf16 {
    #[inline(always)]
    fn rounded(self, compute: Compute) -> f32 {
        match compute {
            Compute::F32 | Compute::Bf16 => self.to_f32(),
            Compute::F16 => bits::f16_rounded(self.to_f32()),
        }
    }
    #[inline(always)]
    fn bf16_bits(self) -> u16 {
        self.to_bits()
    }
    #[inline(always)]
    fn register_load(compute: Compute, k_per_step: usize) -> Option<Load> {
        match (k_per_step, compute) {
            // A pair word holds the even `k` in its low half: the little-endian order of the run.
            (2, _) => cfg!(target_endian = "little").then_some(Load::Words),
            (1, Compute::F32 | Compute::Bf16) => Some(Load::Bf16ToF32),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Source;
    use crate::gemm::Compute;

    #[test]
    fn f32_operands_are_rounded_to_the_compute_precision() {
        let x = 1.0 + 2f32.powi(-12);
        assert_eq!(x.rounded(Compute::F32), x);
        assert_eq!(x.rounded(Compute::F16), 1.0);
        assert_eq!(x.rounded(Compute::Bf16), 1.0);
        assert_eq!((1.0f32 + 2f32.powi(-9)).rounded(Compute::F16), 1.0 + 2f32.powi(-9));
    }
}
