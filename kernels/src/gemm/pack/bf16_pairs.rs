//! Panels of bf16 pairs for the dot-product kernels: a step is the pair `(k = 2s, k = 2s + 1)` as one
//! `u32`, the even `k` in the low half.

use super::across::steps_across;
use super::tile::through_tile;
use super::{prepare, Lines, PackInto, Source, MAX_WIDTH};
use crate::gemm::Compute;

/// A bf16 pair: the even `k` in the low half.
#[inline(always)]
fn pair<S: Source>(even: S, odd: S) -> u32 {
    u32::from(even.bf16_bits()) | u32::from(odd.bf16_bits()) << 16
}

/// Values [`pairs_from_run`] converts as one block of known length.
const BLOCK: usize = 16;

/// The bf16 bits of a run of consecutive `k` as pairs (`k = 2s` in the low half of word `s`, as [`pair`]
/// makes them), into `out` (`run.len() <= 2 * out.len()`); halves past the run (an odd last `k`'s
/// partner) are zero. The words are written as 16-bit halves in the run's order (a plain copy for a
/// bf16 run), in blocks of 16 values: a block of known length is one vector operation per step of the
/// rounding, where a loop over a short run (32 values: a group of an AMX panel) ran the vectoriser's
/// 8-wide remainder loop. On a little-endian target that order is already the pairs', a big-endian one
/// swaps each word's halves after.
#[inline(always)]
fn pairs_from_run<S: Source>(run: &[S], out: &mut [u32]) {
    debug_assert!(run.len() <= 2 * out.len());
    // SAFETY: the halves cover exactly `out`'s memory; u16 needs less alignment than u32, and every bit
    // pattern is valid for both.
    let halves = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u16>(), 2 * out.len()) };
    let (data, rest) = halves.split_at_mut(run.len());
    let (blocks, tail) = run.as_chunks::<BLOCK>();
    let (block_halves, tail_halves) = data.split_at_mut(blocks.len() * BLOCK);
    for (halves, block) in block_halves.as_chunks_mut::<BLOCK>().0.iter_mut().zip(blocks) {
        *halves = block.map(S::bf16_bits);
    }
    for (half, &x) in tail_halves.iter_mut().zip(tail) {
        *half = x.bf16_bits();
    }
    // An odd run's last partner: a store, where `fill` calls `memset` even for nothing.
    for half in rest {
        *half = 0;
    }
    if cfg!(target_endian = "big") {
        for word in out.iter_mut() {
            *word = word.rotate_left(16);
        }
    }
}

impl PackInto for u32 {
    const K_PER_STEP: usize = 2;

    #[inline(always)]
    fn pack<S: Source>(src: &[S], lines: Lines, width: usize, _compute: Compute, dst: &mut [u32]) {
        let dst = prepare(lines, width, 2, dst);
        let pairs = lines.k / 2;
        if lines.k_stride == 1 && lines.line_stride != 1 && width <= MAX_WIDTH {
            // k contiguous: each line's pairs are adjacent elements, its run rounded to bf16 bits and
            // paired into a tile (contiguous: vectorises; an odd last `k` finds its partner zero).
            through_tile(src, lines, width, Compute::Bf16, dst);
        } else if lines.k_stride == 1 && lines.line_stride != 1 {
            for l in 0..lines.count {
                let line = &src[lines.base + l * lines.line_stride..][..lines.k];
                let mut outs = dst[l..].iter_mut().step_by(width);
                // The pairs drive the zip, so `outs` is not advanced past the last full pair.
                for (two, out) in line.chunks_exact(2).zip(outs.by_ref()) {
                    *out = pair(two[0], two[1]);
                }
                if let (true, Some(out)) = (lines.k % 2 == 1, outs.next()) {
                    *out = u32::from(line[lines.k - 1].bf16_bits());
                }
            }
        } else if lines.line_stride == 1 {
            // Lines contiguous: two contiguous runs (k = 2s and 2s + 1) interleaved a step at a time.
            steps_across(src, lines, width, Compute::Bf16, dst);
        } else {
            for (s, row) in dst.chunks_exact_mut(width).enumerate() {
                for (l, out) in row[..lines.count].iter_mut().enumerate() {
                    let at = lines.base + 2 * s * lines.k_stride + l * lines.line_stride;
                    let odd = if s < pairs { src[at + lines.k_stride].bf16_bits() } else { 0 };
                    *out = u32::from(src[at].bf16_bits()) | u32::from(odd) << 16;
                }
            }
        }
    }

    #[inline(always)]
    fn step<S: Source>(src: &[S], at: usize, s: usize, lines: Lines, _compute: Compute) -> u32 {
        let even = at + 2 * s * lines.k_stride;
        let odd = if 2 * s + 1 < lines.k { src[even + lines.k_stride].bf16_bits() } else { 0 };
        u32::from(src[even].bf16_bits()) | u32::from(odd) << 16
    }

    #[inline(always)]
    fn from_run<S: Source>(run: &[S], _compute: Compute, out: &mut [u32]) {
        pairs_from_run(run, out);
    }

    #[inline(always)]
    fn across_lines<S: Source>(
        src: &[S],
        s: usize,
        lines: Lines,
        _compute: Compute,
        out: &mut [u32],
        stride: usize,
    ) {
        let even = &src[lines.base + 2 * s * lines.k_stride..][..lines.count];
        if stride == 1 {
            // Contiguous: loops that vectorise.
            if 2 * s + 1 < lines.k {
                let odd = &src[lines.base + (2 * s + 1) * lines.k_stride..][..lines.count];
                for ((out, &e), &o) in out.iter_mut().zip(even).zip(odd) {
                    *out = pair(e, o);
                }
            } else {
                for (out, &e) in out.iter_mut().zip(even) {
                    *out = u32::from(e.bf16_bits());
                }
            }
            return;
        }
        let outs = out.iter_mut().step_by(stride);
        if 2 * s + 1 < lines.k {
            let odd = &src[lines.base + (2 * s + 1) * lines.k_stride..][..lines.count];
            for ((out, &e), &o) in outs.zip(even).zip(odd) {
                *out = pair(e, o);
            }
        } else {
            for (out, &e) in outs.zip(even) {
                *out = u32::from(e.bf16_bits());
            }
        }
    }

    fn from_words(words: &mut [u32]) -> &mut [u32] {
        words
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use crate::gemm::pack::{Lines, PackInto};
    use crate::gemm::Compute;

    #[test]
    fn pairs_interleave_consecutive_k_and_pad_an_odd_last_k_and_absent_lines_with_zero() {
        // A 2 x 3 row-major matrix packed as rows (k contiguous) into a width-3 panel.
        let src: Vec<bf16> = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0].map(bf16::from_f32).to_vec();
        let lines = Lines { base: 0, line_stride: 3, k_stride: 1, count: 2, k: 3, steps: 2 };
        let mut dst = vec![u32::MAX; 2 * 3];
        u32::pack(&src, lines, 3, Compute::Bf16, &mut dst);
        let pair = |even: f32, odd: f32| {
            u32::from(bf16::from_f32(even).to_bits()) | u32::from(bf16::from_f32(odd).to_bits()) << 16
        };
        assert_eq!(dst, [pair(1.0, 2.0), pair(4.0, 5.0), 0, pair(3.0, 0.0), pair(6.0, 0.0), 0]);
    }
}
