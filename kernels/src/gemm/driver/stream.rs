//! C written past the caches: a block summed in the worker's scratch block, then copied out with
//! streaming (non-temporal) stores, which do not read C's lines into the caches before writing them as
//! ordinary stores do. For a C read again only after much other work (a weight's gradient, which the
//! optimizer reads after the whole backward pass) that halves its memory traffic. Measured on the MLP
//! bench's model (`cargo bench --bench mlp_step`), whose weight gradients are 4 MiB each, on a Xeon
//! (AMX): the bf16 O2 step about 8% shorter; the f32 step, bound by its FMAs, 1.5% longer (the copy
//! through the scratch block), so amp streams the gradients of the bf16 products only.

use std::sync::atomic::{AtomicBool, Ordering};

use half::bf16;

use super::buffers::{cache_aligned, SCRATCH};
use super::packing::Panels;
use super::sweep::TileStart;
use super::{Block, Job};
use crate::gemm::micro::Micro;
use crate::gemm::Start;

/// Whether this target has streaming stores (x86-64: SSE2's, always there). Elsewhere C is written
/// directly, as any other.
pub(super) const AVAILABLE: bool = cfg!(target_arch = "x86_64");

impl Job<'_> {
    /// The f32 block at `c` (C's row stride), summed in the worker's scratch block and streamed out;
    /// clears `finite` if a value written is infinite or NaN.
    pub(super) fn streamed_block<M: Micro>(
        &self,
        micro: M,
        blk: Block,
        steps: usize,
        (a_packed, b_packed): (Panels<'_, M::Packed>, Panels<'_, M::Packed>),
        c: *mut f32,
        finite: &AtomicBool,
    ) {
        let ldc = self.out.row_stride;
        let mut scratch_vec = SCRATCH.take();
        // Sized for the largest block at once, as in `through_scratch`.
        let scratch = &mut cache_aligned(&mut scratch_vec, M::B.mc * M::B.nc)[..blk.rows * blk.cols];
        let start = match self.start {
            Start::Zero => TileStart::Zero,
            Start::Bias(bias) => TileStart::Row(&bias[blk.col..blk.col + blk.cols]),
            Start::Output => {
                for (r, row) in scratch.chunks_exact_mut(blk.cols).enumerate() {
                    // SAFETY: row r of the block lies inside C (the caller) and belongs to this block.
                    row.copy_from_slice(unsafe { std::slice::from_raw_parts(c.add(r * ldc), blk.cols) });
                }
                TileStart::C
            }
        };
        // SAFETY: the scratch holds the block's `rows x cols` floats at distance `cols`.
        unsafe {
            let sums = (scratch.as_mut_ptr(), blk.cols);
            self.sweep::<M, bf16>(micro, blk, steps, (a_packed, b_packed), sums, start, None);
        }
        let mut all_finite = true;
        for (r, row) in scratch.chunks_exact(blk.cols).enumerate() {
            all_finite &= !crate::portable::kernels::any_nonfinite(row);
            // SAFETY: as above.
            unsafe { write_row(row, c.add(r * ldc)) };
        }
        if !all_finite {
            finite.store(false, Ordering::Relaxed);
        }
        fence();
        SCRATCH.set(scratch_vec);
    }
}

/// Copies `row` to `dst`: the whole 64-byte lines of `dst` with streaming stores, the parts of lines
/// at either end (which neighbouring blocks share) with ordinary ones.
///
/// # Safety
/// `dst` is valid for `row.len()` floats and nothing else writes them meanwhile.
#[cfg(target_arch = "x86_64")]
unsafe fn write_row(row: &[f32], dst: *mut f32) {
    use std::arch::x86_64::{_mm_loadu_ps, _mm_stream_ps};
    // f32 is 4-byte aligned, so the distance to the next line is whole floats.
    let head = ((64 - dst as usize % 64) % 64 / 4).min(row.len());
    let lines = (row.len() - head) / 16;
    // SAFETY: every write lies inside `dst`'s `row.len()` floats (the caller); the streamed ones are
    // 64-byte aligned from `head` on, as `_mm_stream_ps` needs (16).
    unsafe {
        std::ptr::copy_nonoverlapping(row.as_ptr(), dst, head);
        for line in 0..lines {
            let at = head + line * 16;
            for quarter in 0..4 {
                let i = at + quarter * 4;
                _mm_stream_ps(dst.add(i), _mm_loadu_ps(row.as_ptr().add(i)));
            }
        }
        let done = head + lines * 16;
        std::ptr::copy_nonoverlapping(row.as_ptr().add(done), dst.add(done), row.len() - done);
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn write_row(row: &[f32], dst: *mut f32) {
    // SAFETY: as the caller guarantees.
    unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), dst, row.len()) }
}

/// Orders the block's streaming stores before what follows (they are weakly ordered on x86), so that
/// C is complete once the parallel loop joins.
fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE2 is part of x86-64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}
