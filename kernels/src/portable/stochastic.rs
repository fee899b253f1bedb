//! Stochastic rounding to bf16 (`crate::stochastic`) as a plain loop.

use half::bf16;

use crate::stochastic::{mix, round_bf16};

/// Element `i` rounded with the bits of `mix((first + i) ^ key) >> shift` (indices wrap at 2^32: the
/// caller splits at those boundaries and changes the key). `shift` is 0 or 16: which half is used.
pub(crate) fn narrow_bf16(src: &[f32], dst: &mut [bf16], key: u32, first: u32, shift: u32) {
    for (i, (d, &s)) in dst.iter_mut().zip(src).enumerate() {
        *d = round_bf16(s, mix(first.wrapping_add(i as u32) ^ key) >> shift);
    }
}
