//! Which micro-kernel computes a product, and why.

use std::fmt;

use super::layout::GemmError;
use crate::{Dtype, Isa};

/// What the products of a GEMM are computed from. Operands in another dtype are rounded to it (round to
/// nearest even, as `half` rounds) while they are packed; products are exact and summed in f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Compute {
    /// f32 operands (f16 and bf16 operands are widened, exactly).
    F32,
    /// Operands rounded to f16. Computed through f32 on every CPU path.
    F16,
    /// Operands rounded to bf16: `vdpbf16ps` where the CPU has it, f32 FMA on widened values elsewhere.
    Bf16,
}

/// A GEMM code path: a micro-kernel and the packing it reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmPath {
    /// AMX `tdpbf16ps`: 32 x 32 tiles of C in four tile registers, each instruction a 16 x 16 x 32
    /// product; A packed in groups of 16 steps, each one tile (16 rows x 32 `k`), B as for `vdpbf16ps`,
    /// `k` padded to multiples of 32. Bf16 products only.
    AmxBf16,
    /// The [`GemmPath::AmxBf16`] algorithm (same packing, padding, blocking, tiles and threading) with
    /// each tile product computed as Intel's pseudo-code for `tdpbf16ps` writes it
    /// ([`super::tdpbf16_pair`]). Runs on any CPU; not bit-identical to the hardware, whose summation
    /// order inside one instruction differs (both are held to the same f32 accumulation bound). Slow;
    /// for tests.
    AmxBf16Model,
    /// `vdpbf16ps`: 6 x 64 tiles of f32 accumulators, two bf16 products per lane per instruction, both
    /// operands packed with k-pairs interleaved. Bf16 products only.
    Avx512Bf16,
    /// The [`GemmPath::Avx512Bf16`] algorithm (same packing, blocking, tiles and threading) with each
    /// `vdpbf16ps` replaced by its software model ([`super::dpbf16_pair`]): bit-identical results on any
    /// CPU. Slow; for tests.
    Avx512Bf16Model,
    /// f32 FMA on zmm registers, 6 x 64 tiles; half operands widened while packing. A product of at
    /// most 16 rows (8 for an f32 B; `k` of at least 32 a row) whose B lies contiguous along `k` in a
    /// type it computes in exactly reads B in place instead, each element summed in 16 lanes (the same
    /// order on every FMA path).
    Avx512,
    /// The [`GemmPath::Avx512`] algorithm (same packing, blocking, tiles and threading) with portable
    /// fused multiply-adds in the same order: bit-identical results on any CPU. Slow; for tests.
    Avx512Model,
    /// f32 FMA on ymm registers, 6 x 16 tiles; half operands widened while packing. Products of few rows
    /// as on [`GemmPath::Avx512`], the 16 lanes in two ymm registers.
    Avx2,
    /// f32 fused multiply-adds in plain Rust, 6 x 16 tiles: bit-identical to [`GemmPath::Avx2`] and
    /// [`GemmPath::Avx512`], which perform the same FMAs in the same order.
    Portable,
}

impl GemmPath {
    /// Every path, fastest first.
    pub const ALL: [GemmPath; 8] = [
        GemmPath::AmxBf16,
        GemmPath::Avx512Bf16,
        GemmPath::Avx512,
        GemmPath::Avx2,
        GemmPath::Portable,
        GemmPath::Avx512Model,
        GemmPath::Avx512Bf16Model,
        GemmPath::AmxBf16Model,
    ];

    /// The fastest path this CPU has for `compute`: for bf16 AMX where the CPU has it, else the
    /// `vdpbf16ps` path where the CPU has it and it outruns the zmm FMA
    /// ([`super::dot_product_speedup`]), else the widest FMA path.
    #[must_use]
    pub fn choose(compute: Compute) -> GemmPath {
        let dot_pays = || super::dot_product_speedup().is_some_and(|r| r >= super::DOT_PAYS);
        let isa = match Isa::detect() {
            Isa::AmxBf16 if compute != Compute::Bf16 => Isa::Avx512,
            Isa::Avx512Bf16 if compute == Compute::Bf16 && !dot_pays() => Isa::Avx512,
            isa => isa,
        };
        GemmPath::choose_for(compute, isa)
    }

