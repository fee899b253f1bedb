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

use half::{bf16, f16};

use super::prefetch;
use super::row_load::{convert_run, Load};
use super::transpose::{transpose, transpose_rows};
use super::Compute;
use crate::branchless as bits;

/// An operand element type.
pub(crate) trait Source: Copy + Send + Sync {
    /// The value rounded to `compute`, as f32 (exact widening).
    fn rounded(self, compute: Compute) -> f32;
    /// The value rounded to bf16, as bits.
    fn bf16_bits(self) -> u16;
    /// How a run of this type becomes its packed words for `compute` (`k_per_step` elements a word) in
    /// registers, so that it can be transposed into a panel where it lies: a plain load where it holds
    /// them already (f32 for f32 compute, bf16 pairs), else a conversion; `None` where there is none.
    fn register_load(compute: Compute, k_per_step: usize) -> Option<Load>;
}

impl Source for f32 {
    #[inline(always)]
    fn rounded(self, compute: Compute) -> f32 {
        match compute {
            Compute::F32 => self,
            Compute::F16 => bits::f16_rounded(self),
            Compute::Bf16 => f32::from_bits(u32::from(bits::bf16_bits(self)) << 16),
        }
    }
    #[inline(always)]
    fn bf16_bits(self) -> u16 {
        bits::bf16_bits(self)
    }
    #[inline(always)]
    fn register_load(compute: Compute, k_per_step: usize) -> Option<Load> {
        (k_per_step == 1).then(|| Load::from_f32(compute))
    }
}

impl Source for f16 {
    #[inline(always)]
    fn rounded(self, compute: Compute) -> f32 {
        match compute {
            Compute::F32 | Compute::F16 => bits::f16_to_f32(self),
            Compute::Bf16 => f32::from_bits(u32::from(bits::bf16_bits(bits::f16_to_f32(self))) << 16),
        }
    }
    #[inline(always)]
    fn bf16_bits(self) -> u16 {
        bits::bf16_bits(bits::f16_to_f32(self))
    }
    #[inline(always)]
    fn register_load(compute: Compute, k_per_step: usize) -> Option<Load> {
        (k_per_step == 1 && compute != Compute::Bf16).then_some(Load::F16ToF32)
    }
}

impl Source for bf16 {
    #[inline(always)]
    fn rounded(self, compute: Compute) -> f32 {
        match compute {
            Compute::F32 | Compute::Bf16 => self.to_f32(),
            Compute::F16 => bits::f16_rounded(self.to_f32()),
        }
    }
    #[inline(always)]
    fn bf16_bits(self) -> u16 {
        self.to_bits()
    }
    #[inline(always)]
    fn register_load(compute: Compute, k_per_step: usize) -> Option<Load> {
        match (k_per_step, compute) {
            // A pair word holds the even `k` in its low half: the little-endian order of the run.
            (2, _) => cfg!(target_endian = "little").then_some(Load::Words),
            (1, Compute::F32 | Compute::Bf16) => Some(Load::Bf16ToF32),
            _ => None,
        }
    }
}

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

/// Steps converted at a time by the k-contiguous packing loops, before they are transposed into the
/// panel.
const CHUNK: usize = 64;

/// The widest panel those loops transpose through a tile on the stack (every micro-kernel's `nr` and
/// `mr`; a wider panel takes the plain loop).
const MAX_WIDTH: usize = 64;

/// The largest group of steps [`pack_grouped`] transposes through a tile (the AMX kernel's 16).
const MAX_GROUP: usize = 16;

