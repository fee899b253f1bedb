//! Panels whose lines are contiguous (an operand read transposed): each step one run across the
//! lines.

use super::{Lines, PackInto, Source, ACROSS_LINES, PREFETCH_STEPS};
use crate::gemm::prefetch;
use crate::gemm::Compute;

#[inline(always)]
pub(super) fn panels_across<S: Source, P: PackInto>(
    src: &[S],
    lines: Lines,
    (width, span): (usize, (usize, usize)),
    compute: Compute,
    dst: &mut [P],
) {
    // The register kernels' panels (A: 6 lines; B: 16 on AVX2, 64 on AVX-512) take versions whose
    // copies are of a known size: a copy of `width` elements otherwise calls `memcpy` for every
    // panel at every step (a fifth of an fp32 weight-gradient product's packing on Zen 4).
    match width {
        6 => panels_across_of::<S, P, 6>(src, lines, (width, span), compute, dst),
        16 => panels_across_of::<S, P, 16>(src, lines, (width, span), compute, dst),
        64 => panels_across_of::<S, P, 64>(src, lines, (width, span), compute, dst),
        _ => panels_across_of::<S, P, 0>(src, lines, (width, span), compute, dst),
    }
}

/// [`panels_across`] for panels of `W` lines, or of `width` lines when `W` is 0.
#[inline(always)]
fn panels_across_of<S: Source, P: PackInto, const W: usize>(
    src: &[S],
    lines: Lines,
    (width, (first, end)): (usize, (usize, usize)),
    compute: Compute,
    dst: &mut [P],
) {
    debug_assert!(lines.line_stride == 1 && lines.count <= ACROSS_LINES && (W == 0 || W == width));
    let width = if W > 0 { W } else { width };
    let panel_len = lines.steps * width;
    let data_steps = lines.k.div_ceil(P::K_PER_STEP);
    let end = end.min(lines.steps);
    // A chunk of steps is gathered first, then written panel by panel: each panel's part of the chunk
    // is one contiguous run of whole cache lines. Written step by step instead, every step touched
    // every panel with a run shorter than a line (6 floats for an A panel), and panels of a k-block
    // lie a multiple of 4 KiB apart (512 steps x 6 floats = 12 KiB), so all of them sat in one L1 set
    // and each line was evicted before it was full: on an Intel Xeon, half of the packing's samples
    // were on one store, and the packing a fifth of an fp32 weight-gradient product.
    let mut chunk = [[P::default(); ACROSS_LINES]; CHUNK_STEPS];
    let mut s0 = first;
    while s0 < end {
        let len = CHUNK_STEPS.min(end - s0);
        for (i, step) in chunk[..len].iter_mut().enumerate() {
            let s = s0 + i;
            fetch_ahead::<S, P>(src, s, lines);
            if s < data_steps {
                P::across_lines(src, s, lines, compute, &mut step[..lines.count], 1);
            } else {
                step.fill(P::default());
            }
        }
        for (q, panel) in dst.chunks_exact_mut(panel_len).enumerate() {
            let present = width.min(lines.count.saturating_sub(q * width));
            let out = &mut panel[s0 * width..][..len * width];
            for (out, step) in out.chunks_exact_mut(width).zip(&chunk[..len]) {
                if present == width {
                    out.copy_from_slice(&step[q * width..][..width]);
                } else {
                    out[..present].copy_from_slice(&step[q * width..][..present]);
                    out[present..].fill(P::default());
                }
            }
        }
        s0 += len;
    }
}

/// Steps [`panels_across`] gathers before writing them out: 8 steps of an A panel (6 lines) are 192
/// bytes, three cache lines.
const CHUNK_STEPS: usize = 8;

/// The data steps of one panel whose lines are contiguous (`line_stride == 1`), each a run of
/// `lines.count` elements per `k` into its row of `dst` (`[k-steps][width]`, the padding already
/// written by [`super::prepare`]).
#[inline(always)]
pub(super) fn steps_across<S: Source, P: PackInto>(
    src: &[S],
    lines: Lines,
    width: usize,
    compute: Compute,
    dst: &mut [P],
) {
    for (s, row) in dst.chunks_exact_mut(width).enumerate() {
        fetch_ahead::<S, P>(src, s, lines);
        P::across_lines(src, s, lines, compute, &mut row[..lines.count], 1);
    }
}

/// Fetches into L1 the source runs of step `s + PREFETCH_STEPS` of lines that are contiguous.
///
/// The hardware prefetchers do not follow these short runs `k_stride` apart (a transposed operand's
/// runs each lie in their own 4 KiB page when `k_stride` is large): without this, packing waits on
/// memory at every step (two thirds of `pack_panels_across`' samples were on its loads).
#[inline(always)]
fn fetch_ahead<S: Source, P: PackInto>(src: &[S], s: usize, lines: Lines) {
    for r in 0..P::K_PER_STEP {
        let k = (s + PREFETCH_STEPS) * P::K_PER_STEP + r;
        if k < lines.k {
            prefetch::run_to_l1(src, lines.base + k * lines.k_stride, lines.count);
        }
    }
}
