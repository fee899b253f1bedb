//! The blocked, parallel GEMM loop around a micro-kernel.
//!
//! 1. Both operands are packed once, every panel of every batch in parallel, into buffers kept per
//!    calling thread (they grow to the largest product seen and are reused), each starting on a cache
//!    line so that no vector or tile row load of a panel straddles two lines. (With one block of rows,
//!    each block packs its own B panels instead, a k-block at a time, just before reading them.)
//! 2. C is cut into blocks of `MC x NC`; blocks run in parallel, consecutive ones sharing the larger
//!    packed operand's panels (so each thread mostly reads what it packed). Inside a block, for each
//!    k-block of `KC` steps, each B micro-panel (`KC x NR`: in L1 or L2, [`micro::Blocking`]) is
//!    swept by every A micro-panel of the block (for the AVX2 kernel, whose micro-panel is swept from
//!    L1, while the next one is prefetched into L2; [`super::prefetch`]).
//! 3. f32 output is accumulated in place; f16 / bf16 output is rounded once, from each tile's sums after
//!    its last k-block, so a half C never holds a partial sum (earlier k-blocks' sums wait in an f32
//!    scratch block per worker thread). A block starts from zero, from C, or from a bias row
//!    ([`Start`]): the AMX and zmm kernels load the row into their tiles, the others have it copied
//!    into each tile's rows just before its products.
//!
//! 4. Products of one shape at fixed distances ([`Spacing`]: attention's heads) are one batch of all
//!    their matrices, so one parallel loop runs them. A [`Triangle`] narrows each tile's steps to those
//!    where A is not known to be zero, or leaves a tile of C wholly above the diagonal at its start.
//!
//! Every element of C is one FMA chain in `k` order regardless of blocking or thread count. (bf16
//! products with few rows of A and both operands contiguous along `k` take [`super::skinny`] instead.)

use std::cell::Cell;

use half::{bf16, f16};
use rayon::prelude::*;

use super::layout::{Dims, MatMut, MatRef, Placement, Triangle};
use super::micro::{self, HalfC, Micro, TileFrom, MAX_TILE};
use super::pack::{self, Lines, PackInto};
use super::prefetch;
use super::skinny;
use super::{Compute, GemmPath, Start};
use crate::slices::Float;
use crate::{GradSlice, GradSliceMut};

/// Products below this many flops run on the calling thread only.
const PARALLEL_FLOPS: f64 = 4.0e6;

thread_local! {
    /// Packed A and B of the calling thread's last product, kept for the next.
    static PACKED: Cell<(Vec<u32>, Vec<u32>)> = const { Cell::new((Vec::new(), Vec::new())) };
    /// A worker's f32 block for half output.
    static SCRATCH: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    /// A worker's B micro-panels of one block and k-block, when blocks pack their own.
    static BLOCK_B: Cell<Vec<u32>> = const { Cell::new(Vec::new()) };
    /// A block's own A micro-panels of one k-block, where it packs them itself.
    static BLOCK_A: Cell<Vec<u32>> = const { Cell::new(Vec::new()) };
}

/// Runs a product already validated by `layout::check` and `GemmPath::check`.
pub(crate) fn run(
    path: GemmPath,
    dims: Dims,
    a: MatRef<'_>,
    b: MatRef<'_>,
    c: MatMut<'_>,
    compute: Compute,
    start: Start<'_>,
) {
    run_job(path, Job::one(dims, a, b, Out::new(c), compute, start));
}

/// The product into a new dense C of `len = batch * m * n` elements (`start` is not `Output`).
pub(crate) fn run_new<T: NewElement>(
    path: GemmPath,
    dims: Dims,
    a: MatRef<'_>,
    b: MatRef<'_>,
    compute: Compute,
    start: Start<'_>,
    len: usize,
) -> Vec<T> {
    debug_assert!(!matches!(start, Start::Output), "a new C has nothing to start from");
    let mut c: Vec<T> = Vec::with_capacity(len);
    let out = Out { ptr: T::ptr(c.as_mut_ptr()), row_stride: dims.n, batch_stride: dims.m * dims.n };
    run_job(path, Job::one(dims, a, b, out, compute, start));
    // SAFETY: C is dense (row stride n, batch stride m * n) inside its `len` elements, and the job
    // wrote every one of them: each block's first k-block stores its tiles without loading them
    // (`Start::Zero` and `Start::Bias` never read C), edge tiles copy their present part out, and an
    // empty k fills the block with its start.
    unsafe { c.set_len(len) };
    c
}

