//! x86-64 micro-kernels: f32 FMA on ymm (AVX2) and zmm (AVX-512) registers, and `vdpbf16ps`.
//!
//! Each keeps its whole tile of C in registers: 6 rows x 2 ymm (12 accumulators) for AVX2, 6 rows x 4
//! zmm (24 accumulators) for AVX-512. Per step it loads the B micro-panel's vectors once and broadcasts
//! each of the 6 A values (for `vdpbf16ps`, each 32-bit bf16 pair) against them.

use std::arch::x86_64::{
    __m128i, __m256, __m256i, __m512, __m512bh, _mm256_broadcast_ss, _mm256_castps_si256,
    _mm256_castsi256_si128, _mm256_cvtps_ph, _mm256_extracti128_si256, _mm256_fmadd_ps, _mm256_loadu_ps,
    _mm256_setzero_ps, _mm256_srli_epi32, _mm256_storeu_ps, _mm256_storeu_si256, _mm512_add_epi32,
    _mm512_and_si512, _mm512_castps_si512, _mm512_cmpgt_epu32_mask, _mm512_cvtepi32_epi16, _mm512_cvtps_ph,
    _mm512_dpbf16_ps, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_loadu_si512, _mm512_mask_blend_epi32,
    _mm512_or_si512, _mm512_set1_epi32, _mm512_set1_ps, _mm512_setzero_ps, _mm512_srli_epi32,
    _mm512_storeu_ps, _mm_packus_epi32, _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
};

use super::{Blocking, HalfC, Micro, TileFrom, F32_6X16, F32_6X64, PAIRS_6X64};
use crate::gemm::row_load::x86::bf16_rounded;
use crate::Isa;

/// f32 FMA on ymm registers, 6 x 16 tiles. Constructible only where AVX2, FMA and F16C run.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FmaAvx2(());

/// f32 FMA on zmm registers, 6 x 64 tiles. Constructible only where AVX-512 runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FmaAvx512(());

/// `vdpbf16ps`, 6 x 64 tiles of bf16 pairs. Constructible only where AVX512-BF16 runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DotAvx512Bf16(());

/// A register kernel's constructor (which checks the CPU) and its [`Micro`] methods, each a call of
/// `$kernel` with the tile's start and destination.
macro_rules! register_kernel {
    ($name:ident, $isa:expr, $packed:ty, $blocking:expr, $kernel:ident) => {
        impl $name {
            pub(crate) fn new() -> Option<Self> {
                $isa.is_supported().then_some($name(()))
            }
        }

        // SAFETY (every call of the kernel below): a value of this type exists only where its
        // instructions run (`new` checks); pointers as the caller guarantees.
        impl Micro for $name {
            type Packed = $packed;
            const B: Blocking = $blocking;

            unsafe fn tile(
                self,
                steps: usize,
                a: *const $packed,
                b: *const $packed,
                c: *mut f32,
                ldc: usize,
                load: bool,
            ) {
                let from = if load { TileFrom::Tile } else { TileFrom::Zero };
                unsafe { $kernel(steps, a, b, (c, ldc), from, TileOut::F32) }
            }

            unsafe fn tile_from_row(
                self,
                steps: usize,
                a: *const $packed,
                b: *const $packed,
                c: *mut f32,
                ldc: usize,
                row: *const f32,
            ) {
                unsafe { $kernel(steps, a, b, (c, ldc), TileFrom::Row(row), TileOut::F32) }
            }

            unsafe fn tile_to_half<H: HalfC>(
                self,
                steps: usize,
                a: *const $packed,
                b: *const $packed,
                c: (*mut f32, usize),
                from: TileFrom,
                (out, ldo): (*mut H, usize),
            ) {
                let out = TileOut::Half { ptr: out.cast(), ldo, bf16: H::BF16 };
                unsafe { $kernel(steps, a, b, c, from, out) }
            }
        }
    };
}

register_kernel!(FmaAvx2, Isa::Avx2, f32, F32_6X16, fma_6x16);
register_kernel!(FmaAvx512, Isa::Avx512, f32, F32_6X64, fma_6x64);
register_kernel!(DotAvx512Bf16, Isa::Avx512Bf16, u32, PAIRS_6X64, dot_6x64);

/// Where a tile's sums go: back to the f32 tile at `c`, or rounded into half-precision C.
#[derive(Clone, Copy)]
enum TileOut {
    F32,
    /// The tile's rows of bf16 (`bf16`) or f16 values, `ldo` elements apart.
    Half {
        ptr: *mut u16,
        ldo: usize,
        bf16: bool,
    },
}

