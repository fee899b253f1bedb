//! Panels whose lines hold their steps contiguously (`k` contiguous), packed through a tile or
//! transposed from where they lie.

use super::{Lines, PackInto, Source, CHUNK, MAX_WIDTH};
use crate::gemm::row_load::Load;
use crate::gemm::transpose::{transpose, transpose_rows};
use crate::gemm::Compute;

/// Packs a panel whose lines each hold their steps contiguously (`k` contiguous), a block of [`CHUNK`]
/// steps at a time: each line's run of the block is converted into a row of a tile (a run, so its loop
/// vectorises), then the tile is transposed into the panel step by step. The tile holds
/// as many lines as the panel (the kernels' widths have tiles of their own size; any other width up to
/// [`MAX_WIDTH`] uses the largest): a tile of the largest size, zeroed for each 6-line A panel, cost
/// more than the panel's own bytes.
#[inline(always)]
pub(super) fn through_tile<S: Source, P: PackInto>(
    src: &[S],
    lines: Lines,
    width: usize,
    compute: Compute,
    data: &mut [P],
) {
    match width {
        6 => through_tile_of::<S, P, 6>(src, lines, width, compute, data),
        16 => through_tile_of::<S, P, 16>(src, lines, width, compute, data),
        32 => through_tile_of::<S, P, 32>(src, lines, width, compute, data),
        _ => through_tile_of::<S, P, MAX_WIDTH>(src, lines, width, compute, data),
    }
}

/// [`through_tile`] with a tile of `W >= width` lines. Each line's run becomes a row through
/// [`PackInto::from_run`] (no closure: one passed in was compiled as a function of its own, without
/// the vector extensions of the loop it was written in).
#[inline(always)]
fn through_tile_of<S: Source, P: PackInto, const W: usize>(
    src: &[S],
    lines: Lines,
    width: usize,
    compute: Compute,
    data: &mut [P],
) {
    debug_assert!(lines.count <= width && width <= W);
    // Where the operand holds the panel's words (f32 for f32 compute, bf16 pairs) or a register load
    // converts it into them, and every line is present, whole blocks are transposed from where they
    // lie: no copy into the tile.
    let element = std::mem::size_of::<S>();
    let load = S::register_load(compute, P::K_PER_STEP).filter(|&load| {
        lines.count == width
            && (load != Load::Words
                || ((lines.line_stride * element).is_multiple_of(4)
                    && (src.as_ptr() as usize + lines.base * element).is_multiple_of(4)))
    });
    let mut tile = [[P::default(); CHUNK]; W];
    for (c, block) in data.chunks_mut(CHUNK * width).enumerate() {
        let steps = block.len() / width;
        let k0 = c * CHUNK * P::K_PER_STEP;
        if let Some(load) = load.filter(|_| k0 + steps * P::K_PER_STEP <= lines.k) {
            let first = &src[lines.base + k0..];
            let last_line = (width - 1) * lines.line_stride + steps * P::K_PER_STEP;
            assert!(first.len() >= last_line, "the panel's lines lie inside the operand");
            let row = lines.line_stride * element;
            // SAFETY: each line holds `steps` words of data (`k0 + steps * K_PER_STEP <= k`) inside
            // `src` (asserted), `row` bytes apart; plain words start 4-byte aligned (checked above).
            if unsafe { transpose_rows(first.as_ptr().cast::<u8>(), row, load, steps, width, block) } {
                continue;
            }
        }
        let run_len = (steps * P::K_PER_STEP).min(lines.k - k0);
        for (l, row) in tile[..lines.count].iter_mut().enumerate() {
            let run = &src[lines.base + l * lines.line_stride + k0..][..run_len];
            P::from_run(run, compute, &mut row[..steps]);
        }
        transpose(&tile, lines.count, steps, width, block);
    }
}
