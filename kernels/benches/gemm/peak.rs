//! The machine's own peaks: a loop of the instruction on independent accumulators, on both threads.

use std::fmt;
use std::time::Instant;

use amp_kernels::timing::median;

/// Peak samples in GFLOP/s, taken between shapes so that they see the same neighbours as the products.
#[derive(Default)]
pub struct Peaks {
    bf16: Vec<f64>,
    fma: Vec<f64>,
}

/// Accumulators per loop: more than latency x throughput of either instruction.
const ACC: usize = 24;
const ITERS: usize = 2_000_000;

impl Peaks {
    /// Takes one sample of each peak the CPU has.
    pub fn measure(&mut self) {
        if let Some(g) = on_two_threads(|| bf16_loop(ITERS), (ACC * 16 * 4) as f64) {
            self.bf16.push(g);
        }
        if let Some(g) = on_two_threads(|| fma_loop(ITERS), fma_flops_per_iter()) {
            self.fma.push(g);
        }
    }

    /// Median `vdpbf16ps` peak (GFLOP/s), if the CPU has the instruction.
    pub fn bf16(&self) -> Option<f64> {
        (!self.bf16.is_empty()).then(|| median(&self.bf16))
    }

    /// Median f32 FMA peak of the widest vectors the CPU has (GFLOP/s).
    pub fn fma(&self) -> Option<f64> {
        (!self.fma.is_empty()).then(|| median(&self.fma))
    }
}

impl fmt::Display for Peaks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |x: Option<f64>| x.map_or("not on this CPU".to_string(), |g| format!("{g:.0} GFLOP/s"));
        write!(
            f,
            "peaks (2 threads, median of {} samples): vdpbf16ps {}, {} FMA {}",
            self.fma.len(),
            show(self.bf16()),
            fma_name(),
            show(self.fma())
        )
    }
}

/// GFLOP/s of `f` run on two threads at once, each doing `ITERS` iterations of `flops_per_iter`.
fn on_two_threads(f: impl Fn() -> Option<f32> + Sync, flops_per_iter: f64) -> Option<f64> {
    f()?; // warm up, and find out whether the CPU has it
    let start = Instant::now();
    let (a, b) = rayon::join(&f, &f);
    let seconds = start.elapsed().as_secs_f64();
    std::hint::black_box((a, b));
    Some(2.0 * ITERS as f64 * flops_per_iter / seconds / 1e9)
}

#[cfg(target_arch = "x86_64")]
fn fma_name() -> &'static str {
    if amp_kernels::Isa::Avx512.is_supported() {
        "zmm"
    } else {
        "ymm"
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn fma_name() -> &'static str {
    "no"
}

#[cfg(target_arch = "x86_64")]
fn fma_flops_per_iter() -> f64 {
    let lanes = if amp_kernels::Isa::Avx512.is_supported() { 16 } else { 8 };
    (ACC / if lanes == 8 { 2 } else { 1 } * lanes * 2) as f64
}

#[cfg(not(target_arch = "x86_64"))]
fn fma_flops_per_iter() -> f64 {
    1.0
}

#[cfg(target_arch = "x86_64")]
fn bf16_loop(iters: usize) -> Option<f32> {
    // SAFETY: runs only where AVX512-BF16 is present.
    amp_kernels::Isa::Avx512Bf16.is_supported().then(|| unsafe { x86::dpbf16(iters) })
}

#[cfg(target_arch = "x86_64")]
fn fma_loop(iters: usize) -> Option<f32> {
    if amp_kernels::Isa::Avx512.is_supported() {
        // SAFETY: AVX-512 present.
        Some(unsafe { x86::fma_zmm(iters) })
    } else if amp_kernels::Isa::Avx2.is_supported() {
        // SAFETY: AVX2 + FMA present.
        Some(unsafe { x86::fma_ymm(iters) })
    } else {
        None
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn bf16_loop(_iters: usize) -> Option<f32> {
    None
}

#[cfg(not(target_arch = "x86_64"))]
fn fma_loop(_iters: usize) -> Option<f32> {
    None
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m512bh, __m512i, _mm256_add_ps, _mm256_fmadd_ps, _mm256_set1_ps, _mm256_storeu_ps, _mm512_add_ps,
        _mm512_dpbf16_ps, _mm512_fmadd_ps, _mm512_reduce_add_ps, _mm512_set1_epi32, _mm512_set1_ps,
    };

    use super::ACC;

    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn dpbf16(iters: usize) -> f32 {
        // Register retyping only.
        // SAFETY: retypes a register of 16 u32 as 32 bf16.
        let bh = |x: __m512i| unsafe { std::mem::transmute::<__m512i, __m512bh>(x) };
        let (x, y) = (bh(_mm512_set1_epi32(0x3F80_3F80)), bh(_mm512_set1_epi32(0x3A00_3A00)));
        let y = std::hint::black_box(y);
        let mut acc = [_mm512_set1_ps(0.0); ACC];
        for (i, a) in acc.iter_mut().enumerate() {
            *a = _mm512_set1_ps(i as f32); // distinct chains, so none can be merged
        }
        for _ in 0..iters {
            for a in &mut acc {
                *a = _mm512_dpbf16_ps(*a, x, y);
            }
        }
        let mut sum = _mm512_set1_ps(0.0);
        for a in acc {
            sum = _mm512_add_ps(sum, a);
        }
        _mm512_reduce_add_ps(sum)
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_zmm(iters: usize) -> f32 {
        let (x, y) = (_mm512_set1_ps(1.0), _mm512_set1_ps(1e-7));
        let y = std::hint::black_box(y);
        let mut acc = [_mm512_set1_ps(0.0); ACC];
        for (i, a) in acc.iter_mut().enumerate() {
            *a = _mm512_set1_ps(i as f32);
        }
        for _ in 0..iters {
            for a in &mut acc {
                *a = _mm512_fmadd_ps(x, y, *a);
            }
        }
        let mut sum = _mm512_set1_ps(0.0);
        for a in acc {
            sum = _mm512_add_ps(sum, a);
        }
        _mm512_reduce_add_ps(sum)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma_ymm(iters: usize) -> f32 {
        let (x, y) = (_mm256_set1_ps(1.0), _mm256_set1_ps(1e-7));
        let y = std::hint::black_box(y);
        let mut acc = [_mm256_set1_ps(0.0); ACC / 2];
        for (i, a) in acc.iter_mut().enumerate() {
            *a = _mm256_set1_ps(i as f32);
        }
        for _ in 0..iters {
            for a in &mut acc {
                *a = _mm256_fmadd_ps(x, y, *a);
            }
        }
        let mut sum = _mm256_set1_ps(0.0);
        for a in acc {
            sum = _mm256_add_ps(sum, a);
        }
        let mut out = [0.0f32; 8];
        // SAFETY: `out` holds 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), sum) };
        out.iter().sum()
    }
}
