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
//! Where `k` is not a whole number of tile products, or the last block has fewer than 32 lines, that
//! block's lines are copied into a zero-padded buffer first (still one read of B).
//!
//! The sums are the packed AMX path's: element `(i, j)` starts from the same value (zero, C, or the
//! bias) and adds the same pairs of products in the same order; only the two factors of each product
//! trade places, and a product of two bf16 values is exact in f32. The model's sums are therefore the
//! packed model's bit for bit; the hardware's are the packed hardware path's wherever `tdpbf16ps` sums
//! alike with its operands' roles traded, which `kernels/tests/gemm.rs` checks where AMX runs (it held
//! on the Xeon measured). On [`GemmPath::AmxBf16`] and its model.

use std::cell::Cell;

use half::{bf16, f16};
use rayon::prelude::*;

use super::buffers::{cache_aligned, PACKED};
use super::{Job, Ptr};
use crate::gemm::layout::Triangle;
use crate::gemm::micro::{Micro, TransposedTile};
use crate::gemm::{Compute, GemmPath, Start};
use crate::slices::Float;
use crate::GradSlice;

thread_local! {
    /// A worker's zero-padded copy of the lines of B^T that cannot be read in place.
    static LINES_COPY: Cell<Vec<u16>> = const { Cell::new(Vec::new()) };
}

/// At most this many rows of A take this path (two passes of [`ROWS`] over each tile of B).
pub(crate) const MAX_ROWS: usize = 64;
/// `k` per tile product.
pub(crate) const GROUP_K: usize = 32;
/// Lines of `B^T` (columns of C) per tile: two AMX tiles of 16.
pub(crate) const LINES: usize = 32;
/// Rows of A (of C) per tile: two AMX tiles of 16 columns of `A^T`.
pub(crate) const ROWS: usize = 32;

/// Whether `job` on `path` takes this path: a bf16 product on AMX (or its model) of one matrix pair or a
/// batch, B stored as bf16 with `k` contiguous, at most [`MAX_ROWS`] rows, `k` at least one tile product,
/// nothing skipped.
pub(crate) fn applies(path: GemmPath, job: &Job<'_>) -> bool {
    matches!(path, GemmPath::AmxBf16 | GemmPath::AmxBf16Model)
        && job.compute == Compute::Bf16
        && matches!(job.b.data, GradSlice::Bf16(_))
        && job.b.row_stride == 1
        && job.dims.m <= MAX_ROWS
        && job.dims.k >= GROUP_K
        && job.spacing.count == 1
        && job.triangle == Triangle::Full
}