    /// The path [`GemmPath::choose`] picks on a CPU whose best level is `isa` and where `vdpbf16ps`
    /// pays.
    #[must_use]
    pub fn choose_for(compute: Compute, isa: Isa) -> GemmPath {
        match isa {
            Isa::AmxBf16 if compute == Compute::Bf16 => GemmPath::AmxBf16,
            Isa::Avx512Bf16 if compute == Compute::Bf16 => GemmPath::Avx512Bf16,
            Isa::AmxBf16 | Isa::Avx512Bf16 | Isa::Avx512 => GemmPath::Avx512,
            Isa::Avx2 => GemmPath::Avx2,
            Isa::Portable => GemmPath::Portable,
        }
    }

    /// The most rows of A for which this path reads B where it lies instead of packing it, for a B
    /// stored as `b` contiguous along `k` (a Linear's weight `(out, in)` read as `W^T`), products
    /// computed in `compute` and this `k`; `None` where it packs such a B whatever the rows. The FMA
    /// paths read it where `b` holds `compute`'s values exactly, for at most 16 rows (8 for an f32 B)
    /// and `k` of at least 32 for each row; the `vdpbf16ps` path a bf16 B when A lies along `k` too,
    /// AMX a bf16 B when `n` is at least 32 and nothing is skipped, each for at most 64 rows and `k`
    /// of at least 32.
    #[must_use]
    pub fn rows_read_in_place(self, compute: Compute, b: Dtype, k: usize) -> Option<usize> {
        let bf16_pairs = compute == Compute::Bf16 && b == Dtype::Bf16 && k >= 32;
        match self {
            GemmPath::Avx512 | GemmPath::Avx512Model | GemmPath::Avx2 | GemmPath::Portable => {
                super::few_rows::max_rows(compute, b, k)
            }
            GemmPath::Avx512Bf16 | GemmPath::Avx512Bf16Model => bf16_pairs.then_some(super::skinny::MAX_ROWS),
            GemmPath::AmxBf16 | GemmPath::AmxBf16Model => {
                bf16_pairs.then_some(super::driver::SKINNY_TILES_MAX_ROWS)
            }
        }
    }

    /// The instruction-set level this path needs.
    #[must_use]
    pub fn isa(self) -> Isa {
        match self {
            GemmPath::AmxBf16 => Isa::AmxBf16,
            GemmPath::Avx512Bf16 => Isa::Avx512Bf16,
            GemmPath::Avx512 => Isa::Avx512,
            GemmPath::Avx2 => Isa::Avx2,
            GemmPath::Portable
            | GemmPath::Avx512Model
            | GemmPath::Avx512Bf16Model
            | GemmPath::AmxBf16Model => Isa::Portable,
        }
    }

    /// Whether this path multiplies bf16 pairs (`vdpbf16ps`, AMX or their models) rather than f32
    /// values.
    #[must_use]
    pub fn is_bf16_dot(self) -> bool {
        matches!(
            self,
            GemmPath::AmxBf16 | GemmPath::AmxBf16Model | GemmPath::Avx512Bf16 | GemmPath::Avx512Bf16Model
        )
    }

    /// Whether this CPU can run the path.
    #[must_use]
    pub fn is_supported(self) -> bool {
        self.isa().is_supported()
    }

    /// Every path this CPU can run, fastest first.
    pub fn supported() -> impl Iterator<Item = GemmPath> {
        GemmPath::ALL.into_iter().filter(|p| p.is_supported())
    }

    /// Ok if this CPU runs the path and the path computes in `compute`.
    pub(crate) fn check(self, compute: Compute) -> Result<(), GemmError> {
        if !self.is_supported() {
            let reason = format!("this CPU lacks {} (see /proc/cpuinfo)", self.isa().features());
            return Err(GemmError::Unsupported { path: self, reason });
        }
        if self.is_bf16_dot() && compute != Compute::Bf16 {
            let reason = format!("it multiplies bf16 pairs only, and {compute:?} products were asked for");
            return Err(GemmError::Unsupported { path: self, reason });
        }
        Ok(())
    }
}