/// The 6 x 16 tile from zeros, from C, or from a row of 16 floats (a bias: loaded into the
/// accumulators, not copied into C first and read back); its sums stored into the f32 tile at `c` or
/// rounded from the registers into half-precision C (as `half`'s `from_f32`: F16C for f16).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fma_6x16(
    steps: usize,
    a: *const f32,
    b: *const f32,
    (c, ldc): (*mut f32, usize),
    from: TileFrom,
    out: TileOut,
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; 6];
    // SAFETY (whole body): pointers valid as `Micro::tile` / `Micro::tile_from_row` require.
    unsafe {
        match from {
            TileFrom::Zero => {}
            TileFrom::Tile => {
                for (r, row) in acc.iter_mut().enumerate() {
                    for (j, x) in row.iter_mut().enumerate() {
                        *x = _mm256_loadu_ps(c.add(r * ldc + 8 * j));
                    }
                }
            }
            TileFrom::Row(bias) => {
                let start = [_mm256_loadu_ps(bias), _mm256_loadu_ps(bias.add(8))];
                acc = [start; 6];
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
        store_tile::<Ymm, 2>(&acc, (c, ldc), out);
    }
}

/// 8 floats rounded to bf16 bits, as `half`'s `bf16::from_f32` does: the ymm form of [`bf16_bits`].
///
/// # Safety
/// AVX2 available (inlined into the kernel, whose target features it takes).
#[inline(always)]
unsafe fn bf16_bits_8(x: __m256) -> __m128i {
    // SAFETY (whole body): AVX2, as the caller guarantees. The rounded values fit in 16 bits, so the
    // saturating pack only narrows them.
    unsafe {
        let bits = _mm256_srli_epi32::<16>(bf16_rounded(_mm256_castps_si256(x)));
        _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256::<1>(bits))
    }
}

#[target_feature(enable = "avx512f")]
unsafe fn fma_6x64(
    steps: usize,
    a: *const f32,
    b: *const f32,
    (c, ldc): (*mut f32, usize),
    from: TileFrom,
    out: TileOut,
) {
    // SAFETY (whole body): pointers valid as `Micro::tile` / `Micro::tile_to_half` require.
    unsafe {
        let mut acc = zmm_tile(c, ldc, from);
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
        store_tile::<Zmm, 4>(&acc, (c, ldc), out);
    }
}

#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dot_6x64(
    steps: usize,
    a: *const u32,
    b: *const u32,
    (c, ldc): (*mut f32, usize),
    from: TileFrom,
    out: TileOut,
) {
    // SAFETY (whole body): pointers valid as `Micro::tile` / `Micro::tile_to_half` require. A zmm of 16
    // u32 is a zmm of 32 bf16 (element 2i in the low half of dword i): the transmutes only retype
    // registers.
    unsafe {
        let mut acc = zmm_tile(c, ldc, from);
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
        store_tile::<Zmm, 4>(&acc, (c, ldc), out);
    }
}

/// The 6 x 64 tile's starting sums in 24 zmm accumulators: zeros, the f32 tile at `c` (row stride
/// `ldc`), or a row of 64 floats in every row.
///
/// # Safety
/// AVX-512 available (inlined into the kernels, whose target features it takes: the accumulators stay
/// in registers). With `TileFrom::Tile`, `c` must be valid for reads of 6 rows of 64 values `ldc`
/// apart; a `TileFrom::Row` holds 64 floats.
#[inline(always)]
unsafe fn zmm_tile(c: *const f32, ldc: usize, from: TileFrom) -> [[__m512; 4]; 6] {
    // SAFETY (whole body): AVX-512 and pointers as the caller guarantees.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); 4]; 6];
        match from {
            TileFrom::Zero => {}
            TileFrom::Tile => {
                for (r, row) in acc.iter_mut().enumerate() {
                    for (j, x) in row.iter_mut().enumerate() {
                        *x = _mm512_loadu_ps(c.add(r * ldc + 16 * j));
                    }
                }
            }
            TileFrom::Row(start) => {
                for row in &mut acc {
                    for (j, x) in row.iter_mut().enumerate() {
                        *x = _mm512_loadu_ps(start.add(16 * j));
                    }
                }
            }
        }
        acc
    }
}

