//! Packing: operands copied into the panels the micro-kernels read, rounded to the compute precision.
//!
//! A panel is `width` lines (rows of A, or columns of B) stored step by step, `dst[s * width + l]`, or
//! (A for the AMX kernel, [`pack_grouped`]) in groups of `G` steps, each group line by line:
//! `dst[(s / G) * width * G + l * G + s % G]`. For
//! the f32 kernels a step is one `k` and the value is the operand rounded to [`Compute`] then widened
//! (exact); for the bf16 dot-product kernels a step is the pair `(k = 2s, k = 2s + 1)` as one `u32`, the
//! even `k` in the low half. Lines past the operand's edge, the missing partner of an odd last `k` and
//! the steps a panel holds past `k` (padding to the kernel's step multiple) are zero, so edge tiles need
//! no special case inside the micro-kernel.
//!
//! The source is read in the order its memory is laid out: line by line when `k` is contiguous (a
//! row-major A, a transposed B), step by step otherwise.
//!
//! This file holds the panel's description ([`Lines`]), what a packed element is ([`PackInto`]) and
//! the entry points, compiled for the widest vectors the CPU has; `source` the operand types,
//! `f32_steps` and `bf16_pairs` the two packed element types, `tile` the panels contiguous along
//! `k`, `across` those whose lines are contiguous, `grouped` the AMX kernel's groups of steps.

use super::Compute;

use grouped::pack_grouped;
pub(crate) use source::Source;

use across::panels_across;

mod across;
mod bf16_pairs;
mod f32_steps;
mod grouped;
mod source;
mod tile;

/// The lines of one panel inside an operand's slice.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Lines {
    /// Index of line 0, k 0.
    pub(crate) base: usize,
    /// Distance between lines.
    pub(crate) line_stride: usize,
    /// Distance between consecutive `k`.
    pub(crate) k_stride: usize,
    /// Lines present (at most the panel's width).
    pub(crate) count: usize,
    /// Length along `k`.
    pub(crate) k: usize,
    /// Steps the panel holds: `k` in steps, or more (zero padding).
    pub(crate) steps: usize,
}

/// A packed element that can be made from any [`Source`].
pub(crate) trait PackInto: Copy + Default + Send + Sync {
    /// `k`s per step.
    const K_PER_STEP: usize;
    /// Packs one panel step by step (`dst.len() == lines.steps * width`).
    fn pack<S: Source>(src: &[S], lines: Lines, width: usize, compute: Compute, dst: &mut [Self]);
    /// Step `s` of the line whose `k = 0` is at `at`.
    fn step<S: Source>(src: &[S], at: usize, s: usize, lines: Lines, compute: Compute) -> Self;
    /// Consecutive steps from a run of consecutive `k` (`out.len() == run.len().div_ceil(K_PER_STEP)`).
    fn from_run<S: Source>(run: &[S], compute: Compute, out: &mut [Self]);
    /// Step `s` of every line of a panel whose lines are contiguous (`line_stride == 1`), line `l` into
    /// `out[l * stride]`.
    fn across_lines<S: Source>(
        src: &[S],
        s: usize,
        lines: Lines,
        compute: Compute,
        out: &mut [Self],
        stride: usize,
    );
    /// A buffer of 32-bit words seen as packed elements (both types are 4 bytes, every bit pattern valid).
    fn from_words(words: &mut [u32]) -> &mut [Self];
}

/// Steps converted at a time by the k-contiguous packing loops, before they are transposed into the
/// panel.
const CHUNK: usize = 64;

/// The widest panel those loops transpose through a tile on the stack (every micro-kernel's `nr` and
/// `mr`; a wider panel takes the plain loop).
const MAX_WIDTH: usize = 64;

/// The largest group of steps [`pack_grouped`] transposes through a tile (the AMX kernel's 16).
const MAX_GROUP: usize = 16;

widest_vectors! {
    /// Packs one panel: step by step when `group == 1` ([`PackInto::pack`]), else in groups of
    /// `group` steps ([`pack_grouped`]). The packing loops are plain Rust, compiled for the widest
    /// vector extension the CPU has, where the compiler vectorises them; every version writes the
    /// same bits.
    pub(crate) fn pack_panel<S: Source, P: PackInto>(
        src: &[S],
        lines: Lines,
        width: usize,
        group: usize,
        compute: Compute,
        dst: &mut [P],
    ) => pack_any;
}

#[inline(always)]
fn pack_any<S: Source, P: PackInto>(
    src: &[S],
    lines: Lines,
    width: usize,
    group: usize,
    compute: Compute,
    dst: &mut [P],
) {
    if group == 1 {
        P::pack(src, lines, width, compute, dst);
    } else {
        pack_grouped(src, lines, width, group, compute, dst);
    }
}

/// Lines per group of [`pack_panels_across`].
pub(crate) const ACROSS_LINES: usize = 96;

/// How many steps ahead packing fetches the source runs of contiguous lines into L1 (`across::fetch_ahead`).
/// Measured on Zen 4 (weight-gradient products, 2 threads): 4 and 8 gave the same speed-up, 16 less.
const PREFETCH_STEPS: usize = 4;

widest_vectors! {
    /// Packs consecutive panels of `width` lines (`dst` holds them, `lines.steps * width` each)
    /// whose lines are contiguous (`lines.line_stride == 1`: an operand read transposed), step by
    /// step across all of them at once: a step of a single panel is a run of `width` values per row,
    /// too short to pack well alone; across `lines.count <= ACROSS_LINES` lines it is one run that
    /// vectorises, then split among the panels. Writes what [`PackInto::pack`] writes for each panel,
    /// for the steps `span = (first, end)` of `shape = (width, span)` only (the rest is never read).
    pub(crate) fn pack_panels_across<S: Source, P: PackInto>(
        src: &[S],
        lines: Lines,
        shape: (usize, (usize, usize)),
        compute: Compute,
        dst: &mut [P],
    ) => panels_across;
}

/// Zeroes what the packing does not write (lines past the operand's edge, steps past `k`) and returns
/// the steps it writes.
#[inline(always)]
fn prepare<P: Copy + Default>(lines: Lines, width: usize, k_per_step: usize, dst: &mut [P]) -> &mut [P] {
    debug_assert_eq!(dst.len(), lines.steps * width);
    let (data, padding) = dst.split_at_mut(lines.k.div_ceil(k_per_step) * width);
    padding.fill(P::default());
    if lines.count < width {
        for row in data.chunks_exact_mut(width) {
            row[lines.count..].fill(P::default());
        }
    }
    data
}
