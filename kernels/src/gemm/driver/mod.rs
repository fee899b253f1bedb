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
//! Every element of C is one FMA chain in `k` order regardless of blocking or thread count. (Products
//! of few rows of A whose B lies contiguous along `k` read B where it lies instead: on the FMA paths
//! [`super::few_rows`] (B in a type the product computes in exactly), on the `vdpbf16ps` path
//! [`super::skinny`] (bf16, A along `k` too), on AMX `skinny_tiles`.)
//!
//! This file plans a product and runs its blocks; `packing` packs the operands (1), `sweep` runs a
//! block's tiles (2, 3), `tiles` holds the tiles the micro-kernel does not take whole (the steps a
//! triangle leaves, tiles cut by C's edge), `stream` writes a block of an f32 C past the caches (a C
//! read again only much later: [`super::gemm_new_streamed`]) and `buffers` the buffers each thread
//! keeps.

use std::sync::atomic::{AtomicBool, Ordering};

use half::{bf16, f16};
use rayon::prelude::*;

use super::layout::{Dims, MatMut, MatRef, Placement, Triangle};
use super::micro::{self, Micro};
use super::pack::PackInto;
use super::{few_rows, skinny};
use super::{Compute, GemmPath, Start};
use crate::GradSliceMut;

use buffers::{cache_aligned, PACKED};
use tiles::tile_steps;

mod buffers;
mod packing;
mod skinny_tiles;
mod stream;
mod sweep;
mod tiles;

/// Rows of A this many bytes apart (or a multiple) are packed even where the kernel could read them in
/// place: a tile's 32 rows then fall into at most two of the L1 cache's 64 sets, more lines than its
/// 12 ways hold, and every group of the tile misses (the GEMM bench on the Xeon (AMX), 2048^3 bf16, in
/// place against packed, two runs each: 15.4-16.0 against 11.5-12.0 ms; 1024^3 (2 KiB apart):
/// 2.34-2.41 against 2.12-2.34 ms; 256^3 and 512^3, 512 B and 1 KiB apart, faster in place: 0.11
/// against 0.12-0.13 ms, 0.39-0.42 against 0.38-0.59 ms).
const IN_PLACE_ALIASING: usize = 2048;

/// The most rows of a product AMX reads its B for in place (`skinny_tiles`).
pub(crate) const SKINNY_TILES_MAX_ROWS: usize = skinny_tiles::MAX_ROWS;

/// Products below this many flops run on the calling thread only.
const PARALLEL_FLOPS: f64 = 4.0e6;

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
    new_dense(dims, len, |out| run_job(path, Job::one(dims, a, b, out, compute, start)))
}

/// [`run_new`] of an f32 C written with streaming stores where the blocked loop runs ([`stream`]), and
/// whether every value of C is finite (checked as each block is written; where a skinny path runs, or
/// no streaming stores exist, C is written as usual and checked after).
pub(crate) fn run_new_streamed(
    path: GemmPath,
    dims: Dims,
    a: MatRef<'_>,
    b: MatRef<'_>,
    compute: Compute,
    start: Start<'_>,
    len: usize,
) -> (Vec<f32>, bool) {
    debug_assert!(!matches!(start, Start::Output), "a new C has nothing to start from");
    let finite = AtomicBool::new(true);
    let mut blocked = false;
    let c = new_dense(dims, len, |out| {
        let job = Job::one(dims, a, b, out, compute, start);
        blocked = stream::AVAILABLE && !reads_in_place(path, &job);
        run_job(path, Job { stream: blocked.then_some(&finite), ..job });
    });
    let all_finite =
        if blocked { finite.load(Ordering::Relaxed) } else { !crate::portable::kernels::any_nonfinite(&c) };
    (c, all_finite)
}

/// A new dense C of `len = batch * m * n` elements (row stride n, batch stride m * n), which `write`
/// fills through the [`Out`] it is given: a product that writes every element, never reading C.
fn new_dense<T: NewElement>(dims: Dims, len: usize, write: impl FnOnce(Out)) -> Vec<T> {
    let mut c: Vec<T> = Vec::with_capacity(len);
    write(Out { ptr: T::ptr(c.as_mut_ptr()), row_stride: dims.n, batch_stride: dims.m * dims.n });
    // SAFETY: C is dense inside its `len` elements, and the job wrote every one of them: each block's
    // first k-block stores its tiles without loading them (`Start::Zero` and `Start::Bias` never read
    // C; a streamed block copies its whole scratch block out), edge tiles copy their present part out,
    // and an empty k fills the block with its start.
    unsafe { c.set_len(len) };
    c
}

/// [`run_new`] for `groups` of products (C `(batch, m, count * n)` side by side, or `(count, batch, m,
/// n)` stacked), each product `g` reading `a` and `b` `g` steps on; `triangle` says what may be skipped.
/// One job runs them all, unless a path that reads few rows in place takes each product alone (then one
/// product at a time, so that each has the bits it has alone).
pub(crate) fn run_new_groups<T: NewElement>(
    path: GemmPath,
    dims: Dims,
    operands: (MatRef<'_>, MatRef<'_>),
    groups: &super::Groups,
    compute: Compute,
    triangle: Triangle,
) -> Vec<T> {
    let len = groups.count * dims.batch * dims.m * dims.n;
    let mut c: Vec<T> = Vec::with_capacity(len);
    // SAFETY: the vector has room for the `len` elements written.
    unsafe { run_groups_at(path, dims, operands, groups, compute, triangle, c.as_mut_ptr()) };
    // SAFETY: the products' columns (side by side) or matrices (stacked) partition C, and each product
    // wrote every element of its part, as in `run_new`.
    unsafe { c.set_len(len) };
    c
}

