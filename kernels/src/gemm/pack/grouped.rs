//! Panels in groups of steps, each group line by line (A for the AMX kernel).

use super::{Lines, PackInto, Source, MAX_GROUP, MAX_WIDTH};
use crate::gemm::Compute;

/// Packs one panel in groups of `group` steps, each group line by line (`[steps / group][width][group]`,
/// `dst.len() == lines.steps * width`, `lines.steps` a multiple of `group`).
#[inline(always)]
pub(super) fn pack_grouped<S: Source, P: PackInto>(
    src: &[S],
    lines: Lines,
    width: usize,
    group: usize,
    compute: Compute,
    dst: &mut [P],
) {
    debug_assert_eq!((dst.len(), lines.steps % group), (lines.steps * width, 0));
    let data_steps = lines.k.div_ceil(P::K_PER_STEP);
    // The steps of group `g` that hold data.
    let present = |g: usize| data_steps.saturating_sub(g * group).min(group);
    if lines.k_stride == 1 {
        // k contiguous: each line's part of the group is one run of the source.
        for (g, block) in dst.chunks_exact_mut(width * group).enumerate() {
            let (first, present) = (g * group, present(g));
            let (k0, k1) = (first * P::K_PER_STEP, ((first + present) * P::K_PER_STEP).min(lines.k));
            for (l, line) in block.chunks_exact_mut(group).enumerate() {
                let (data, padding) = line.split_at_mut(if l < lines.count { present } else { 0 });
                if !data.is_empty() {
                    let at = lines.base + l * lines.line_stride;
                    P::from_run(&src[at + k0..at + k1], compute, data);
                }
                // Stores: `fill` calls `memset`, even for nothing (most lines have no padding).
                for word in padding {
                    *word = P::default();
                }
            }
        }
    } else if lines.line_stride == 1 && width <= MAX_WIDTH && group <= MAX_GROUP {
        // Lines contiguous: each step's lines one run of the source, converted into a row of a tile
        // (contiguous: vectorises), then the tile transposed into the group line by line. The tile is
        // declared (zeroed) once per panel, and only here: the k-contiguous panels above zeroed its 4
        // KiB too, as many bytes as an AMX A panel of 64 `k` holds (1% of attention's `q k^T` in cache).
        let mut tile = [[P::default(); MAX_WIDTH]; MAX_GROUP];
        for (g, block) in dst.chunks_exact_mut(width * group).enumerate() {
            let (first, present) = (g * group, present(g));
            block.fill(P::default());
            for (i, row) in tile[..present].iter_mut().enumerate() {
                P::across_lines(src, first + i, lines, compute, &mut row[..lines.count], 1);
            }
            for (l, line) in block.chunks_exact_mut(group).take(lines.count).enumerate() {
                for (out, row) in line.iter_mut().zip(&tile[..present]) {
                    *out = row[l];
                }
            }
        }
    } else {
        for (g, block) in dst.chunks_exact_mut(width * group).enumerate() {
            let (first, present) = (g * group, present(g));
            block.fill(P::default());
            for i in 0..present {
                if lines.line_stride == 1 {
                    P::across_lines(src, first + i, lines, compute, &mut block[i..], group);
                } else {
                    for l in 0..lines.count {
                        let at = lines.base + l * lines.line_stride;
                        block[l * group + i] = P::step(src, at, first + i, lines, compute);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::pack_grouped;
    use crate::gemm::pack::{Lines, PackInto};
    use crate::gemm::Compute;

    #[test]
    fn grouped_panels_hold_each_group_line_by_line_and_pad_steps_and_lines_with_zero() {
        // A 3 x 5 row-major f32 matrix (k = 5) packed as rows into a width-4 panel of 2 groups of 4 steps.
        let src: Vec<f32> = (0..15).map(|x| x as f32).collect();
        let lines = Lines { base: 0, line_stride: 5, k_stride: 1, count: 3, k: 5, steps: 8 };
        let mut dst = vec![f32::NAN; 8 * 4];
        pack_grouped(&src, lines, 4, 4, Compute::F32, &mut dst);
        #[rustfmt::skip]
        let want = [
            0.0, 1.0, 2.0, 3.0,   5.0, 6.0, 7.0, 8.0,   10.0, 11.0, 12.0, 13.0,   0.0, 0.0, 0.0, 0.0,
            4.0, 0.0, 0.0, 0.0,   9.0, 0.0, 0.0, 0.0,   14.0, 0.0, 0.0, 0.0,      0.0, 0.0, 0.0, 0.0,
        ];
        assert_eq!(dst, want);
        // One group of width 1 is the step-major layout.
        let (mut grouped, mut step_major) = (vec![0.0f32; 12], vec![0.0f32; 12]);
        let lines = Lines { base: 0, line_stride: 5, k_stride: 1, count: 3, k: 4, steps: 4 };
        pack_grouped(&src, lines, 3, 1, Compute::F32, &mut grouped);
        f32::pack(&src, lines, 3, Compute::F32, &mut step_major);
        assert_eq!(grouped, step_major);
    }
}
