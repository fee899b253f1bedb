//! Whether `vdpbf16ps` pays on this CPU, measured once per process, and the instruction loops that
//! measure it (the GEMM bench times the same loops on both threads for its "% of peak" column).
//!
//! One `vdpbf16ps` does two multiply-adds per lane, so it should double the zmm FMA's rate; on some CPUs
//! that have it the instruction issues at half the FMA's rate or less (measured on an Intel Xeon with
//! AVX512-BF16: 0.5x the FMA's flops), and bf16 products are then faster widened to f32 on the FMA path.
//! The first bf16 product times a short loop of each instruction on independent accumulators (a few
//! hundred microseconds, best of several alternating trials) and keeps the ratio. The decision has a wide
//! margin ([`DOT_PAYS`]), so it does not flip between runs on a given CPU: each CPU's ratio sits far from
//! it (0.5x, or 1.7x on AMD Zen 5).

use std::sync::OnceLock;
use std::time::Instant;

use crate::Isa;

/// The `vdpbf16ps` / FMA flop-rate ratio above which the dot-product path is chosen for bf16.
pub const DOT_PAYS: f64 = 1.2;

/// `vdpbf16ps` flops per second over zmm FMA flops per second on this CPU (one thread), or `None`
/// without AVX512-BF16. Measured on the first call.
#[must_use]
pub fn dot_product_speedup() -> Option<f64> {
    static RATIO: OnceLock<Option<f64>> = OnceLock::new();
    *RATIO.get_or_init(measure)
}

/// Iterations per calibration trial: 24 instructions each, ~0.1 ms.
const ITERS: usize = 4_000;
const TRIALS: usize = 7;

fn measure() -> Option<f64> {
    let (mut dot, mut fma) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..TRIALS {
        dot = dot.min(PeakLoop::Dpbf16.seconds(ITERS)?);
        fma = fma.min(PeakLoop::FmaZmm.seconds(ITERS)?);
    }
    let flops = |l: PeakLoop, s: f64| l.flops_per_iter() / s;
    Some(flops(PeakLoop::Dpbf16, dot) / flops(PeakLoop::FmaZmm, fma))
}

/// A loop of one instruction on 24 independent accumulators: the instruction's peak rate on one thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeakLoop {
    /// `vdpbf16ps zmm` (64 flops).
    Dpbf16,
    /// `vfmadd231ps zmm` (32 flops).
    FmaZmm,
    /// `vfmadd231ps ymm` (16 flops).
    FmaYmm,
    /// AMX `tdpbf16ps` on four independent 16 x 16 accumulator tiles (16,384 flops each); four per
    /// iteration.
    TileAmx,
    /// The AMX kernel's step on operands that stay in L1: two A and two B tiles loaded and the four
    /// `tdpbf16ps` they feed, per iteration. Not an instruction's peak but the bound of a 2 x 2 tile
    /// loop: a tile load waits for the earlier products that read its register, so on the Xeon
    /// measured most of the loads' time adds to the products' (80% of the instruction's peak).
    TileStepAmx,
}

/// Accumulators per loop: more than latency x throughput of any of the instructions.
const ACC: usize = 24;

impl PeakLoop {
    /// The level the instruction needs.
    #[must_use]
    pub fn isa(self) -> Isa {
        match self {
            PeakLoop::Dpbf16 => Isa::Avx512Bf16,
            PeakLoop::FmaZmm => Isa::Avx512,
            PeakLoop::FmaYmm => Isa::Avx2,
            PeakLoop::TileAmx | PeakLoop::TileStepAmx => Isa::AmxBf16,
        }
    }

    /// Floating-point operations per iteration (24 vector instructions, or 4 tile products).
    #[must_use]
    pub fn flops_per_iter(self) -> f64 {
        let (instructions, per_instruction) = match self {
            PeakLoop::Dpbf16 => (ACC, 16 * 2 * 2),
            PeakLoop::FmaZmm => (ACC, 16 * 2),
            PeakLoop::FmaYmm => (ACC, 8 * 2),
            PeakLoop::TileAmx | PeakLoop::TileStepAmx => (4, 16 * 16 * 32 * 2),
        };
        (instructions * per_instruction) as f64
    }

    /// Seconds for `iters` iterations on this thread, or `None` where the CPU lacks the instruction.
    #[must_use]
    pub fn seconds(self, iters: usize) -> Option<f64> {
        if !self.isa().is_supported() {
            return None;
        }
        let start = Instant::now();
        std::hint::black_box(loops::run(self, iters));
        Some(start.elapsed().as_secs_f64())
    }
}

#[cfg(target_arch = "x86_64")]
mod loops {
    use std::arch::x86_64::{
        __m256, __m512, __m512bh, __m512i, _mm256_fmadd_ps, _mm256_set1_ps, _mm512_dpbf16_ps,
        _mm512_fmadd_ps, _mm512_set1_epi32, _mm512_set1_ps,
    };

