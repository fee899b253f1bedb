//! Panels whose lines hold their steps contiguously (`k` contiguous), packed through a tile or
//! transposed from where they lie.

use std::cell::Cell;

use super::{Lines, PackInto, Source, CHUNK, MAX_WIDTH};
use crate::gemm::row_load::Load;
use crate::gemm::transpose::{transpose, transpose_rows};
use crate::gemm::Compute;

thread_local! {
    /// The tile [`through_tile`] converts lines into, kept per thread (words of `P`). One on the stack
    /// was zeroed for every panel, 8 KiB for a 32-line one: as many bytes as an AMX B panel of 64 `k`
    /// holds, and 2% of the samples of attention's `q k^T` in cache (its `memset` calls).
    static TILE: Cell<Vec<u32>> = const { Cell::new(Vec::new()) };
}

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
    let mut words = TILE.take();
    if words.len() < CHUNK * W {
        words.resize(CHUNK * MAX_WIDTH, 0);
    }
    let tile = P::from_words(&mut words[..CHUNK * W]).as_chunks_mut::<CHUNK>().0;
    // Rows past the panel's lines read as zero (`transpose`'s contract); an earlier panel may have left
    // its values there. The rows of the panel's lines are written, for the steps read, before each block.
    for row in &mut tile[lines.count..] {
        row.fill(P::default());
    }
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
        transpose(tile, lines.count, steps, width, block);
    }
    TILE.set(words);
}

#[cfg(test)]
mod tests {
    use crate::gemm::pack::{Lines, PackInto, Source};
    use crate::gemm::Compute;

    #[test]
    fn a_panel_of_fewer_lines_than_the_one_before_still_has_zero_lines_past_its_own() {
        // On one thread, so both panels go through the same kept tile: 32 full lines, then 5 of them.
        let k = 40;
        let src: Vec<f32> = (0..32 * k).map(|x| x as f32 + 1.0).collect();
        let full = Lines { base: 0, line_stride: k, k_stride: 1, count: 32, k, steps: k };
        for (count, width) in [(32, 32), (5, 32), (32, 16), (3, 16)] {
            let lines = Lines { count, ..full };
            for compute in [Compute::F32, Compute::Bf16] {
                let mut dst = vec![f32::NAN; k * width];
                f32::pack(&src, Lines { count: count.min(width), ..lines }, width, compute, &mut dst);
                for (s, step) in dst.chunks_exact(width).enumerate() {
                    for (l, &x) in step.iter().enumerate() {
                        let want = if l < count { src[l * k + s].rounded(compute) } else { 0.0 };
                        assert_eq!(x, want, "count {count} width {width} step {s} line {l} {compute:?}");
                    }
                }
                let mut pairs = vec![u32::MAX; k / 2 * width];
                let pair_lines = Lines { count: count.min(width), steps: k / 2, ..lines };
                u32::pack(&src, pair_lines, width, compute, &mut pairs);
                for (s, step) in pairs.chunks_exact(width).enumerate() {
                    for (l, &x) in step.iter().enumerate() {
                        let bits = |x: f32| u32::from(half::bf16::from_f32(x).to_bits());
                        let want = if l < count {
                            bits(src[l * k + 2 * s]) | bits(src[l * k + 2 * s + 1]) << 16
                        } else {
                            0
                        };
                        assert_eq!(x, want, "pairs: count {count} width {width} step {s} line {l}");
                    }
                }
            }
        }
    }
}
