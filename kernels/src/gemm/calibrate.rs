//! Whether `vdpbf16ps` pays on this CPU, measured once per process.
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

/// Iterations per trial: 24 instructions each, ~0.1 ms.
const ITERS: usize = 4_000;
const TRIALS: usize = 7;

fn measure() -> Option<f64> {
    if !Isa::Avx512Bf16.is_supported() {
        return None;
    }
    let (mut dot, mut fma) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..TRIALS {
        dot = dot.min(time(|| loops::dpbf16(ITERS)));
        fma = fma.min(time(|| loops::fma(ITERS)));
    }
    // Per instruction: vdpbf16ps does 64 flops on a zmm, vfmadd 32.
    Some((64.0 / dot) / (32.0 / fma))
}

fn time(f: impl Fn() -> f32) -> f64 {
    let start = Instant::now();
    std::hint::black_box(f());
    start.elapsed().as_secs_f64()
}

#[cfg(target_arch = "x86_64")]
mod loops {
    use std::arch::x86_64::{
        __m512, __m512bh, __m512i, _mm512_add_ps, _mm512_dpbf16_ps, _mm512_fmadd_ps, _mm512_reduce_add_ps,
        _mm512_set1_epi32, _mm512_set1_ps,
    };

    const ACC: usize = 24;

    fn sum(acc: [__m512; ACC]) -> f32 {
        // SAFETY: reached only from the loops below, which run only where AVX-512 is present.
        unsafe { reduce(acc) }
    }

    #[target_feature(enable = "avx512f")]
    fn reduce(acc: [__m512; ACC]) -> f32 {
        let mut s = _mm512_set1_ps(0.0);
        for a in acc {
            s = _mm512_add_ps(s, a);
        }
        _mm512_reduce_add_ps(s)
    }

    pub(super) fn dpbf16(iters: usize) -> f32 {
        // SAFETY: `measure` calls this only where AVX512-BF16 is present.
        sum(unsafe { dpbf16_loop(iters) })
    }

    pub(super) fn fma(iters: usize) -> f32 {
        // SAFETY: AVX512-BF16 implies AVX-512F.
        sum(unsafe { fma_loop(iters) })
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    fn dpbf16_loop(iters: usize) -> [__m512; ACC] {
        // SAFETY: retypes registers of 16 u32 as 32 bf16.
        let bh = |x: __m512i| unsafe { std::mem::transmute::<__m512i, __m512bh>(x) };
        let (x, y) =
            (bh(_mm512_set1_epi32(0x3F80_3F80)), std::hint::black_box(bh(_mm512_set1_epi32(0x3A00_3A00))));
        let mut acc = [_mm512_set1_ps(0.0); ACC];
        for (i, a) in acc.iter_mut().enumerate() {
            *a = _mm512_set1_ps(i as f32); // distinct chains: none can be merged
        }
        for _ in 0..iters {
            for a in &mut acc {
                *a = _mm512_dpbf16_ps(*a, x, y);
            }
        }
        acc
    }

    #[target_feature(enable = "avx512f")]
    fn fma_loop(iters: usize) -> [__m512; ACC] {
        let (x, y) = (_mm512_set1_ps(1.0), std::hint::black_box(_mm512_set1_ps(1e-7)));
        let mut acc = [_mm512_set1_ps(0.0); ACC];
        for (i, a) in acc.iter_mut().enumerate() {
            *a = _mm512_set1_ps(i as f32);
        }
        for _ in 0..iters {
            for a in &mut acc {
                *a = _mm512_fmadd_ps(x, y, *a);
            }
        }
        acc
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod loops {
    pub(super) fn dpbf16(_iters: usize) -> f32 {
        unreachable!("AVX512-BF16 exists only on x86-64")
    }

    pub(super) fn fma(_iters: usize) -> f32 {
        unreachable!("AVX512-BF16 exists only on x86-64")
    }
}