    use super::{PeakLoop, ACC};

    /// Runs the loop and folds its accumulators into one number, so that nothing is optimised away
    /// (the tile loop is assembly, which is never removed). Each loop folds its own registers: no
    /// vector of a width the CPU may lack is touched outside the function that needs it.
    pub(super) fn run(kind: PeakLoop, iters: usize) -> f32 {
        // SAFETY: `PeakLoop::seconds` calls this only where `kind.isa()` is supported.
        unsafe {
            match kind {
                PeakLoop::Dpbf16 => dpbf16(iters),
                PeakLoop::FmaZmm => fma_zmm(iters),
                PeakLoop::FmaYmm => fma_ymm(iters),
                PeakLoop::TileAmx => {
                    crate::gemm::tile_peak_loop(iters);
                    0.0
                }
                PeakLoop::TileStepAmx => {
                    crate::gemm::tile_step_loop(iters);
                    0.0
                }
            }
        }
    }

    /// The sum of every lane of every accumulator.
    #[target_feature(enable = "avx512f")]
    fn fold_zmm(acc: &[__m512; ACC]) -> f32 {
        // SAFETY: a register of 16 f32 has the layout of `[f32; 16]`.
        acc.iter().flat_map(|a| unsafe { std::mem::transmute::<__m512, [f32; 16]>(*a) }).sum()
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    fn dpbf16(iters: usize) -> f32 {
        // SAFETY: retypes registers of 16 u32 as 32 bf16.
        let bh = |x: __m512i| unsafe { std::mem::transmute::<__m512i, __m512bh>(x) };
        let (x, y) =
            (bh(_mm512_set1_epi32(0x3F80_3F80)), std::hint::black_box(bh(_mm512_set1_epi32(0x3A00_3A00))));
        // Distinct starting values: no two chains can be merged.
        let mut acc: [__m512; ACC] = std::array::from_fn(|i| _mm512_set1_ps(i as f32));
        for _ in 0..iters {
            for a in &mut acc {
                *a = _mm512_dpbf16_ps(*a, x, y);
            }
        }
        fold_zmm(&acc)
    }

    #[target_feature(enable = "avx512f")]
    fn fma_zmm(iters: usize) -> f32 {
        let (x, y) = (_mm512_set1_ps(1.0), std::hint::black_box(_mm512_set1_ps(1e-7)));
        let mut acc: [__m512; ACC] = std::array::from_fn(|i| _mm512_set1_ps(i as f32));
        for _ in 0..iters {
            for a in &mut acc {
                *a = _mm512_fmadd_ps(x, y, *a);
            }
        }
        fold_zmm(&acc)
    }

    #[target_feature(enable = "avx2,fma")]
    fn fma_ymm(iters: usize) -> f32 {
        let (x, y) = (_mm256_set1_ps(1.0), std::hint::black_box(_mm256_set1_ps(1e-7)));
        let mut acc: [__m256; ACC] = std::array::from_fn(|i| _mm256_set1_ps(i as f32));
        for _ in 0..iters {
            for a in &mut acc {
                *a = _mm256_fmadd_ps(x, y, *a);
            }
        }
        // SAFETY: a register of 8 f32 has the layout of `[f32; 8]`.
        acc.iter().flat_map(|a| unsafe { std::mem::transmute::<__m256, [f32; 8]>(*a) }).sum()
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod loops {
    use super::PeakLoop;

    pub(super) fn run(_kind: PeakLoop, _iters: usize) -> f32 {
        unreachable!("the peak loops exist only on x86-64, and PeakLoop::seconds checks for them")
    }
}

#[cfg(test)]
mod tests {
    use super::PeakLoop;

    /// Every loop runs where its instruction exists and is refused where it does not. On a CPU without
    /// AVX-512 this once died of an illegal instruction in the ymm loop, whose caller built zmm
    /// registers for the loops it did not run.
    #[test]
    fn every_loop_runs_or_is_refused_on_this_cpu() {
        let kinds =
            [PeakLoop::Dpbf16, PeakLoop::FmaZmm, PeakLoop::FmaYmm, PeakLoop::TileAmx, PeakLoop::TileStepAmx];
        for kind in kinds {
            let seconds = kind.seconds(10);
            assert_eq!(seconds.is_some(), kind.isa().is_supported(), "{kind:?}");
            assert!(seconds.is_none_or(|s| s > 0.0), "{kind:?}: {seconds:?}");
        }
        let ratio = super::dot_product_speedup();
        assert_eq!(
            ratio.is_some(),
            PeakLoop::Dpbf16.isa().is_supported() && PeakLoop::FmaZmm.isa().is_supported()
        );
    }
}
