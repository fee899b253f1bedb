//! A block of C: its tiles swept k-block by k-block over the micro-kernel.

use half::bf16;

use super::buffers::{cache_aligned, BLOCK_A, BLOCK_B, SCRATCH};
use super::packing::Panels;
use super::tiles::{bare_tile, edge_tile, tile_steps};
use super::{Block, Job, Ptr};
use crate::gemm::micro::{HalfC, Micro, TileFrom};
use crate::gemm::pack::PackInto;
use crate::gemm::prefetch;
use crate::gemm::Start;
use crate::slices::Float;

impl Job<'_> {
    pub(super) fn block<M: Micro>(
        &self,
        micro: M,
        blk: Block,
        steps: usize,
        a_packed: Panels<'_, M::Packed>,
        b_packed: Panels<'_, M::Packed>,
    ) {
        let out = self.out;
        let origin =
            self.origin(blk.batch, out.batch_stride, self.spacing.c) + blk.row * out.row_stride + blk.col;
        match out.ptr {
            Ptr::F32(c) if self.stream.is_some() && super::stream::AVAILABLE => {
                let finite = self.stream.expect("checked");
                let c = c.wrapping_add(origin);
                self.streamed_block(micro, blk, steps, (a_packed, b_packed), c, finite);
            }
            // SAFETY: `origin` and the block's extent lie inside C (layout::check), and no other block
            // writes these elements.
            Ptr::F32(c) => unsafe {
                let start = match self.start {
                    Start::Zero => TileStart::Zero,
                    Start::Output => TileStart::C,
                    Start::Bias(bias) => TileStart::Row(&bias[blk.col..blk.col + blk.cols]),
                };
                let c = (c.add(origin), out.row_stride);
                self.sweep::<M, bf16>(micro, blk, steps, (a_packed, b_packed), c, start, None);
            },
            Ptr::F16(c) => {
                self.through_scratch(micro, blk, steps, a_packed, b_packed, c.wrapping_add(origin))
            }
            Ptr::Bf16(c) => {
                self.through_scratch(micro, blk, steps, a_packed, b_packed, c.wrapping_add(origin))
            }
        }
    }

    /// A half-precision block: each tile's sums are rounded into C once, after its last k-block; a
    /// product of more than one k-block keeps the partial sums of the earlier ones in an f32 scratch
    /// block (per worker thread), as does a product that adds to C (widened into it first).
    fn through_scratch<M: Micro, H: Float + HalfC>(
        &self,
        micro: M,
        blk: Block,
        steps: usize,
        a_packed: Panels<'_, M::Packed>,
        b_packed: Panels<'_, M::Packed>,
        c: *mut H,
    ) {
        let ldc = self.out.row_stride;
        if steps == 0 {
            // C is its start: zero, C itself, or the bias, rounded.
            let bias = match self.start {
                Start::Output => return,
                Start::Zero => None,
                Start::Bias(bias) => Some(&bias[blk.col..blk.col + blk.cols]),
            };
            for r in 0..blk.rows {
                // SAFETY: row r of the block lies inside C and belongs to this block only.
                let row = unsafe { std::slice::from_raw_parts_mut(c.add(r * ldc), blk.cols) };
                match bias {
                    None => row.fill(H::default()),
                    Some(bias) => H::narrow(bias, row),
                }
            }
            return;
        }
        let mut scratch_vec = SCRATCH.take();
        // Sized for the largest block at once, so that a worker's buffer grows once, whichever blocks
        // rayon hands it first.
        let scratch = &mut cache_aligned(&mut scratch_vec, M::B.mc * M::B.nc)[..blk.rows * blk.cols];
        let start = match self.start {
            Start::Zero => TileStart::Zero,
            Start::Output => {
                for (r, row) in scratch.chunks_exact_mut(blk.cols).enumerate() {
                    // SAFETY: as above.
                    H::widen(unsafe { std::slice::from_raw_parts(c.add(r * ldc), blk.cols) }, row);
                }
                TileStart::C
            }
            Start::Bias(bias) => TileStart::Row(&bias[blk.col..blk.col + blk.cols]),
        };
        // SAFETY: the scratch holds `rows x cols` floats at distance `cols`; C's block as above.
        unsafe {
            let scratch = (scratch.as_mut_ptr(), blk.cols);
            self.sweep(micro, blk, steps, (a_packed, b_packed), scratch, start, Some((c, ldc)));
        }
        SCRATCH.set(scratch_vec);
    }

    /// Every tile of the block, k-block by k-block, into f32 `c` (the block's origin, rows `ldc` apart),
    /// starting from `start`; with `half` (the block's origin in half-precision C and its row stride),
    /// each tile's last k-block is rounded into `half` instead, `c` holding the earlier k-blocks' sums.
    ///
    /// # Safety
    /// `c` is valid for the block's `rows x cols` floats at distance `ldc`, and `half` for its `rows x
    /// cols` elements at its distance; a `TileStart::Row` holds the block's `cols` floats.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn sweep<M: Micro, H: HalfC>(
        &self,
        micro: M,
        blk: Block,
        steps: usize,
        ((a_packed, a_per_block), (b_packed, b_per_block)): (Panels<'_, M::Packed>, Panels<'_, M::Packed>),
        (c, ldc): (*mut f32, usize),
        start: TileStart<'_>,
        half: Option<(*mut H, usize)>,
    ) {
        if steps == 0 {
            for r in 0..blk.rows {
                // SAFETY: row r of the block, as the caller guarantees. Raw writes (zero bytes are
                // 0.0): C may be uninitialised memory (`run_new`).
                match start {
                    TileStart::Zero => unsafe { std::ptr::write_bytes(c.add(r * ldc), 0, blk.cols) },
                    TileStart::C => {}
                    TileStart::Row(row) => unsafe {
                        std::ptr::copy_nonoverlapping(row.as_ptr(), c.add(r * ldc), blk.cols)
                    },
                }
            }
            return;
        }
        let (a_panels, b_panels) = (self.dims.m.div_ceil(M::B.mr), self.dims.n.div_ceil(M::B.nr));
        // A's rows where they lie, for a kernel that reads them in place: the block's first row.
        let a_rows = match self.a.data {
            crate::GradSlice::Bf16(a) if self.a_in_place::<M>(steps) => {
                let origin = self.origin(blk.batch, self.a.batch_stride, self.spacing.a);
                Some(a[origin + blk.row * self.a.row_stride..].as_ptr().cast::<u16>())
            }
            _ => None,
        };
        micro.begin();
        let (b_tiles, a_tiles) = (blk.cols.div_ceil(M::B.nr), blk.rows.div_ceil(M::B.mr));
        let mut block_b = if b_per_block { BLOCK_B.take() } else { Vec::new() };
        let mut block_a = if a_per_block { BLOCK_A.take() } else { Vec::new() };
        for k0 in (0..steps).step_by(M::B.kc) {
            let kc = M::B.kc.min(steps - k0);
            // A micro-panel `p` of this k-block, from step `first`: in the panels packed before the
            // blocks, or in this block's own, packed now.
            let (a_base, a_stride, a_origin): (&[M::Packed], usize, usize) = if a_rows.is_some() {
                (&[], 0, 0)
            } else if a_per_block {
                let words = &mut cache_aligned(&mut block_a, M::B.mc * M::B.kc)[..a_tiles * kc * M::B.mr];
                let own = M::Packed::from_words(words);
                self.pack_a_block(blk, (k0, kc), (M::B.mr, M::B.a_group), own);
                (own, kc * M::B.mr, k0)
            } else {
                let first = (blk.batch * a_panels + blk.row / M::B.mr) * steps * M::B.mr;
                (&a_packed[first..], steps * M::B.mr, 0)
            };
            let a_panel = |p: usize, first: usize| &a_base[p * a_stride + (first - a_origin) * M::B.mr..];
            // B micro-panel `p` of this k-block: in the panels packed before the blocks, or in this
            // block's own, packed now.
            let (b_base, b_stride, b_skip): (&[M::Packed], usize, usize) = if b_per_block {
                // Sized for the largest block and k-block at once, as the scratch is.
                let words = &mut cache_aligned(&mut block_b, M::B.nc * M::B.kc)[..b_tiles * kc * M::B.nr];
                let own = M::Packed::from_words(words);
                self.pack_b_block(blk, (k0, kc), M::B.nr, own);
                (own, kc * M::B.nr, 0)
            } else {
                let first = (blk.batch * b_panels + blk.col / M::B.nr) * steps * M::B.nr;
                (&b_packed[first..], steps * M::B.nr, k0 * M::B.nr)
            };
            let b_panel = |p: usize| &b_base[p * b_stride + b_skip..];
            // The first k-block starts from zero, C or the row; later ones from what the first stored.
            let (load, row) = match start {
                _ if k0 > 0 => (true, None),
                TileStart::Zero => (false, None),
                TileStart::C => (true, None),
                TileStart::Row(row) => (false, Some(row)),
            };
            for jp in 0..b_tiles {
                let b = b_panel(jp).as_ptr();
                let cols = M::B.nr.min(blk.cols - jp * M::B.nr);
                // The B micro-panel the next tiles sweep: into L2 a slice per tile of this one's sweep.
                let next_b = if !M::B.prefetch_next_b {
                    None
                } else if jp + 1 < b_tiles {
                    Some(&b_panel(jp + 1)[..kc * M::B.nr])
                } else if k0 + kc < steps && !b_per_block {
                    let next_kc = M::B.kc.min(steps - k0 - kc);
                    Some(&b_panel(0)[kc * M::B.nr..][..next_kc * M::B.nr])
                } else {
                    None
                };
                for ip in 0..a_tiles {
                    if let Some(next_b) = next_b {
                        prefetch::part_to_l2(next_b, ip, a_tiles);
                    }
                    let rows = M::B.mr.min(blk.rows - ip * M::B.mr);
                    // The steps of this k-block the tile sums: all of them unless `triangle` skips some.
                    let tile_rows = (blk.row + ip * M::B.mr, rows);
                    let (first, kc) =
                        tile_steps::<M>(self.triangle, tile_rows, blk.col + jp * M::B.nr, k0, kc);
                    let last_block = k0 + M::B.kc >= steps;
                    if kc == 0 && k0 > 0 && !(last_block && half.is_some()) {
                        // Nothing to add, and the tile holds its sums so far.
                        continue;
                    }
                    let b = b.wrapping_add((first - k0) * M::B.nr);
                    if let Some(rows) = a_rows {
                        // Every tile is whole here (`a_in_place`): rows `ip * MR ..` from step `first`.
                        let lda = self.a.row_stride;
                        let a = rows
                            .wrapping_add(ip * M::B.mr * lda + first * <M::Packed as PackInto>::K_PER_STEP);
                        let from = match row {
                            Some(row) => TileFrom::Row(row[jp * M::B.nr..].as_ptr()),
                            None if load => TileFrom::Tile,
                            None => TileFrom::Zero,
                        };
                        let to_half = half
                            .filter(|_| last_block)
                            .map(|(out, ldo)| (out.wrapping_add(ip * M::B.mr * ldo + jp * M::B.nr), ldo));
                        let tile = c.wrapping_add(ip * M::B.mr * ldc + jp * M::B.nr);
                        // SAFETY: as below; A's 32 rows from `a` hold the tile's `2 * kc` values of
                        // `k` (k is `2 * steps`, the rows lie inside A: layout::check).
                        unsafe { micro.tile_in_place(kc, (a, lda), b, (tile, ldc), from, to_half) };
                        continue;
                    }
                    let a = a_panel(ip, first).as_ptr();
                    // SAFETY: the tile's origin is inside the block (caller), panels hold `kc` steps from
                    // `first` (packed for every step a tile reads: `Kept`), the micro-kernel exists only
                    // where it runs, and `begin` was called above.
                    unsafe {
                        let tile = c.add(ip * M::B.mr * ldc + jp * M::B.nr);
                        let row = row.map(|row| &row[jp * M::B.nr..jp * M::B.nr + cols]);
                        let from = match row {
                            Some(row) => TileFrom::Row(row.as_ptr()),
                            None if load => TileFrom::Tile,
                            None => TileFrom::Zero,
                        };
                        // Where the tile's sums go when this k-block is its last: half C.
                        let to_half = match half {
                            Some((out, ldo)) if last_block => {
                                Some((out.add(ip * M::B.mr * ldo + jp * M::B.nr), ldo))
                            }
                            _ => None,
                        };
                        let full = rows == M::B.mr && cols == M::B.nr;
                        match to_half {
                            _ if kc == 0 => bare_tile((tile, ldc), (rows, cols), from, to_half),
                            Some(out) if full => micro.tile_to_half(kc, a, b, (tile, ldc), from, out),
                            Some(out) => {
                                edge_tile(micro, kc, a, b, (tile, ldc), (rows, cols), from, Some(out))
                            }
                            None if !full => {
                                edge_tile::<M, H>(micro, kc, a, b, (tile, ldc), (rows, cols), from, None)
                            }
                            None => match row {
                                Some(row) => micro.tile_from_row(kc, a, b, tile, ldc, row.as_ptr()),
                                None => micro.tile(kc, a, b, tile, ldc, load),
                            },
                        }
                    }
                }
            }
        }
        micro.end();
        if b_per_block {
            BLOCK_B.set(block_b);
        }
        if a_per_block {
            BLOCK_A.set(block_a);
        }
    }
}

/// Where a block's sums start in its first k-block.
#[derive(Clone, Copy)]
pub(super) enum TileStart<'a> {
    Zero,
    /// From what C holds.
    C,
    /// From this row (the block's columns of a bias) in every row.
    Row(&'a [f32]),
}
