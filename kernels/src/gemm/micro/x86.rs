//! x86-64 micro-kernels: f32 FMA on ymm (AVX2) and zmm (AVX-512) registers, and `vdpbf16ps`.
//!
//! Each keeps its whole tile of C in registers: 6 rows x 2 ymm (12 accumulators) for AVX2, 6 rows x 4
//! zmm (24 accumulators) for AVX-512. Per step it loads the B micro-panel's vectors once and broadcasts
//! each of the 6 A values (for `vdpbf16ps`, each 32-bit bf16 pair) against them.

use std::arch::x86_64::{
    __m256, __m512, __m512bh, _mm256_broadcast_ss, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_setzero_ps,
    _mm256_storeu_ps, _mm512_dpbf16_ps, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_loadu_si512,
    _mm512_set1_epi32, _mm512_set1_ps, _mm512_setzero_ps, _mm512_storeu_ps,
};

use super::{Blocking, Micro, F32_6X16, F32_6X64, PAIRS_6X64};
use crate::Isa;

/// f32 FMA on ymm registers, 6 x 16 tiles. Constructible only where AVX2 + FMA run.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FmaAvx2(());

/// f32 FMA on zmm registers, 6 x 64 tiles. Constructible only where AVX-512 runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FmaAvx512(());

/// `vdpbf16ps`, 6 x 64 tiles of bf16 pairs. Constructible only where AVX512-BF16 runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DotAvx512Bf16(());

impl FmaAvx2 {
    pub(crate) fn new() -> Option<Self> {
        Isa::Avx2.is_supported().then_some(FmaAvx2(()))
    }
}

impl FmaAvx512 {
    pub(crate) fn new() -> Option<Self> {
        Isa::Avx512.is_supported().then_some(FmaAvx512(()))
    }
}

impl DotAvx512Bf16 {
    pub(crate) fn new() -> Option<Self> {
        Isa::Avx512Bf16.is_supported().then_some(DotAvx512Bf16(()))
    }
}

impl Micro for FmaAvx2 {
    type Packed = f32;
    const B: Blocking = F32_6X16;

    unsafe fn tile(self, steps: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, load: bool) {
        // SAFETY: a `FmaAvx2` exists only where AVX2 and FMA run; pointers as the caller guarantees.
        unsafe { fma_6x16(steps, a, b, c, ldc, load) }
    }
}

impl Micro for FmaAvx512 {
    type Packed = f32;
    const B: Blocking = F32_6X64;

    unsafe fn tile(self, steps: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, load: bool) {
        // SAFETY: a `FmaAvx512` exists only where AVX-512 runs; pointers as the caller guarantees.
        unsafe { fma_6x64(steps, a, b, c, ldc, load) }
    }
}

impl Micro for DotAvx512Bf16 {
    type Packed = u32;
    const B: Blocking = PAIRS_6X64;

    unsafe fn tile(self, steps: usize, a: *const u32, b: *const u32, c: *mut f32, ldc: usize, load: bool) {
        // SAFETY: a `DotAvx512Bf16` exists only where AVX512-BF16 runs; pointers as the caller guarantees.
        unsafe { dot_6x64(steps, a, b, c, ldc, load) }
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn fma_6x16(steps: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, load: bool) {
    let mut acc = [[_mm256_setzero_ps(); 2]; 6];
    // SAFETY (whole body): pointers valid as `Micro::tile` requires.
    unsafe {
        if load {
            for (r, row) in acc.iter_mut().enumerate() {
                for (j, x) in row.iter_mut().enumerate() {
                    *x = _mm256_loadu_ps(c.add(r * ldc + 8 * j));
                }
            }
        }
        for s in 0..steps {
            let (a, b) = (a.add(s * 6), b.add(s * 16));
            let bv: [__m256; 2] = [_mm256_loadu_ps(b), _mm256_loadu_ps(b.add(8))];
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm256_broadcast_ss(&*a.add(r));
                for (x, &bj) in row.iter_mut().zip(&bv) {
                    *x = _mm256_fmadd_ps(av, bj, *x);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (j, &x) in row.iter().enumerate() {
                _mm256_storeu_ps(c.add(r * ldc + 8 * j), x);
            }
        }
    }
}

#[target_feature(enable = "avx512f")]
unsafe fn fma_6x64(steps: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, load: bool) {
    // SAFETY (whole body): pointers valid as `Micro::tile` requires.
    unsafe {
        let mut acc = zmm_tile(c, ldc, load);
        for s in 0..steps {
            let (a, b) = (a.add(s * 6), b.add(s * 64));
            let bv: [__m512; 4] = [
                _mm512_loadu_ps(b),
                _mm512_loadu_ps(b.add(16)),
                _mm512_loadu_ps(b.add(32)),
                _mm512_loadu_ps(b.add(48)),
            ];
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*a.add(r));
                for (x, &bj) in row.iter_mut().zip(&bv) {
                    *x = _mm512_fmadd_ps(av, bj, *x);
                }
            }
        }
        store_zmm_tile(&acc, c, ldc);
    }
}

#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dot_6x64(steps: usize, a: *const u32, b: *const u32, c: *mut f32, ldc: usize, load: bool) {
    // SAFETY (whole body): pointers valid as `Micro::tile` requires. A zmm of 16 u32 is a zmm of 32 bf16
    // (element 2i in the low half of dword i): the transmutes only retype registers.
    unsafe {
        let mut acc = zmm_tile(c, ldc, load);
        for s in 0..steps {
            let (a, b) = (a.add(s * 6), b.add(s * 64));
            let bv: [__m512bh; 4] = std::mem::transmute([
                _mm512_loadu_si512(b.cast()),
                _mm512_loadu_si512(b.add(16).cast()),
                _mm512_loadu_si512(b.add(32).cast()),
                _mm512_loadu_si512(b.add(48).cast()),
            ]);
            for (r, row) in acc.iter_mut().enumerate() {
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a.add(r) as i32));
                for (x, &bj) in row.iter_mut().zip(&bv) {
                    *x = _mm512_dpbf16_ps(*x, av, bj);
                }
            }
        }
        store_zmm_tile(&acc, c, ldc);
    }
}

/// The 6 x 64 f32 tile of C at `c` (row stride `ldc`) in 24 zmm accumulators: loaded when `load`, else
/// zeros.
///
/// # Safety
/// With `load`, `c` must be valid for reads of 6 rows of 64 values `ldc` apart.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn zmm_tile(c: *const f32, ldc: usize, load: bool) -> [[__m512; 4]; 6] {
    let mut acc = [[_mm512_setzero_ps(); 4]; 6];
    if load {
        for (r, row) in acc.iter_mut().enumerate() {
            for (j, x) in row.iter_mut().enumerate() {
                // SAFETY: in bounds as the caller guarantees.
                *x = unsafe { _mm512_loadu_ps(c.add(r * ldc + 16 * j)) };
            }
        }
    }
    acc
}

/// Stores 24 zmm accumulators into the 6 x 64 f32 tile of C at `c` (row stride `ldc`).
///
/// # Safety
/// `c` must be valid for writes of 6 rows of 64 values `ldc` apart.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_zmm_tile(acc: &[[__m512; 4]; 6], c: *mut f32, ldc: usize) {
    for (r, row) in acc.iter().enumerate() {
        for (j, &x) in row.iter().enumerate() {
            // SAFETY: in bounds as the caller guarantees.
            unsafe { _mm512_storeu_ps(c.add(r * ldc + 16 * j), x) };
        }
    }
}
