//! Packing for the driver: every panel of an operand before the blocks run, or a block's own
//! micro-panels of one k-block.

use rayon::prelude::*;

use super::{Block, Job};
use crate::gemm::layout::MatRef;
use crate::gemm::pack::{self, Lines, PackInto};
use crate::GradSlice;

impl Job<'_> {
    /// Packs every panel of `op` (its products `step` apart; lines = rows of A or columns of B:
    /// `(count, line stride, k stride)`) into panels of `width` lines and `steps` steps, in groups of
    /// `group` steps (`[steps / group][width][group]`). Of panel `p` of each matrix only the steps
    /// `kept(p) = (first, end)` are read (multiples of `group`; `first` and `end` rising with `p`):
    /// the panel is packed up to `end`, and where the lines are contiguous from `first` on.
    pub(super) fn pack<P: PackInto>(
        &self,
        (op, step): (&MatRef<'_>, usize),
        (count, line_stride, k_stride): (usize, usize, usize),
        (width, steps, group): (usize, usize, usize),
        kept: &Kept<'_>,
        dst: &mut [P],
        parallel: bool,
    ) {
        let k = self.dims.k;
        let panel_len = steps * width;
        if panel_len == 0 {
            return;
        }
        let panels = count.div_ceil(width);
        let compute = self.compute;
        if line_stride == 1 && group == 1 && width < pack::ACROSS_LINES / 2 {
            self.pack_across((op, step), (count, k_stride), (width, steps), kept, dst, parallel);
            return;
        }
        let pack_one = |(i, panel): (usize, &mut [P])| {
            let (item, p) = (i / panels, i % panels);
            let base = self.origin(item, op.batch_stride, step) + p * width * line_stride;
            let steps = kept(p).1;
            let (k, panel) = (k.min(steps * P::K_PER_STEP), &mut panel[..steps * width]);
            let lines = Lines { base, line_stride, k_stride, count: width.min(count - p * width), k, steps };
            match op.data {
                GradSlice::F32(s) => pack::pack_panel(s, lines, width, group, compute, panel),
                GradSlice::F16(s) => pack::pack_panel(s, lines, width, group, compute, panel),
                GradSlice::Bf16(s) => pack::pack_panel(s, lines, width, group, compute, panel),
            }
        };
        if parallel {
            dst.par_chunks_mut(panel_len).enumerate().for_each(pack_one);
        } else {
            dst.chunks_mut(panel_len).enumerate().for_each(pack_one);
        }
    }

    /// [`Job::pack`] for panels whose lines are contiguous: groups of panels packed together
    /// ([`pack::pack_panels_across`]), the groups of each batch item in parallel.
    fn pack_across<P: PackInto>(
        &self,
        (op, step): (&MatRef<'_>, usize),
        (count, k_stride): (usize, usize),
        (width, steps): (usize, usize),
        kept: &Kept<'_>,
        dst: &mut [P],
        parallel: bool,
    ) {
        let k = self.dims.k;
        let panel_len = steps * width;
        // At most ACROSS_LINES lines a group, and at least 8 groups in the whole product (when there are
        // panels enough), so that both threads get work; a batch of many items has groups enough at
        // full length (attention's products: 32 items of 128 lines each made groups of 18 lines).
        let panels = self.spacing.count * self.dims.batch * count.div_ceil(width);
        let per_group = (pack::ACROSS_LINES / width).min(panels.div_ceil(8)).max(1);
        let batch_len = count.div_ceil(width) * panel_len;
        let compute = self.compute;
        let pack_group = |item: usize, (g, group): (usize, &mut [P])| {
            let first = g * per_group * width;
            // The steps any panel of the group reads: from its first panel's first to its last's end.
            let span = (kept(g * per_group).0, kept(g * per_group + group.len() / panel_len - 1).1);
            let lines = Lines {
                base: self.origin(item, op.batch_stride, step) + first,
                line_stride: 1,
                k_stride,
                count: (count - first).min(per_group * width),
                k,
                steps,
            };
            match op.data {
                GradSlice::F32(s) => pack::pack_panels_across(s, lines, (width, span), compute, group),
                GradSlice::F16(s) => pack::pack_panels_across(s, lines, (width, span), compute, group),
                GradSlice::Bf16(s) => pack::pack_panels_across(s, lines, (width, span), compute, group),
            }
        };
        let per_batch = |(item, batch_dst): (usize, &mut [P])| {
            if parallel {
                batch_dst.par_chunks_mut(per_group * panel_len).enumerate().for_each(|g| pack_group(item, g));
            } else {
                batch_dst.chunks_mut(per_group * panel_len).enumerate().for_each(|g| pack_group(item, g));
            }
        };
        if parallel {
            dst.par_chunks_mut(batch_len).enumerate().for_each(per_batch);
        } else {
            dst.chunks_mut(batch_len).enumerate().for_each(per_batch);
        }
    }

    /// Packs the block's A micro-panels for steps `k0..k0 + kc` into `dst` (`[panel][kc / G][mr][G]`):
    /// lines that are contiguous (an operand read transposed: a weight gradient's `dY^T`) across up to
    /// [`pack::ACROSS_LINES`] lines at a time, others panel by panel.
    pub(super) fn pack_a_block<P: PackInto>(
        &self,
        blk: Block,
        (k0, kc): (usize, usize),
        (mr, group): (usize, usize),
        dst: &mut [P],
    ) {
        let op = &self.a;
        let k_start = k0 * P::K_PER_STEP;
        let k = self.dims.k.saturating_sub(k_start).min(kc * P::K_PER_STEP);
        let origin = self.origin(blk.batch, op.batch_stride, self.spacing.a) + k_start * op.col_stride;
        let panel_len = kc * mr;
        let across = op.row_stride == 1 && group == 1 && mr < pack::ACROSS_LINES / 2;
        let per_pack = if across { pack::ACROSS_LINES / mr } else { 1 };
        for (g, panels) in dst.chunks_mut(per_pack * panel_len).enumerate() {
            let row = blk.row + g * per_pack * mr;
            let count = (per_pack * mr).min(blk.row + blk.rows - row);
            let base = if k == 0 { 0 } else { origin + row * op.row_stride };
            let lines =
                Lines { base, line_stride: op.row_stride, k_stride: op.col_stride, count, k, steps: kc };
            let (shape, compute) = ((mr, (0, kc)), self.compute);
            match (op.data, across) {
                (GradSlice::F32(s), true) => pack::pack_panels_across(s, lines, shape, compute, panels),
                (GradSlice::F16(s), true) => pack::pack_panels_across(s, lines, shape, compute, panels),
                (GradSlice::Bf16(s), true) => pack::pack_panels_across(s, lines, shape, compute, panels),
                (GradSlice::F32(s), false) => pack::pack_panel(s, lines, mr, group, compute, panels),
                (GradSlice::F16(s), false) => pack::pack_panel(s, lines, mr, group, compute, panels),
                (GradSlice::Bf16(s), false) => pack::pack_panel(s, lines, mr, group, compute, panels),
            }
        }
    }

    /// Packs the block's B micro-panels for steps `k0..k0 + kc` into `dst` (`[panel][kc][nr]`).
    pub(super) fn pack_b_block<P: PackInto>(
        &self,
        blk: Block,
        (k0, kc): (usize, usize),
        nr: usize,
        dst: &mut [P],
    ) {
        let op = &self.b;
        let k_start = k0 * P::K_PER_STEP;
        // Past the last `k` (steps padded to a group) nothing is read: the panel is all padding.
        let k = self.dims.k.saturating_sub(k_start).min(kc * P::K_PER_STEP);
        for (p, panel) in dst.chunks_exact_mut(kc * nr).enumerate() {
            let col = blk.col + p * nr;
            let base = if k == 0 {
                0
            } else {
                self.origin(blk.batch, op.batch_stride, self.spacing.b)
                    + col * op.col_stride
                    + k_start * op.row_stride
            };
            let count = nr.min(self.dims.n - col);
            let lines =
                Lines { base, line_stride: op.col_stride, k_stride: op.row_stride, count, k, steps: kc };
            match op.data {
                GradSlice::F32(s) => pack::pack_panel(s, lines, nr, 1, self.compute, panel),
                GradSlice::F16(s) => pack::pack_panel(s, lines, nr, 1, self.compute, panel),
                GradSlice::Bf16(s) => pack::pack_panel(s, lines, nr, 1, self.compute, panel),
            }
        }
    }
}

/// The steps `(first, end)` of panel `p` (of its matrix) that its tiles read.
pub(super) type Kept<'a> = dyn Fn(usize) -> (usize, usize) + Sync + 'a;

/// A block's source of A or B micro-panels: the panels packed before the blocks, or (`true`) none, the
/// block packing its own a k-block at a time.
pub(super) type Panels<'a, P> = (&'a [P], bool);