/// [`run_new`] for `groups` of products (C `(batch, m, count * n)` side by side, or `(count, batch, m,
/// n)` stacked), each product `g` reading `a` and `b` `g` steps on; `triangle` says what may be skipped.
/// One job runs them all, unless the skinny path takes them (one product at a time, as it would alone).
pub(crate) fn run_new_groups<T: NewElement>(
    path: GemmPath,
    dims: Dims,
    (a, b): (MatRef<'_>, MatRef<'_>),
    groups: &super::Groups,
    compute: Compute,
    triangle: Triangle,
) -> Vec<T> {
    let len = groups.count * dims.batch * dims.m * dims.n;
    let mut c: Vec<T> = Vec::with_capacity(len);
    let (row_stride, batch_stride, c_step) = match groups.placement {
        Placement::SideBySide => {
            let width = groups.count * dims.n;
            (width, dims.m * width, dims.n)
        }
        Placement::Stacked => (dims.n, dims.m * dims.n, dims.batch * dims.m * dims.n),
    };
    let base = c.as_mut_ptr();
    let out = |g: usize| Out {
        // Product g's C starts at `g * c_step < len` unless C is empty (an empty batch, m or n), when
        // the job writes nothing.
        ptr: T::ptr(base.wrapping_add(g * c_step)),
        row_stride,
        batch_stride,
    };
    let spacing = Spacing { count: groups.count, a: groups.a_step, b: groups.b_step, c: c_step };
    let whole = Job { dims, a, b, out: out(0), compute, start: Start::Zero, spacing, triangle };
    if groups.count > 1 && skinny::applies(path, &whole) {
        for g in 0..groups.count {
            const CHECKED: &str = "check_groups found every product inside its operands";
            let a = a.advanced(g * groups.a_step).expect(CHECKED);
            let b = b.advanced(g * groups.b_step).expect(CHECKED);
            let one = Job { a, b, out: out(g), spacing: Spacing::ONE, ..whole };
            run_job(path, one);
        }
    } else {
        run_job(path, whole);
    }
    // SAFETY: the products' columns (side by side) or matrices (stacked) partition C, and each product
    // wrote every element of its part, as in `run_new`.
    unsafe { c.set_len(len) };
    c
}

/// An element type of C.
pub(crate) trait NewElement: Sized {
    fn ptr(p: *mut Self) -> Ptr;
}

impl NewElement for f32 {
    fn ptr(p: *mut f32) -> Ptr {
        Ptr::F32(p)
    }
}

impl NewElement for f16 {
    fn ptr(p: *mut f16) -> Ptr {
        Ptr::F16(p)
    }
}

impl NewElement for bf16 {
    fn ptr(p: *mut bf16) -> Ptr {
        Ptr::Bf16(p)
    }
}

