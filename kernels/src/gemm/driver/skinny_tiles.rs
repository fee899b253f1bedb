//! bf16 products with few rows of A on AMX, B read where it lies (a Linear's weight `(out, in)` seen as
//! `W^T`, `k` contiguous): the tiles compute `C^T = B^T·A^T`, with 16 lines of `B^T` (rows of the
//! weight) as the tile product's A operand, each tile loaded straight from the weight's rows, and `A^T`,
//! packed as the packed path packs a B panel, as its B operand.
//!
//! The packed path writes a skinny product's B into panels and reads it back: three passes over the
//! product's largest operand to use each of its values a few times. Here it is read once, from memory,
//! and each tile of it serves every row of A. Measured on a Xeon (AMX), 2 threads, bf16 C, the weight
//! `(n, k)` row-major (builds in turn, three rounds of 31 calls, medians): `16 x 4096 x 4096` 1.76-1.80
//! -> 0.99-1.06 ms, `64 x 4096 x 4096` 2.34-2.44 -> 1.70-1.88 ms, `1 x 4096 x 4096` 1.67-1.76 -> 0.98-1.03
//! ms (a pass over the weight's 32 MiB measured 1.45 ms there), `64 x 768 x 3072` unchanged (0.36-0.40).
//!
//! Every tile of `B^T` is read in place: a last block short of 32 lines moves back to end at `n` (its
//! lines before the block's own columns are summed again and dropped), and a last `k % 32` is copied
//! into a zero-padded 2 KiB tile on the stack. Nothing is allocated per call beyond the packed `A^T`
//! (the calling thread's reusable buffer).
//!
//! The sums are the packed AMX path's: element `(i, j)` starts from the same value (zero, C, or the
//! bias) and adds the same pairs of products in the same order; only the two factors of each product
//! trade places, and a product of two bf16 values is exact in f32. The model's sums are therefore the
//! packed model's bit for bit; the hardware's are the packed hardware path's wherever `tdpbf16ps` sums
//! alike with its operands' roles traded, which `kernels/tests/gemm.rs` checks where AMX runs (it held
//! on the Xeon measured). On [`GemmPath::AmxBf16`] and its model.

use half::{bf16, f16};
use rayon::prelude::*;

use super::buffers::{cache_aligned, PACKED};
use super::{Job, Ptr};
use crate::gemm::layout::Triangle;
use crate::gemm::micro::{Micro, TransposedTile};
use crate::gemm::{Compute, GemmPath, Start};
use crate::slices::Float;
use crate::GradSlice;

/// At most this many rows of A take this path (two passes of [`ROWS`] over each tile of B).
pub(crate) const MAX_ROWS: usize = 64;
/// `k` per tile product.
const GROUP_K: usize = 32;
/// Lines of `B^T` (columns of C) per tile: two AMX tiles of 16.
const LINES: usize = 32;
/// Rows of A (of C) per tile: two AMX tiles of 16 columns of `A^T`.
const ROWS: usize = 32;

/// Whether `job` on `path` takes this path: a bf16 product on AMX (or its model) of one matrix pair or a
/// batch, B stored as bf16 with `k` contiguous, at most [`MAX_ROWS`] rows, at least one tile's lines and
/// `k`, nothing skipped.
pub(crate) fn applies(path: GemmPath, job: &Job<'_>) -> bool {
    matches!(path, GemmPath::AmxBf16 | GemmPath::AmxBf16Model)
        && job.compute == Compute::Bf16
        && matches!(job.b.data, GradSlice::Bf16(_))
        && job.b.row_stride == 1
        && job.dims.m <= MAX_ROWS
        && job.dims.k >= GROUP_K
        && job.dims.n >= LINES
        && job.spacing.count == 1
        && job.triangle == Triangle::Full
}

/// Where a tile's lines lie in C: its lines are C's columns from `first`, of which the first `skip`
/// belong to another block (never read nor written here).
#[derive(Clone, Copy)]
struct Lines {
    first: usize,
    skip: usize,
}