impl Job<'_> {
    /// The product on `micro` ([`applies`] holds), its blocks of [`LINES`] columns in parallel when
    /// `parallel`.
    pub(crate) fn run_skinny_tiles<M: Micro<Packed = u32> + TransposedTile>(&self, micro: M, parallel: bool) {
        let dims = self.dims;
        let GradSlice::Bf16(b) = self.b.data else { unreachable!("applies: B is bf16") };
        // SAFETY: bf16 is a transparent u16.
        let b: &[u16] = unsafe { std::slice::from_raw_parts(b.as_ptr().cast(), b.len()) };
        let groups = dims.k.div_ceil(GROUP_K);
        let steps = groups * GROUP_K / 2;
        // A^T as the packed path packs B: panels of ROWS rows of A (lines), step-major pairs.
        let panels = dims.m.div_ceil(ROWS);
        let (mut a_words, b_words) = PACKED.take();
        let a_packed = cache_aligned(&mut a_words, dims.batch * panels * steps * ROWS);
        let a_lines = (dims.m, self.a.row_stride, self.a.col_stride);
        self.pack((&self.a, 0), a_lines, (ROWS, steps, 1), &|_| (0, steps), a_packed, parallel);
        let a_packed = &*a_packed;
        // Tiles of B^T are read in place where they hold whole groups of `k` and all their lines; the
        // others (the last `k`, the last block's missing lines) from a zero-padded copy.
        let in_place = dims.k.is_multiple_of(GROUP_K);
        let blocks = dims.n.div_ceil(LINES);
        let task = |t: usize| {
            let (batch, j0) = (t / blocks, t % blocks * LINES);
            let lines = LINES.min(dims.n - j0);
            let origin = batch * self.b.batch_stride + j0 * self.b.col_stride;
            let mut copy = LINES_COPY.take();
            let (w, ldw) = if in_place && lines == LINES {
                (&b[origin..], self.b.col_stride)
            } else {
                let ldw = groups * GROUP_K;
                let padded = cache_aligned(&mut copy, LINES * ldw);
                for (l, dst) in padded.chunks_exact_mut(ldw).enumerate() {
                    if l < lines {
                        let (data, rest) = dst.split_at_mut(dims.k);
                        data.copy_from_slice(&b[origin + l * self.b.col_stride..][..dims.k]);
                        rest.fill(0);
                    } else {
                        dst.fill(0);
                    }
                }
                (&*padded, ldw)
            };
            micro.begin();
            for p in 0..panels {
                let i0 = p * ROWS;
                let rows = ROWS.min(dims.m - i0);
                let mut tile = Tile([0.0; LINES * ROWS]);
                self.tile_start(batch, (i0, rows), (j0, lines), &mut tile.0);
                let at = &a_packed[(batch * panels + p) * steps * ROWS..][..steps * ROWS];
                // SAFETY: `w` holds LINES lines of `groups * GROUP_K` values `ldw` apart (in place: every
                // line of the block lies in B, `k` a whole number of groups; else the padded copy), `at`
                // the panel's `steps` steps of ROWS pairs, and `begin` was called on this thread.
                unsafe { micro.transposed_tile(groups, (w.as_ptr(), ldw), at.as_ptr(), &mut tile.0) };
                self.tile_out(batch, (i0, rows), (j0, lines), &tile.0);
            }
            micro.end();
            LINES_COPY.set(copy);
        };
        let tasks = dims.batch * blocks;
        if parallel {
            (0..tasks).into_par_iter().for_each(task);
        } else {
            (0..tasks).for_each(task);
        }
        PACKED.set((a_words, b_words));
    }

    /// The tile's start, `tile[l * ROWS + r]` for C's element `(i0 + r, j0 + l)`: zero, the bias of its
    /// column, or what C holds (widened); zero past C's edge.
    fn tile_start(
        &self,
        batch: usize,
        (i0, rows): (usize, usize),
        (j0, lines): (usize, usize),
        tile: &mut [f32],
    ) {
        match self.start {
            Start::Zero => {}
            Start::Bias(bias) => {
                for (line, &value) in tile.chunks_exact_mut(ROWS).zip(&bias[j0..j0 + lines]) {
                    line[..rows].fill(value);
                }
            }
            Start::Output => {
                for r in 0..rows {
                    let at = batch * self.out.batch_stride + (i0 + r) * self.out.row_stride + j0;
                    for l in 0..lines {
                        // SAFETY: (batch, i0 + r, j0 + l) lies in C (layout::check) and only this task
                        // touches it.
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

    /// The tile's sums into C, each rounded once to C's type: a row of C at a time, gathered from the
    /// tile's column.
    fn tile_out(&self, batch: usize, (i0, rows): (usize, usize), (j0, lines): (usize, usize), tile: &[f32]) {
        let mut row = [0.0f32; LINES];
        for r in 0..rows {
            for (l, x) in row[..lines].iter_mut().enumerate() {
                *x = tile[l * ROWS + r];
            }
            let at = batch * self.out.batch_stride + (i0 + r) * self.out.row_stride + j0;
            // SAFETY: the row's `lines` elements from `at` lie in C (layout::check) and only this task
            // writes them.
            unsafe {
                match self.out.ptr {
                    Ptr::F32(c) => std::ptr::copy_nonoverlapping(row.as_ptr(), c.add(at), lines),
                    Ptr::F16(c) => {
                        f16::narrow(&row[..lines], std::slice::from_raw_parts_mut(c.add(at), lines))
                    }
                    Ptr::Bf16(c) => {
                        bf16::narrow(&row[..lines], std::slice::from_raw_parts_mut(c.add(at), lines))
                    }
                }
            }
        }
    }
}

/// A tile of sums on a cache line: `LINES` lines of `ROWS` floats (C transposed).
#[repr(C, align(64))]
struct Tile([f32; LINES * ROWS]);