fn run_job(path: GemmPath, job: Job<'_>) {
    const CHECKED: &str = "GemmPath::check found this path supported";
    let Dims { batch, m, n, .. } = job.dims;
    if batch == 0 || m == 0 || n == 0 {
        return;
    }
    if skinny::applies(path, &job) {
        debug_assert_eq!(job.spacing.count, 1, "the skinny path runs one product");
        let parallel = job.dims.flops() >= PARALLEL_FLOPS;
        match path {
            #[cfg(target_arch = "x86_64")]
            GemmPath::Avx512Bf16 => {
                job.run_skinny(skinny::RowDotsAvx512Bf16::new().expect(CHECKED), parallel)
            }
            _ => job.run_skinny(skinny::RowDotsModel, parallel),
        }
        return;
    }
    match path {
        GemmPath::Portable => job.run(micro::FmaPortable),
        GemmPath::Avx512Model => job.run(micro::FmaWideModel),
        GemmPath::Avx512Bf16Model => job.run(micro::DotModel),
        GemmPath::AmxBf16Model => job.run(micro::TileModel),
        #[cfg(target_arch = "x86_64")]
        GemmPath::Avx2 => job.run(micro::FmaAvx2::new().expect(CHECKED)),
        #[cfg(target_arch = "x86_64")]
        GemmPath::Avx512 => job.run(micro::FmaAvx512::new().expect(CHECKED)),
        #[cfg(target_arch = "x86_64")]
        GemmPath::Avx512Bf16 => job.run(micro::DotAvx512Bf16::new().expect(CHECKED)),
        #[cfg(target_arch = "x86_64")]
        GemmPath::AmxBf16 => job.run(micro::TileAmx::new().expect(CHECKED)),
        #[cfg(not(target_arch = "x86_64"))]
        GemmPath::Avx2 | GemmPath::Avx512 | GemmPath::Avx512Bf16 | GemmPath::AmxBf16 => {
            unreachable!("{CHECKED}")
        }
    }
}

/// C as a raw pointer, so that parallel blocks can write their disjoint parts.
#[derive(Clone, Copy)]
pub(crate) enum Ptr {
    F32(*mut f32),
    F16(*mut f16),
    Bf16(*mut bf16),
}

#[derive(Clone, Copy)]
pub(crate) struct Out {
    pub(crate) ptr: Ptr,
    pub(crate) row_stride: usize,
    pub(crate) batch_stride: usize,
}

// SAFETY: blocks write disjoint elements of C (`layout::check` proved C's elements distinct) and the
// borrow of C outlives the parallel loop.
unsafe impl Send for Out {}
// SAFETY: as above.
unsafe impl Sync for Out {}

impl Out {
    fn new(c: MatMut<'_>) -> Out {
        let ptr = match c.data {
            GradSliceMut::F32(s) => Ptr::F32(s.as_mut_ptr()),
            GradSliceMut::F16(s) => Ptr::F16(s.as_mut_ptr()),
            GradSliceMut::Bf16(s) => Ptr::Bf16(s.as_mut_ptr()),
        };
        Out { ptr, row_stride: c.row_stride, batch_stride: c.batch_stride }
    }
}

/// One product, or several of the same shape ([`Spacing`]): operands, C and its start, validated, and
/// the zeros it may skip.
#[derive(Clone, Copy)]
pub(crate) struct Job<'a> {
    pub(crate) dims: Dims,
    pub(crate) a: MatRef<'a>,
    pub(crate) b: MatRef<'a>,
    pub(crate) out: Out,
    pub(crate) compute: Compute,
    pub(crate) start: Start<'a>,
    pub(crate) spacing: Spacing,
    pub(crate) triangle: Triangle,
}

/// Products of the same shape and strides at fixed distances: product `g` reads A and B and writes C
/// `g * a`, `g * b` and `g * c` elements after product 0. The driver treats them as one batch of
/// `count * batch` matrices.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Spacing {
    pub(crate) count: usize,
    pub(crate) a: usize,
    pub(crate) b: usize,
    pub(crate) c: usize,
}

impl Spacing {
    /// A single product.
    pub(crate) const ONE: Spacing = Spacing { count: 1, a: 0, b: 0, c: 0 };
}

/// A block of C: its matrix (of all the products' batches), first row and column, and its size.
#[derive(Clone, Copy)]
struct Block {
    batch: usize,
    row: usize,
    col: usize,
    rows: usize,
    cols: usize,
}