/// Stores a tile's accumulators (6 rows of `J` registers): into the f32 tile at `c` (row stride
/// `ldc`), or rounded into half-precision C.
///
/// # Safety
/// The register width's extensions available (inlined into the kernels, whose target features it
/// takes: the accumulators stay in registers); the destination is valid for writes of 6 rows of `J *
/// W::LANES` values at its row stride.
#[inline(always)]
unsafe fn store_tile<W: Width, const J: usize>(
    acc: &[[W::V; J]; 6],
    (c, ldc): (*mut f32, usize),
    out: TileOut,
) {
    // One loop per destination (each unrolled whole, so the accumulators stay in registers).
    // SAFETY (whole body): extensions and bounds as the caller guarantees.
    unsafe {
        let lanes = W::LANES;
        match out {
            TileOut::F32 => {
                for (r, row) in acc.iter().enumerate() {
                    for (j, &x) in row.iter().enumerate() {
                        W::store_f32(c.add(r * ldc + lanes * j), x);
                    }
                }
            }
            TileOut::Half { ptr, ldo, bf16: true } => {
                for (r, row) in acc.iter().enumerate() {
                    for (j, &x) in row.iter().enumerate() {
                        W::store_bf16(ptr.add(r * ldo + lanes * j), x);
                    }
                }
            }
            TileOut::Half { ptr, ldo, bf16: false } => {
                for (r, row) in acc.iter().enumerate() {
                    for (j, &x) in row.iter().enumerate() {
                        W::store_f16(ptr.add(r * ldo + lanes * j), x);
                    }
                }
            }
        }
    }
}

/// Rounds `rows` rows of 32 f32 (`lds` apart) into half-precision rows (`ldo` apart; bf16 if `bf16`,
/// else f16), as `half`'s `from_f32` does: the AMX kernel's tiles, stored as f32 and rounded here, two
/// zmm a row, where a generic row-by-row conversion cost a fifth of a bf16-output product.
///
/// # Safety
/// AVX-512 available; `src` valid for reads and `out` for writes of `rows` rows of 32 values at their
/// strides.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn round_rows_32(
    rows: usize,
    (src, lds): (*const f32, usize),
    (out, ldo): (*mut u16, usize),
    bf16: bool,
) {
    // SAFETY (whole body): AVX-512 and bounds as the caller guarantees.
    unsafe {
        for r in 0..rows {
            for half in 0..2 {
                let x = _mm512_loadu_ps(src.add(r * lds + 16 * half));
                let at = out.add(r * ldo + 16 * half);
                if bf16 {
                    Zmm::store_bf16(at, x);
                } else {
                    Zmm::store_f16(at, x);
                }
            }
        }
    }
}

/// A register width's stores of one accumulator, as f32 or rounded to bf16 or f16 (as `half`'s
/// `from_f32` does: F16C's or AVX-512's conversion for f16).
///
/// # Safety (every method)
/// The width's extensions available (inlined into the kernels); the destination valid for writes of
/// `LANES` values.
trait Width {
    type V: Copy;
    const LANES: usize;
    unsafe fn store_f32(at: *mut f32, x: Self::V);
    unsafe fn store_bf16(at: *mut u16, x: Self::V);
    unsafe fn store_f16(at: *mut u16, x: Self::V);
}

/// ymm registers (AVX2, FMA and F16C).
struct Ymm;
/// zmm registers (AVX-512).
struct Zmm;

// SAFETY (every method below): as `Width` requires of its caller.
impl Width for Ymm {
    type V = __m256;
    const LANES: usize = 8;
    #[inline(always)]
    unsafe fn store_f32(at: *mut f32, x: __m256) {
        unsafe { _mm256_storeu_ps(at, x) }
    }
    #[inline(always)]
    unsafe fn store_bf16(at: *mut u16, x: __m256) {
        unsafe { _mm_storeu_si128(at.cast::<__m128i>(), bf16_bits_8(x)) }
    }
    #[inline(always)]
    unsafe fn store_f16(at: *mut u16, x: __m256) {
        unsafe { _mm_storeu_si128(at.cast::<__m128i>(), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x)) }
    }
}

impl Width for Zmm {
    type V = __m512;
    const LANES: usize = 16;
    #[inline(always)]
    unsafe fn store_f32(at: *mut f32, x: __m512) {
        unsafe { _mm512_storeu_ps(at, x) }
    }
    #[inline(always)]
    unsafe fn store_bf16(at: *mut u16, x: __m512) {
        unsafe { _mm256_storeu_si256(at.cast::<__m256i>(), bf16_bits(x)) }
    }
    #[inline(always)]
    unsafe fn store_f16(at: *mut u16, x: __m512) {
        unsafe { _mm256_storeu_si256(at.cast::<__m256i>(), _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x)) }
    }
}

/// 16 floats rounded to bf16 bits as `half`'s `bf16::from_f32` does (round to nearest even on the bits;
/// a NaN keeps its sign and top payload bits and is made quiet): the vector form of
/// `branchless::bf16_bits`.
///
/// # Safety
/// AVX-512 available (inlined, as [`zmm_tile`]).
#[inline(always)]
unsafe fn bf16_bits(x: __m512) -> __m256i {
    // SAFETY (whole body): AVX-512, as the caller guarantees.
    unsafe {
        let bits = _mm512_castps_si512(x);
        let high = _mm512_srli_epi32::<16>(bits);
        let odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
        let rounded =
            _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))));
        let magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFF_FFFF));
        let nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7F80_0000));
        let quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
        _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet))
    }
}
