//! Software prefetch of the packed B micro-panel the next tiles sweep.
//!
//! A B micro-panel stays in L1 or L2 while every A micro-panel of a block sweeps it, but the first of
//! those tiles reads all of it from memory, and the hardware prefetchers stop at each 4 KiB page: that
//! tile would wait on memory. The driver fetches the next micro-panel into L2 a slice per tile while the
//! current one is swept.

/// Cache line size in bytes.
const LINE: usize = 64;

/// Prefetches into L2 part `part` of `parts` equal parts (in cache lines) of `data`.
#[inline]
pub(crate) fn part_to_l2<T>(data: &[T], part: usize, parts: usize) {
    let lines = std::mem::size_of_val(data).div_ceil(LINE);
    let base = data.as_ptr().cast::<u8>();
    for line in lines * part / parts..lines * (part + 1) / parts {
        // `wrapping_add`: the address is only a hint, never dereferenced.
        line_to_l2(base.wrapping_add(line * LINE));
    }
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn line_to_l2(p: *const u8) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    // SAFETY: SSE is part of x86-64, and a prefetch never faults, whatever the address.
    unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) };
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn line_to_l2(_: *const u8) {}
