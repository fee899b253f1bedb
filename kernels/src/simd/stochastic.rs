//! Stochastic rounding to bf16 (`crate::stochastic`), eight lanes at a time with AVX2.

use std::arch::x86_64::{
    __m256, __m256i, _mm256_add_epi32, _mm256_and_si256, _mm256_andnot_si256, _mm256_castps_si256,
    _mm256_castsi256_ps, _mm256_castsi256_si128, _mm256_cmpgt_epi32, _mm256_loadu_ps, _mm256_mullo_epi32,
    _mm256_or_si256, _mm256_packus_epi32, _mm256_permute4x64_epi64, _mm256_set1_epi32, _mm256_setr_epi32,
    _mm256_slli_epi32, _mm256_srli_epi32, _mm256_xor_si256, _mm_storeu_si128,
};

use half::bf16;

use super::W;

/// `crate::stochastic::mix` on eight lanes.
#[inline(always)]
unsafe fn mix8(x: __m256i) -> __m256i {
    // SAFETY: caller guarantees AVX2.
    unsafe {
        let x = _mm256_xor_si256(x, _mm256_srli_epi32::<16>(x));
        let x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB_352D));
        let x = _mm256_xor_si256(x, _mm256_srli_epi32::<15>(x));
        let x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x846C_A68Bu32 as i32));
        _mm256_xor_si256(x, _mm256_srli_epi32::<16>(x))
    }
}

/// The random bits of indices `first + 0..8` of stream `key` (broadcast), as eight lanes.
#[inline(always)]
pub(crate) unsafe fn random8(key: __m256i, first: u32) -> __m256i {
    // SAFETY: caller guarantees AVX2.
    unsafe {
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let index = _mm256_add_epi32(_mm256_set1_epi32(first as i32), lanes);
        mix8(_mm256_xor_si256(index, key))
    }
}

/// Eight f32 lanes (as bits) rounded with the low 16 of eight lanes of random bits, as 32-bit lanes
/// holding the bf16.
#[inline(always)]
unsafe fn round8(bits: __m256i, random: __m256i) -> __m256i {
    // SAFETY: caller guarantees AVX2.
    unsafe {
        let low = _mm256_and_si256(random, _mm256_set1_epi32(0xFFFF));
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(bits, low));
        // NaN (|bits| > inf's bits, a signed compare on the sign-cleared pattern): quiet, as `half`.
        let abs = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFF_FFFF));
        let is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7F80_0000));
        let quiet = _mm256_or_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(0x0040));
        _mm256_or_si256(_mm256_and_si256(is_nan, quiet), _mm256_andnot_si256(is_nan, rounded))
    }
}

/// Stores eight f32 lanes rounded stochastically to bf16 at `dst`, with the low half of `random`'s
/// lanes, or their high half when `high`. Returns the stored values widened back to f32 (exact).
///
/// # Safety
/// AVX2 available; `dst` valid for writing 8 elements.
#[inline(always)]
pub(crate) unsafe fn store8(dst: *mut bf16, x: __m256, random: __m256i, high: bool) -> __m256 {
    // SAFETY: caller guarantees AVX2 and 8 writable elements.
    unsafe {
        let random = if high { _mm256_srli_epi32::<16>(random) } else { random };
        let wide = round8(_mm256_castps_si256(x), random);
        // Lanes hold values below 2^16: the unsigned saturating pack is exact; it packs within 128-bit
        // halves, so the 64-bit quarters 0 and 2 hold the eight results in order.
        let packed = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi32(wide, wide));
        _mm_storeu_si128(dst.cast(), _mm256_castsi256_si128(packed));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
    }
}

/// Element `i` rounded with the bits of `mix((first + i) ^ key) >> shift` (`shift` 0 or 16), as the
/// portable loop.
///
/// # Safety
/// AVX2, FMA and F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn narrow_bf16(src: &[f32], dst: &mut [bf16], key: u32, first: u32, shift: u32) {
    let n = src.len().min(dst.len());
    let body = n - n % W;
    let keys = _mm256_set1_epi32(key as i32);
    for i in (0..body).step_by(W) {
        // SAFETY: i + 8 <= body <= n, the length of both slices.
        unsafe {
            let random = random8(keys, first.wrapping_add(i as u32));
            store8(dst.as_mut_ptr().add(i), _mm256_loadu_ps(src.as_ptr().add(i)), random, shift == 16);
        }
    }
    let (src, dst) = (&src[body..n], &mut dst[body..n]);
    crate::portable::stochastic::narrow_bf16(src, dst, key, first.wrapping_add(body as u32), shift);
}