impl fmt::Display for GemmPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GemmPath::AmxBf16 => "amx-bf16 (tdpbf16ps)",
            GemmPath::AmxBf16Model => "amx-bf16 software model",
            GemmPath::Avx512Bf16 => "avx512-bf16 (vdpbf16ps)",
            GemmPath::Avx512Bf16Model => "avx512-bf16 software model",
            GemmPath::Avx512 => "avx512 f32 fma",
            GemmPath::Avx512Model => "avx512 f32 software model",
            GemmPath::Avx2 => "avx2 f32 fma",
            GemmPath::Portable => "portable f32 fma",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rows_read_in_place_are_those_each_path_takes() {
        use super::super::layout::{Dims, MatRef};
        use half::{bf16, f16};
        for k in [31, 32, 64, 128, 1024] {
            let len = 64 * k;
            let (w32, w16, wh) = (vec![0.0f32; len], vec![bf16::ZERO; len], vec![f16::ZERO; len]);
            let weights = [
                (Dtype::F32, MatRef::transposed(&w32[..], k)),
                (Dtype::Bf16, MatRef::transposed(&w16[..], k)),
                (Dtype::F16, MatRef::transposed(&wh[..], k)),
            ];
            let x = vec![0.0f32; 65 * k];
            let a = MatRef::row_major(&x[..], k);
            for compute in [Compute::F32, Compute::F16, Compute::Bf16] {
                for (dtype, b) in &weights {
                    let rows = GemmPath::Avx2.rows_read_in_place(compute, *dtype, k);
                    let dot_rows = GemmPath::Avx512Bf16.rows_read_in_place(compute, *dtype, k);
                    for m in [1, 2, 4, 8, 9, 16, 17, 64, 65] {
                        let dims = Dims::new(m, 64, k);
                        let fma = super::super::few_rows::reads(compute, dims, b);
                        assert_eq!(fma, rows.is_some_and(|r| m <= r), "FMA {compute:?} {dtype:?} {m} x {k}");
                        let dot = super::super::skinny::reads(compute, dims, &a, b);
                        assert_eq!(
                            dot,
                            dot_rows.is_some_and(|r| m <= r),
                            "dot {compute:?} {dtype:?} {m} x {k}"
                        );
                    }
                }
            }
        }
        assert_eq!(GemmPath::Portable.rows_read_in_place(Compute::F32, Dtype::F32, 1024), Some(8));
        assert_eq!(GemmPath::Avx512.rows_read_in_place(Compute::Bf16, Dtype::Bf16, 1024), Some(16));
        assert_eq!(GemmPath::Avx512.rows_read_in_place(Compute::Bf16, Dtype::Bf16, 128), Some(4));
        assert_eq!(GemmPath::Avx512.rows_read_in_place(Compute::Bf16, Dtype::F32, 1024), None);
        assert_eq!(GemmPath::Avx512.rows_read_in_place(Compute::F32, Dtype::F32, 31), None);
        assert_eq!(GemmPath::AmxBf16.rows_read_in_place(Compute::Bf16, Dtype::Bf16, 1024), Some(64));
        assert_eq!(GemmPath::AmxBf16Model.rows_read_in_place(Compute::F32, Dtype::Bf16, 1024), None);
    }

    #[test]
    fn bf16_products_take_the_dot_product_only_where_the_cpu_has_it() {
        assert_eq!(GemmPath::choose_for(Compute::Bf16, Isa::AmxBf16), GemmPath::AmxBf16);
        assert_eq!(GemmPath::choose_for(Compute::F16, Isa::AmxBf16), GemmPath::Avx512);
        assert_eq!(GemmPath::choose_for(Compute::F32, Isa::AmxBf16), GemmPath::Avx512);
        assert_eq!(GemmPath::choose_for(Compute::Bf16, Isa::Avx512Bf16), GemmPath::Avx512Bf16);
        assert_eq!(GemmPath::choose_for(Compute::Bf16, Isa::Avx512), GemmPath::Avx512);
        assert_eq!(GemmPath::choose_for(Compute::Bf16, Isa::Avx2), GemmPath::Avx2);
        assert_eq!(GemmPath::choose_for(Compute::F16, Isa::Avx512Bf16), GemmPath::Avx512);
        assert_eq!(GemmPath::choose_for(Compute::F32, Isa::Avx512Bf16), GemmPath::Avx512);
        assert_eq!(GemmPath::choose_for(Compute::F32, Isa::Portable), GemmPath::Portable);
    }

    #[test]
    fn the_bf16_models_run_everywhere_but_only_for_bf16_products() {
        for model in [GemmPath::Avx512Bf16Model, GemmPath::AmxBf16Model] {
            assert!(model.check(Compute::Bf16).is_ok());
            let err = model.check(Compute::F32).unwrap_err();
            assert!(err.to_string().contains("bf16 pairs only"), "{err}");
        }
    }

    #[test]
    fn the_zmm_fma_model_runs_everywhere_for_every_compute() {
        for compute in [Compute::F32, Compute::F16, Compute::Bf16] {
            assert!(GemmPath::Avx512Model.check(compute).is_ok());
        }
        assert!(!GemmPath::Avx512Model.is_bf16_dot());
    }

    #[test]
    fn the_chosen_path_is_always_supported() {
        for compute in [Compute::F32, Compute::F16, Compute::Bf16] {
            assert!(GemmPath::choose(compute).check(compute).is_ok());
        }
    }
}
