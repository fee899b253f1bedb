//! Software prefetch: of the packed B micro-panel the next tiles sweep, of the AMX kernel's next tiles,
//! and of the source runs that packing reads across lines.
//!
//! A B micro-panel stays in L1 while every A micro-panel of a block sweeps it (the AVX2 kernel's), but
//! the first of those tiles reads all of it from memory, and the hardware prefetchers stop at each 4 KiB
//! page: that tile would wait on memory. The driver fetches the next micro-panel into L2 a slice per tile
//! while the current one is swept (where [`super::micro::Blocking::prefetch_next_b`] says so).
//!
//! Packing an operand whose lines are contiguous reads, at each step, one short run per `k` (a few
//! hundred bytes), the runs `k_stride` elements apart: a page apart for a large operand, so again past
//! the hardware prefetchers. The packing loop fetches the runs a few steps ahead into L1.

/// Cache line size in bytes.
const LINE: usize = 64;

/// Prefetches into L2 part `part` of `parts` equal parts (in cache lines) of `data`.
#[inline]
pub(crate) fn part_to_l2<T>(data: &[T], part: usize, parts: usize) {
    let lines = std::mem::size_of_val(data).div_ceil(LINE);
    let base = data.as_ptr().cast::<u8>();
    for at in lines * part / parts..lines * (part + 1) / parts {
        // `wrapping_add`: the address is only a hint, never dereferenced.
        line::<true>(base.wrapping_add(at * LINE));
    }
}

/// Prefetches into L1 the cache lines of `len` elements of `data` from `start` (a hint: an address past
/// `data` is never dereferenced).
#[inline]
pub(crate) fn run_to_l1<T>(data: &[T], start: usize, len: usize) {
    let size = std::mem::size_of::<T>();
    let base = data.as_ptr().cast::<u8>().wrapping_add(start * size);
    for at in 0..(len * size).div_ceil(LINE) {
        line::<false>(base.wrapping_add(at * LINE));
    }
}

/// Prefetches into L1 the cache lines of the `bytes` bytes from `p` (a hint: never dereferenced). For
/// the AMX kernel, on x86-64 only.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn bytes_to_l1(p: *const u8, bytes: usize) {
    for at in (0..bytes).step_by(LINE) {
        line::<false>(p.wrapping_add(at));
    }
}

/// Prefetches the cache line at `p` into L1 or, with `TO_L2`, into L2 only.
#[cfg(target_arch = "x86_64")]
#[inline]
fn line<const TO_L2: bool>(p: *const u8) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
    // SAFETY: SSE is part of x86-64, and a prefetch never faults, whatever the address.
    unsafe {
        if TO_L2 {
            _mm_prefetch::<_MM_HINT_T1>(p.cast());
        } else {
            _mm_prefetch::<_MM_HINT_T0>(p.cast());
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn line<const TO_L2: bool>(_: *const u8) {}
