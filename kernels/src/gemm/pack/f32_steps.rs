//! Panels of f32 words for the FMA kernels: a step is one `k`, the operand rounded to the compute
//! precision and widened (exact).

use super::across::steps_across;
use super::tile::through_tile;
use super::{prepare, Lines, PackInto, Source, MAX_WIDTH};
use crate::gemm::row_load::convert_run;
use crate::gemm::Compute;

impl PackInto for f32 {
    const K_PER_STEP: usize = 1;

    #[inline(always)]
    fn pack<S: Source>(src: &[S], lines: Lines, width: usize, compute: Compute, dst: &mut [f32]) {
        let dst = prepare(lines, width, 1, dst);
        if lines.k_stride == 1 && lines.line_stride != 1 && width <= MAX_WIDTH {
            // k contiguous: each line's run rounded into a tile (contiguous: vectorises).
            through_tile(src, lines, width, compute, dst);
        } else if lines.k_stride == 1 && lines.line_stride != 1 {
            for l in 0..lines.count {
                let line = &src[lines.base + l * lines.line_stride..][..lines.k];
                for (out, &x) in dst[l..].iter_mut().step_by(width).zip(line) {
                    *out = x.rounded(compute);
                }
            }
        } else if lines.line_stride == 1 {
            steps_across(src, lines, width, compute, dst);
        } else {
            for (s, row) in dst.chunks_exact_mut(width).enumerate() {
                for (l, out) in row[..lines.count].iter_mut().enumerate() {
                    *out = src[lines.base + s * lines.k_stride + l * lines.line_stride].rounded(compute);
                }
            }
        }
    }

    #[inline(always)]
    fn step<S: Source>(src: &[S], at: usize, s: usize, lines: Lines, compute: Compute) -> f32 {
        src[at + s * lines.k_stride].rounded(compute)
    }

    #[inline(always)]
    fn from_run<S: Source>(run: &[S], compute: Compute, out: &mut [f32]) {
        convert_run(run, compute, out);
    }

    #[inline(always)]
    fn across_lines<S: Source>(
        src: &[S],
        s: usize,
        lines: Lines,
        compute: Compute,
        out: &mut [f32],
        stride: usize,
    ) {
        let run = &src[lines.base + s * lines.k_stride..][..lines.count];
        if stride == 1 {
            convert_run(run, compute, out);
            return;
        }
        for (out, &x) in out.iter_mut().step_by(stride).zip(run) {
            *out = x.rounded(compute);
        }
    }

    fn from_words(words: &mut [u32]) -> &mut [f32] {
        // SAFETY: f32 and u32 have the same size and alignment and every u32 is a valid f32.
        unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast(), words.len()) }
    }
}

#[cfg(test)]
mod tests {
    use crate::gemm::pack::{Lines, PackInto};
    use crate::gemm::Compute;

    #[test]
    fn both_read_orders_pack_the_same_panel() {
        // The same 3 x 4 matrix stored row-major and column-major, packed as rows.
        let rows: Vec<f32> = (0..12).map(|x| x as f32 * 0.5).collect();
        let cols: Vec<f32> = (0..12).map(|i| rows[(i % 3) * 4 + i / 3]).collect();
        let by_row = Lines { base: 0, line_stride: 4, k_stride: 1, count: 3, k: 4, steps: 4 };
        let by_col = Lines { base: 0, line_stride: 1, k_stride: 3, count: 3, k: 4, steps: 4 };
        let (mut x, mut y) = (vec![0.0f32; 16], vec![0.0f32; 16]);
        f32::pack(&rows, by_row, 4, Compute::F32, &mut x);
        f32::pack(&cols, by_col, 4, Compute::F32, &mut y);
        assert_eq!(x, y);
        assert_eq!(&x[..4], &[0.0, 2.0, 4.0, 0.0]);
    }
}