impl<'a> Job<'a> {
    /// A single product, nothing skipped.
    pub(crate) fn one(
        dims: Dims,
        a: MatRef<'a>,
        b: MatRef<'a>,
        out: Out,
        compute: Compute,
        start: Start<'a>,
    ) -> Job<'a> {
        Job { dims, a, b, out, compute, start, spacing: Spacing::ONE, triangle: Triangle::Full }
    }

    /// Floating-point operations of all the products.
    fn flops(&self) -> f64 {
        self.dims.flops() * self.spacing.count as f64
    }

    /// Where matrix `item` of the whole batch (product `item / batch`, its batch item `item % batch`)
    /// starts in an operand of batch stride `batch_stride` whose products lie `step` apart.
    fn origin(&self, item: usize, batch_stride: usize, step: usize) -> usize {
        let batch = self.dims.batch.max(1);
        item / batch * step + item % batch * batch_stride
    }

    fn run<M: Micro>(&self, micro: M)
    where
        M::Packed: PackInto,
    {
        let Dims { m, n, k, .. } = self.dims;
        let batch = self.spacing.count * self.dims.batch;
        if batch == 0 || m == 0 || n == 0 {
            return;
        }
        let steps = k.div_ceil(M::B.k_per_step).next_multiple_of(M::B.a_group);
        let parallel = self.flops() >= PARALLEL_FLOPS;
        let n_blocks = n.div_ceil(M::B.nc);
        let threads = if parallel { rayon::current_num_threads() } else { 1 };
        let mc = rows_per_block(m, M::B.mr, M::B.mc, batch * n_blocks, threads);
        let m_blocks = m.div_ceil(mc);
        // One block of rows: each B panel is read by one block only, which packs it itself, a k-block at
        // a time, into its own cache just before its tiles read it (rather than all of B written out
        // to memory and read back: a skinny product's B is its whole cost).
        let b_per_block = m_blocks == 1;
        // One block of columns: each A panel is read by one block only, which packs it itself, a k-block
        // at a time, likewise (a Linear's products have n <= 256 when its output or input is 256 wide:
        // A, the activations or their gradient, is then the large operand). On a Zen 3, main job,
        // alternated with A packed whole first, five rounds: fp32 and bf16 steps 0.94-1.01x the time
        // (median 0.97x); the GEMM bench's weight-gradient products +3-6% (one quiet before/after pair).
        // Not under a triangle, whose panels skip steps.
        let a_per_block = !b_per_block && n_blocks == 1 && self.triangle == Triangle::Full;
        let (mut a_words, mut b_words) = PACKED.take();
        let a_len = if a_per_block { 0 } else { batch * m.div_ceil(M::B.mr) * steps * M::B.mr };
        let b_len = if b_per_block { 0 } else { batch * n.div_ceil(M::B.nr) * steps * M::B.nr };
        {
            let a_packed = M::Packed::from_words(cache_aligned(&mut a_words, a_len));
            let b_packed = M::Packed::from_words(cache_aligned(&mut b_words, b_len));
            let a_lines = (m, self.a.row_stride, self.a.col_stride);
            // The steps of a panel that its tiles never sum (A's zeros under a triangle) are not packed.
            let a_steps = |p: usize| {
                let rows = (p * M::B.mr, M::B.mr.min(m - p * M::B.mr));
                let (first, count) = tile_steps::<M>(self.triangle, rows, 0, 0, steps);
                (first, first + count)
            };
            let a_op = (&self.a, self.spacing.a);
            if !a_per_block {
                self.pack(a_op, a_lines, (M::B.mr, steps, M::B.a_group), &a_steps, a_packed, parallel);
            }
            if !b_per_block {
                let b_lines = (n, self.b.col_stride, self.b.row_stride);
                let b_op = (&self.b, self.spacing.b);
                self.pack(b_op, b_lines, (M::B.nr, steps, 1), &|_| (0, steps), b_packed, parallel);
            }
            let (a_packed, b_packed) = ((&*a_packed, a_per_block), (&*b_packed, b_per_block));
            // Consecutive blocks share the larger packed operand's panels: rayon hands each thread a
            // contiguous range of blocks, as it did of panels when packing, so each thread mostly reads
            // the panels it packed (from its own L2) and the larger operand is split between threads.
            let columns_outer = b_len > a_len;
            let block = |i: usize| {
                let (batch, rest) = (i / (m_blocks * n_blocks), i % (m_blocks * n_blocks));
                let (row, col) = if columns_outer {
                    (rest % m_blocks * mc, rest / m_blocks * M::B.nc)
                } else {
                    (rest / n_blocks * mc, rest % n_blocks * M::B.nc)
                };
                let block = Block { batch, row, col, rows: mc.min(m - row), cols: M::B.nc.min(n - col) };
                self.block(micro, block, steps, a_packed, b_packed);
            };
            let blocks = batch * m_blocks * n_blocks;
            if parallel {
                (0..blocks).into_par_iter().for_each(block);
            } else {
                (0..blocks).for_each(block);
            }
        }
        PACKED.set((a_words, b_words));
    }

    /// Packs every panel of `op` (its products `step` apart; lines = rows of A or columns of B:
    /// `(count, line stride, k stride)`) into panels of `width` lines and `steps` steps, in groups of
    /// `group` steps (`[steps / group][width][group]`). Of panel `p` of each matrix only the steps
    /// `kept(p) = (first, end)` are read (multiples of `group`; `first` and `end` rising with `p`):
    /// the panel is packed up to `end`, and where the lines are contiguous from `first` on.
    fn pack<P: PackInto>(
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

    fn block<M: Micro>(
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
    unsafe fn sweep<M: Micro, H: HalfC>(
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
        micro.begin();
        let (b_tiles, a_tiles) = (blk.cols.div_ceil(M::B.nr), blk.rows.div_ceil(M::B.mr));
        let mut block_b = if b_per_block { BLOCK_B.take() } else { Vec::new() };
        let mut block_a = if a_per_block { BLOCK_A.take() } else { Vec::new() };
        for k0 in (0..steps).step_by(M::B.kc) {
            let kc = M::B.kc.min(steps - k0);
            // A micro-panel `p` of this k-block, from step `first`: in the panels packed before the
            // blocks, or in this block's own, packed now.
            let (a_base, a_stride, a_origin): (&[M::Packed], usize, usize) = if a_per_block {
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
                    let a = a_panel(ip, first).as_ptr();
                    let b = b.wrapping_add((first - k0) * M::B.nr);
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

    /// Packs the block's A micro-panels for steps `k0..k0 + kc` into `dst` (`[panel][kc / G][mr][G]`):
    /// lines that are contiguous (an operand read transposed: a weight gradient's `dY^T`) across up to
    /// [`pack::ACROSS_LINES`] lines at a time, others panel by panel.
    fn pack_a_block<P: PackInto>(
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
    fn pack_b_block<P: PackInto>(&self, blk: Block, (k0, kc): (usize, usize), nr: usize, dst: &mut [P]) {
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
type Kept<'a> = dyn Fn(usize) -> (usize, usize) + Sync + 'a;

/// A block's source of A or B micro-panels: the panels packed before the blocks, or (`true`) none, the
/// block packing its own a k-block at a time.
type Panels<'a, P> = (&'a [P], bool);

/// `len` elements of `words` (4-byte packed words, or f32 scratch) that start on a cache line,
/// `words` grown as needed (keeping its memory for the next product).
///
/// Every panel and k-block then starts on a line too (their sizes are multiples of 16 words, except the
/// register kernels' 6-line A panels, which are read by broadcasts), so no vector or tile row load of a
/// packed operand straddles two lines. The allocator aligns to 16 bytes only; measured on the AMX kernel at 1024^3
/// on one thread, the straddling loads cost a third of its speed (575 against 910 GFLOP/s).
fn cache_aligned<T: Copy + Default>(words: &mut Vec<T>, len: usize) -> &mut [T] {
    let line = 64 / std::mem::size_of::<T>();
    // Grown only, never shrunk: a shorter length would be filled again when a larger product follows.
    if words.len() < len + line - 1 {
        words.resize(len + line - 1, T::default());
    }
    let skip = words.as_ptr().align_offset(64).min(line - 1);
    &mut words[skip..skip + len]
}

/// Where a block's sums start in its first k-block.
#[derive(Clone, Copy)]
enum TileStart<'a> {
    Zero,
    /// From what C holds.
    C,
    /// From this row (the block's columns of a bias) in every row.
    Row(&'a [f32]),
}

/// Rows per block of C: `m` split evenly over the fewest blocks of at most `mc` rows, rounded up to a
/// multiple of `mr`; when the blocks are few (`other` blocks across the columns and the batch for each
/// block of rows), over as many more as make the block count a multiple of `threads`: 3 blocks on 2
/// threads take 2 rounds of a full block, 4 smaller ones 2 rounds of three quarters of one.
fn rows_per_block(m: usize, mr: usize, mc: usize, other: usize, threads: usize) -> usize {
    /// Above this many blocks per thread, an uneven last round costs little.
    const FEW: usize = 8;
    let mut m_blocks = m.div_ceil(mc);
    if threads > 1 && m_blocks * other < FEW * threads {
        while !(m_blocks * other).is_multiple_of(threads) && m_blocks < m.div_ceil(mr) {
            m_blocks += 1;
        }
    }
    m.div_ceil(m_blocks.max(1)).next_multiple_of(mr).min(mc)
}

/// The steps `(first, count)` of the k-block `k0..k0 + kc` that the tile of rows `(row, rows)` (of its
/// matrix) and columns from `col` sums, given what `triangle` skips: whole groups of steps (a group of
/// A's layout; a step is one `k`, or a pair), so the steps kept hold every non-zero term. `count` 0:
/// the tile is only started.
fn tile_steps<M: Micro>(
    triangle: Triangle,
    (row, rows): (usize, usize),
    col: usize,
    k0: usize,
    kc: usize,
) -> (usize, usize) {
    let group = M::B.k_per_step * M::B.a_group;
    let end = k0 + kc;
    let (first, last) = match triangle {
        Triangle::Full => (k0, end),
        // Every column of the tile is right of every row's diagonal element.
        Triangle::LowerC if col >= row + rows => (k0, k0),
        Triangle::LowerC => (k0, end),
        // Row i needs k <= i: the tile, k < row + rows.
        Triangle::ZeroAboveA => (k0, ((row + rows).div_ceil(group) * M::B.a_group).clamp(k0, end)),
        // Row i needs k >= i: the tile, k >= row.
        Triangle::ZeroBelowA => ((row / group * M::B.a_group).clamp(k0, end), end),
    };
    (first, last - first)
}

/// A tile with no steps to sum (skipped by a [`Triangle`]): its start written to `c` (zero or its
/// row; from `c`, nothing), or with `half`, its start or what `c` holds rounded into half-precision C.
///
/// # Safety
/// `c` valid for `rows x cols` floats at distance `ldc`, `half` for `rows x cols` elements at its
/// distance; a `TileFrom::Row` holds `cols` floats.
unsafe fn bare_tile<H: HalfC>(
    (c, ldc): (*mut f32, usize),
    (rows, cols): (usize, usize),
    from: TileFrom,
    half: Option<(*mut H, usize)>,
) {
    for r in 0..rows {
        // SAFETY: row r of the tile, as the caller guarantees; raw writes, as C may be uninitialised
        // memory (`run_new`).
        unsafe {
            let c_row = c.add(r * ldc);
            match (half, from) {
                (None, TileFrom::Zero) => std::ptr::write_bytes(c_row, 0, cols),
                (None, TileFrom::Row(row)) => std::ptr::copy_nonoverlapping(row, c_row, cols),
                (None, TileFrom::Tile) => {}
                (Some((out, ldo)), from) => {
                    let out = std::slice::from_raw_parts_mut(out.add(r * ldo), cols);
                    match from {
                        TileFrom::Zero => out.fill(H::default()),
                        TileFrom::Row(row) => H::narrow(std::slice::from_raw_parts(row, cols), out),
                        TileFrom::Tile => H::narrow(std::slice::from_raw_parts(c_row, cols), out),
                    }
                }
            }
        }
    }
}

/// A tile cut by C's edge: computed whole in a local tile (its present part of `c` copied in, or its
/// start row written into each row), its present part copied out to `c`, or with `half`, rounded into
/// half-precision C.
///
/// # Safety
/// As [`Micro::tile`] for `a` and `b`; `c` valid for `rows x cols` floats at distance `ldc`, `half` for
/// `rows x cols` elements at its distance; a `TileFrom::Row` holds `cols` floats.
#[allow(clippy::too_many_arguments)]
unsafe fn edge_tile<M: Micro, H: HalfC>(
    micro: M,
    kc: usize,
    a: *const M::Packed,
    b: *const M::Packed,
    (c, ldc): (*mut f32, usize),
    (rows, cols): (usize, usize),
    from: TileFrom,
    half: Option<(*mut H, usize)>,
) {
    /// On a cache line, as the packed panels are ([`cache_aligned`]).
    #[repr(C, align(64))]
    struct Tile([f32; MAX_TILE]);
    let mut tile = Tile([0.0; MAX_TILE]);
    let tmp = &mut tile.0;
    // SAFETY: as the caller guarantees; `tmp` holds MR x NR <= MAX_TILE floats at distance NR.
    unsafe {
        match from {
            TileFrom::Zero => {}
            TileFrom::Tile => {
                for r in 0..rows {
                    std::ptr::copy_nonoverlapping(c.add(r * ldc), tmp.as_mut_ptr().add(r * M::B.nr), cols);
                }
            }
            TileFrom::Row(row) => {
                for r in 0..rows {
                    std::ptr::copy_nonoverlapping(row, tmp.as_mut_ptr().add(r * M::B.nr), cols);
                }
            }
        }
        micro.tile(kc, a, b, tmp.as_mut_ptr(), M::B.nr, !matches!(from, TileFrom::Zero));
        for r in 0..rows {
            let sums = &tmp[r * M::B.nr..r * M::B.nr + cols];
            match half {
                Some((out, ldo)) => H::narrow(sums, std::slice::from_raw_parts_mut(out.add(r * ldo), cols)),
                None => std::ptr::copy_nonoverlapping(sums.as_ptr(), c.add(r * ldc), cols),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{cache_aligned, rows_per_block};

    #[test]
    fn packed_buffers_start_on_a_cache_line_and_keep_their_memory() {
        let mut words: Vec<u32> = Vec::new();
        for len in [1, 15, 16, 1000, 4096, 17] {
            let slice = cache_aligned(&mut words, len);
            assert_eq!(slice.len(), len);
            assert_eq!(slice.as_ptr() as usize % 64, 0, "len {len}");
        }
        let capacity = words.capacity();
        cache_aligned(&mut words, 100);
        assert_eq!(words.capacity(), capacity, "a smaller product reuses the buffer");
        let mut floats: Vec<f32> = vec![1.0; 3];
        assert_eq!(cache_aligned(&mut floats, 40).as_ptr() as usize % 64, 0);
    }

    #[test]
    fn few_blocks_are_split_to_a_multiple_of_the_threads() {
        // (m, mr, mc, other blocks, threads) -> rows per block, and the block count it gives.
        for ((m, mr, mc, other, threads), rows) in [
            ((256, 6, 96, 1, 2), 66),     // 3 blocks of 96 -> 4 of 66 (the last 58)
            ((1024, 6, 96, 1, 2), 90),    // 11 -> 12 blocks
            ((1024, 32, 128, 1, 2), 128), // 8 blocks: already even
            ((256, 6, 96, 2, 2), 90),     // 3 x 2 blocks: already even, of even sizes
            ((256, 6, 96, 1, 1), 90),     // one thread: no more blocks, evenly sized
            ((5000, 6, 96, 1, 2), 96),    // 53 blocks: many, the last round costs little
            ((7, 6, 96, 1, 2), 6),        // 1 -> 2 blocks of at most one tile each
            ((3, 6, 96, 1, 4), 6),        // a single tile cannot be split
            ((97, 6, 96, 3, 4), 30),      // 2 x 3 -> 4 x 3 blocks
        ] {
            let got = rows_per_block(m, mr, mc, other, threads);
            assert_eq!(got, rows, "m {m} mr {mr} mc {mc} other {other} threads {threads}");
            assert!(got.is_multiple_of(mr) && got <= mc);
            let blocks = m.div_ceil(got) * other;
            assert!(blocks.is_multiple_of(threads) || blocks >= 8 * threads || got == mr, "{blocks} blocks");
        }
    }
}