/// [`run_new_groups`] into the first `groups.count * batch * m * n` elements of `c`, all written.
///
/// # Panics
/// If `c` is shorter.
pub(crate) fn run_groups_into<T: NewElement>(
    path: GemmPath,
    dims: Dims,
    operands: (MatRef<'_>, MatRef<'_>),
    groups: &super::Groups,
    compute: Compute,
    triangle: Triangle,
    c: &mut [T],
) {
    assert!(c.len() >= groups.count * dims.batch * dims.m * dims.n, "C holds every product");
    // SAFETY: `c` holds the elements written, borrowed mutably for the call.
    unsafe { run_groups_at(path, dims, operands, groups, compute, triangle, c.as_mut_ptr()) };
}

/// Writes every one of the `groups.count * batch * m * n` elements of [`run_new_groups`]'s C at `base`.
///
/// # Safety
/// `base` must be valid for writes of that many elements, which nothing else reads or writes during
/// the call.
unsafe fn run_groups_at<T: NewElement>(
    path: GemmPath,
    dims: Dims,
    (a, b): (MatRef<'_>, MatRef<'_>),
    groups: &super::Groups,
    compute: Compute,
    triangle: Triangle,
    base: *mut T,
) {
    let (row_stride, batch_stride, c_step) = match groups.placement {
        Placement::SideBySide => {
            let width = groups.count * dims.n;
            (width, dims.m * width, dims.n)
        }
        Placement::Stacked => (dims.n, dims.m * dims.n, dims.batch * dims.m * dims.n),
    };
    let out = |g: usize| Out {
        // Product g's C starts at `g * c_step < len` unless C is empty (an empty batch, m or n), when
        // the job writes nothing.
        ptr: T::ptr(base.wrapping_add(g * c_step)),
        row_stride,
        batch_stride,
    };
    let spacing = Spacing { count: groups.count, a: groups.a_step, b: groups.b_step, c: c_step };
    let start = Start::Zero;
    let whole = Job { dims, a, b, out: out(0), compute, start, spacing, triangle, stream: None };
    let single = Job { spacing: Spacing::ONE, ..whole };
    if groups.count > 1 && (skinny::applies(path, &whole) || few_rows::applies(path, &single)) {
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
    // An empty C (no products in the group, or an empty dimension): nothing to write, and C's pointer
    // may be dangling.
    if batch == 0 || m == 0 || n == 0 || job.spacing.count == 0 {
        return;
    }
    if skinny::applies(path, &job) {
        // The skinny path writes one product's C: a group is split into its products before it comes here.
        assert_eq!(job.spacing.count, 1, "the skinny path runs one product");
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
    if skinny_tiles::applies(path, &job) {
        let parallel = job.dims.flops() >= PARALLEL_FLOPS;
        match path {
            #[cfg(target_arch = "x86_64")]
            GemmPath::AmxBf16 => job.run_skinny_tiles(micro::TileAmx::new().expect(CHECKED), parallel),
            _ => job.run_skinny_tiles(micro::TileModel, parallel),
        }
        return;
    }
    if few_rows::applies(path, &job) {
        let parallel = job.dims.flops() >= PARALLEL_FLOPS;
        match path {
            #[cfg(target_arch = "x86_64")]
            GemmPath::Avx512 => job.run_few_rows(few_rows::RowFmaAvx512::new().expect(CHECKED), parallel),
            #[cfg(target_arch = "x86_64")]
            GemmPath::Avx2 => job.run_few_rows(few_rows::RowFmaAvx2::new().expect(CHECKED), parallel),
            _ => job.run_few_rows(few_rows::RowFmaPortable, parallel),
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

/// Whether `job` on `path` takes a path that reads its operands where they lie instead of packing them.
fn reads_in_place(path: GemmPath, job: &Job<'_>) -> bool {
    skinny::applies(path, job) || skinny_tiles::applies(path, job) || few_rows::applies(path, job)
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
    /// An f32 C written with streaming stores ([`stream`]), and the flag cleared where a value written
    /// is not finite.
    pub(crate) stream: Option<&'a AtomicBool>,
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
        Job { dims, a, b, out, compute, start, spacing: Spacing::ONE, triangle: Triangle::Full, stream: None }
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

    /// Whether the micro-kernel reads A where it lies ([`Micro::tile_in_place`]) instead of from packed
    /// panels: a kernel that can, A's lines bf16 rows with `k` contiguous, every tile whole (`m` and `n`
    /// multiples of the tile, `k` of the kernel's group of steps, no triangle), and rows whose distance
    /// is not a multiple of [`IN_PLACE_ALIASING`] bytes.
    fn a_in_place<M: Micro>(&self, steps: usize) -> bool {
        M::A_IN_PLACE
            && matches!(self.a.data, crate::GradSlice::Bf16(_))
            && self.a.col_stride == 1
            && !(2 * self.a.row_stride).is_multiple_of(IN_PLACE_ALIASING)
            && self.dims.m.is_multiple_of(M::B.mr)
            && self.dims.n.is_multiple_of(M::B.nr)
            && self.dims.k == steps * <M::Packed as PackInto>::K_PER_STEP
            && self.triangle == Triangle::Full
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
        let a_in_place = self.a_in_place::<M>(steps);
        let a_per_block = !a_in_place && !b_per_block && n_blocks == 1 && self.triangle == Triangle::Full;
        let (mut a_words, mut b_words) = PACKED.take();
        let a_whole = batch * m.div_ceil(M::B.mr) * steps * M::B.mr;
        let a_len = if a_per_block || a_in_place { 0 } else { a_whole };
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
            if !a_per_block && !a_in_place {
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
            let columns_outer = b_len > if a_in_place { a_whole } else { a_len };
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

#[cfg(test)]
mod tests {
    use super::rows_per_block;

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