/// Packs a panel whose lines each hold their steps contiguously (`k` contiguous), a block of [`CHUNK`]
/// steps at a time: each line's run of the block is converted into a row of a tile (a run, so its loop
/// vectorises), then the tile is transposed into the panel step by step. The tile holds
/// as many lines as the panel (the kernels' widths have tiles of their own size; any other width up to
/// [`MAX_WIDTH`] uses the largest): a tile of the largest size, zeroed for each 6-line A panel, cost
/// more than the panel's own bytes.
#[inline(always)]
fn through_tile<S: Source, P: PackInto>(
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

/// How many steps ahead packing fetches the source runs of contiguous lines into L1 ([`fetch_ahead`]).
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

#[inline(always)]
fn panels_across<S: Source, P: PackInto>(
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
    let mut step = [P::default(); ACROSS_LINES];
    for s in first..end.min(lines.steps) {
        fetch_ahead::<S, P>(src, s, lines);
        if s < data_steps {
            P::across_lines(src, s, lines, compute, &mut step[..lines.count], 1);
        } else {
            step.fill(P::default());
        }
        for (q, panel) in dst.chunks_exact_mut(panel_len).enumerate() {
            let out = &mut panel[s * width..][..width];
            let present = width.min(lines.count.saturating_sub(q * width));
            if present == width {
                out.copy_from_slice(&step[q * width..][..width]);
            } else {
                out[..present].copy_from_slice(&step[q * width..][..present]);
                out[present..].fill(P::default());
            }
        }
    }
}

/// The data steps of one panel whose lines are contiguous (`line_stride == 1`), each a run of
/// `lines.count` elements per `k` into its row of `dst` (`[k-steps][width]`, the padding already
/// written by [`prepare`]).
#[inline(always)]
fn steps_across<S: Source, P: PackInto>(
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

/// A bf16 pair: the even `k` in the low half.
#[inline(always)]
fn pair<S: Source>(even: S, odd: S) -> u32 {
    u32::from(even.bf16_bits()) | u32::from(odd.bf16_bits()) << 16
}

/// The bf16 bits of a run of consecutive `k` as pairs (`k = 2s` in the low half of word `s`, as [`pair`]
/// makes them), into `out` (`run.len() <= 2 * out.len()`); halves past the run (an odd last `k`'s
/// partner) are zero. The words are written as 16-bit halves in the run's order, one loop that
/// vectorises (a plain copy for a bf16 run); on a little-endian target that order is already the
/// pairs', a big-endian one swaps each word's halves after.
#[inline(always)]
fn pairs_from_run<S: Source>(run: &[S], out: &mut [u32]) {
    debug_assert!(run.len() <= 2 * out.len());
    // SAFETY: the halves cover exactly `out`'s memory; u16 needs less alignment than u32, and every bit
    // pattern is valid for both.
    let halves = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u16>(), 2 * out.len()) };
    let (data, rest) = halves.split_at_mut(run.len());
    for (half, &x) in data.iter_mut().zip(run) {
        *half = x.bf16_bits();
    }
    rest.fill(0);
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

/// Packs one panel in groups of `group` steps, each group line by line (`[steps / group][width][group]`,
/// `dst.len() == lines.steps * width`, `lines.steps` a multiple of `group`).
#[inline(always)]
pub(crate) fn pack_grouped<S: Source, P: PackInto>(
    src: &[S],
    lines: Lines,
    width: usize,
    group: usize,
    compute: Compute,
    dst: &mut [P],
) {
    debug_assert_eq!((dst.len(), lines.steps % group), (lines.steps * width, 0));
    let data_steps = lines.k.div_ceil(P::K_PER_STEP);
    // For the lines-contiguous case below: declared once, not zeroed again for every group.
    let mut tile = [[P::default(); MAX_WIDTH]; MAX_GROUP];
    for (g, block) in dst.chunks_exact_mut(width * group).enumerate() {
        let first = g * group;
        let present = data_steps.saturating_sub(first).min(group);
        if lines.k_stride == 1 {
            // k contiguous: each line's part of the group is one run of the source.
            let (k0, k1) = (first * P::K_PER_STEP, ((first + present) * P::K_PER_STEP).min(lines.k));
            for (l, line) in block.chunks_exact_mut(group).enumerate() {
                let (data, padding) = line.split_at_mut(if l < lines.count { present } else { 0 });
                if !data.is_empty() {
                    let at = lines.base + l * lines.line_stride;
                    P::from_run(&src[at + k0..at + k1], compute, data);
                }
                padding.fill(P::default());
            }
        } else if lines.line_stride == 1 && width <= MAX_WIDTH && group <= MAX_GROUP {
            // Lines contiguous: each step's lines one run of the source, converted into a row of a tile
            // (contiguous: vectorises), then the tile transposed into the group line by line.
            block.fill(P::default());
            for (i, row) in tile[..present].iter_mut().enumerate() {
                P::across_lines(src, first + i, lines, compute, &mut row[..lines.count], 1);
            }
            for (l, line) in block.chunks_exact_mut(group).take(lines.count).enumerate() {
                for (out, row) in line.iter_mut().zip(&tile[..present]) {
                    *out = row[l];
                }
            }
        } else if lines.line_stride == 1 {
            block.fill(P::default());
            for i in 0..present {
                P::across_lines(src, first + i, lines, compute, &mut block[i..], group);
            }
        } else {
            block.fill(P::default());
            for i in 0..present {
                for l in 0..lines.count {
                    let at = lines.base + l * lines.line_stride;
                    block[l * group + i] = P::step(src, at, first + i, lines, compute);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn f32_operands_are_rounded_to_the_compute_precision() {
        let x = 1.0 + 2f32.powi(-12);
        assert_eq!(x.rounded(Compute::F32), x);
        assert_eq!(x.rounded(Compute::F16), 1.0);
        assert_eq!(x.rounded(Compute::Bf16), 1.0);
        assert_eq!((1.0f32 + 2f32.powi(-9)).rounded(Compute::F16), 1.0 + 2f32.powi(-9));
    }
}