impl Job<'_> {
    /// The product on `micro` ([`applies`] holds), its blocks of [`LINES`] columns in parallel when
    /// `parallel`.
    pub(crate) fn run_skinny_tiles<M: Micro<Packed = u32> + TransposedTile>(&self, micro: M, parallel: bool) {
        let dims = self.dims;
        let GradSlice::Bf16(b) = self.b.data else { unreachable!("applies: B is bf16") };
        // SAFETY: bf16 is a transparent u16.
        let b: &[u16] = unsafe { std::slice::from_raw_parts(b.as_ptr().cast(), b.len()) };
        let steps = dims.k.div_ceil(GROUP_K) * GROUP_K / 2;
        // A^T as the packed path packs B: panels of ROWS rows of A (lines), step-major pairs.
        let panels = dims.m.div_ceil(ROWS);
        let (mut a_words, b_words) = PACKED.take();
        let a_packed = cache_aligned(&mut a_words, dims.batch * panels * steps * ROWS);
        let a_lines = (dims.m, self.a.row_stride, self.a.col_stride);
        self.pack((&self.a, 0), a_lines, (ROWS, steps, 1), &|_| (0, steps), a_packed, parallel);
        let a_packed = &*a_packed;
        // Whole tile products of `k` from B^T where it lies; the last `k % 32` from a copy.
        let (whole, tail) = (dims.k / GROUP_K, dims.k % GROUP_K);
        let blocks = dims.n.div_ceil(LINES);
        let task = |t: usize| {
            // The block's own columns start at `j0`; its tile's lines at `j0`, or for a last block short
            // of LINES columns, LINES before `n` (`n >= LINES`: `applies`).
            let (batch, j0) = (t / blocks, t % blocks * LINES);
            let first = j0.min(dims.n - LINES);
            let lines = Lines { first, skip: j0 - first };
            let w = &b[batch * self.b.batch_stride + first * self.b.col_stride..];
            let ldw = self.b.col_stride;
            let mut tail_tile = TailTile([0; LINES * GROUP_K]);
            if tail > 0 {
                for (l, dst) in tail_tile.0.chunks_exact_mut(GROUP_K).enumerate() {
                    dst[..tail].copy_from_slice(&w[l * ldw + whole * GROUP_K..][..tail]);
                }
            }
            micro.begin();
            for p in 0..panels {
                let rows = (p * ROWS, ROWS.min(dims.m - p * ROWS));
                let mut tile = Tile([0.0; LINES * ROWS]);
                self.tile_start(batch, rows, lines, &mut tile.0);
                let at = &a_packed[(batch * panels + p) * steps * ROWS..][..steps * ROWS];
                // SAFETY: `w` holds LINES lines (C's columns `first..first + LINES`, all present) of at
                // least `whole * GROUP_K` values `ldw` apart (layout::check), the tail tile LINES lines
                // of GROUP_K values; `at` holds the panel's `steps` steps of ROWS pairs, the tail's
                // group after the whole ones; `begin` was called on this thread.
                unsafe {
                    micro.transposed_tile(whole, (w.as_ptr(), ldw), at.as_ptr(), &mut tile.0);
                    if tail > 0 {
                        let at_tail = at.as_ptr().add(whole * GROUP_K / 2 * ROWS);
                        micro.transposed_tile(1, (tail_tile.0.as_ptr(), GROUP_K), at_tail, &mut tile.0);
                    }
                }
                self.tile_out(batch, rows, lines, &tile.0);
            }
            micro.end();
        };
        let tasks = dims.batch * blocks;
        if parallel {
            (0..tasks).into_par_iter().for_each(task);
        } else {
            (0..tasks).for_each(task);
        }
        PACKED.set((a_words, b_words));
    }

    /// The tile's start, `tile[l * ROWS + r]` for C's element `(i0 + r, first + l)`: zero, the bias of
    /// its column, or what C holds (widened); zero past C's last row and on the skipped lines.
    fn tile_start(&self, batch: usize, (i0, rows): (usize, usize), lines: Lines, tile: &mut [f32]) {
        let Lines { first, skip } = lines;
        match self.start {
            Start::Zero => {}
            Start::Bias(bias) => {
                for (line, &value) in tile.chunks_exact_mut(ROWS).zip(&bias[first..first + LINES]).skip(skip)
                {
                    line[..rows].fill(value);
                }
            }
            Start::Output => {
                for r in 0..rows {
                    let at = batch * self.out.batch_stride + (i0 + r) * self.out.row_stride + first;
                    for l in skip..LINES {
                        // SAFETY: (batch, i0 + r, first + l) lies in C (layout::check), one of this
                        // block's own columns, which no other task touches.
                        tile[l * ROWS + r] = unsafe {
                            match self.out.ptr {
                                Ptr::F32(c) => *c.add(at + l),
                                Ptr::F16(c) => (*c.add(at + l)).to_f32(),
                                Ptr::Bf16(c) => (*c.add(at + l)).to_f32(),
                            }
                        };
                    }
                }
            }
        }
    }

    /// The tile's sums into C but for its skipped lines, each rounded once to C's type: a row of C at a
    /// time, gathered from the tile's column.
    fn tile_out(&self, batch: usize, (i0, rows): (usize, usize), lines: Lines, tile: &[f32]) {
        let Lines { first, skip } = lines;
        let cols = LINES - skip;
        let mut row = [0.0f32; LINES];
        for r in 0..rows {
            for (l, x) in row[..cols].iter_mut().enumerate() {
                *x = tile[(skip + l) * ROWS + r];
            }
            let at = batch * self.out.batch_stride + (i0 + r) * self.out.row_stride + first + skip;
            // SAFETY: the row's `cols` elements from `at` lie in C (layout::check), this block's own
            // columns, which only this task writes.
            unsafe {
                match self.out.ptr {
                    Ptr::F32(c) => std::ptr::copy_nonoverlapping(row.as_ptr(), c.add(at), cols),
                    Ptr::F16(c) => f16::narrow(&row[..cols], std::slice::from_raw_parts_mut(c.add(at), cols)),
                    Ptr::Bf16(c) => {
                        bf16::narrow(&row[..cols], std::slice::from_raw_parts_mut(c.add(at), cols))
                    }
                }
            }
        }
    }
}

/// A tile of sums on a cache line: `LINES` lines of `ROWS` floats (C transposed).
#[repr(C, align(64))]
struct Tile([f32; LINES * ROWS]);

/// The last `k % 32` values of a block's lines, zero-padded to a tile product, each line 64 bytes.
#[repr(C, align(64))]
struct TailTile([u16; LINES * GROUP_K]);
