//! f32 to bf16 with stochastic rounding: unbiased in expectation, reproducible bit for bit.
//!
//! A value `x` between two neighbouring bf16 values `lo < x < hi` rounds up with probability
//! `(x - lo) / (hi - lo)`, so `E[round(x)] = x`: a running average stored in bf16 keeps moving by
//! increments far below half a bf16 step, where round-to-nearest would return the old value every time
//! (`v = 0.999 v + 0.001 g²` with `g² < 3 v` never changes `v` under round-to-nearest in bf16).
//!
//! The random bits are a counter-based hash of a stream key and the element's index ([`random_bits`]),
//! so a result depends on neither the thread count nor the code path: the AVX2 path and the portable
//! one write the same bits, and a run resumed from a checkpoint draws what the uninterrupted run drew.
//!
//! Rounding adds 16 random bits to the f32's bit pattern and keeps the top 16 ([`round_bf16`]): the bit
//! pattern of a finite f32 is monotonic in its magnitude, so a carry out of the low half steps the
//! magnitude to the next bf16 (an exponent bump included), with the probability above. An infinity stays
//! infinite; a NaN becomes a quiet NaN, as `half`'s round-to-nearest makes it; a finite value past bf16's
//! largest (`3.3895e38`) rounds to infinity with the same probability rule.

use half::bf16;

use crate::backend::{dispatch, Backend};
use crate::Isa;

/// lowbias32 (Chris Wellons's integer hash search): a bijection on `u32` whose output bits each flip with
/// probability close to 1/2 when any input bit flips.
#[inline(always)]
pub(crate) const fn mix(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7FEB_352D);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846C_A68B);
    x ^ (x >> 16)
}

/// The key of a stream's elements whose index lies in `[high << 32, (high + 1) << 32)`: the per-element
/// hash then takes only the index's low 32 bits.
#[inline(always)]
pub(crate) const fn block_key(key: u32, high: u32) -> u32 {
    if high == 0 {
        key
    } else {
        mix(key ^ high.wrapping_mul(0x9E37_79B9))
    }
}

/// The 32 random bits of element `index` of stream `key`. [`round_bf16`] uses the low 16; two values
/// of one element rounded in one pass (Adam's moments) take the low and the high 16.
#[inline]
pub fn random_bits(key: u32, index: u64) -> u32 {
    mix(index as u32 ^ block_key(key, (index >> 32) as u32))
}

/// A stream key from several words (a parameter's stream, a step number, which buffer): each word
/// hashed into the running key, so keys of different inputs are unrelated.
pub fn stream_key(words: &[u64]) -> u32 {
    words.iter().fold(0x2545_F491, |key, &w| mix(mix(key ^ w as u32) ^ (w >> 32) as u32))
}

/// `x` rounded to bf16 stochastically with the random bits `r` (the low 16 used): up to the next bf16
/// in magnitude exactly when the discarded low half of `x`'s bits plus `r`'s low half carries.
#[inline(always)]
pub fn round_bf16(x: f32, r: u32) -> bf16 {
    let b = x.to_bits();
    if b & 0x7FFF_FFFF > 0x7F80_0000 {
        return bf16::from_f32(x);
    }
    // At most 0xFF80_0000 + 0xFFFF: no overflow.
    bf16::from_bits(((b + (r & 0xFFFF)) >> 16) as u16)
}

/// Rounds `src` into `dst` stochastically, element `i` with the (low 16) random bits of index
/// `first + i` of stream `key`. Runs on [`Isa::detect`]'s path; every path writes the same bits.
///
/// # Panics
/// If the lengths differ.
pub fn narrow_bf16(src: &[f32], dst: &mut [bf16], key: u32, first: u64) {
    narrow_bf16_with(Isa::detect(), src, dst, key, first);
}

/// [`narrow_bf16`] on an explicit code path.
///
/// # Panics
/// If the lengths differ.
pub fn narrow_bf16_with(isa: Isa, src: &[f32], dst: &mut [bf16], key: u32, first: u64) {
    assert_eq!(src.len(), dst.len(), "narrow_bf16: source and destination lengths differ");
    narrow_block(Backend::new(isa), src, dst, key, first);
}

/// [`narrow_bf16`] on the calling thread.
fn narrow_block(backend: Backend, src: &[f32], dst: &mut [bf16], key: u32, first: u64) {
    let mut start = 0;
    while start < src.len() {
        let index = first + start as u64;
        let end = src.len().min(start.saturating_add(before_key_change(index)));
        let key = block_key(key, (index >> 32) as u32);
        let (s, d) = (&src[start..end], &mut dst[start..end]);
        dispatch!(backend, stochastic::narrow_bf16(s, d, key, index as u32, 0));
        start = end;
    }
}

/// How many indices from `index` on share its high 32 bits (and so one [`block_key`]).
pub(crate) fn before_key_change(index: u64) -> usize {
    usize::try_from((1u64 << 32) - (index & 0xFFFF_FFFF)).unwrap_or(usize::MAX)
}
