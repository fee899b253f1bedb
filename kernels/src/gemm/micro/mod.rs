//! Register-blocked micro-kernels: one `MR x NR` tile of C from packed panels of A and B.
//!
//! A packed B panel holds `NR` columns step by step (`[steps][NR]`); a packed A panel holds `MR` rows
//! in groups of `G` steps (`[steps / G][MR][G]`): `G = 1` for the register kernels, which broadcast one
//! A value per row and step, `G = 16` for the AMX kernel, whose A tiles are 16 rows of 16 consecutive
//! steps, 64 bytes apart. A step is
//! one `k` for the f32 kernels and a pair of consecutive `k`s for the bf16 dot-product kernels (element
//! type `u32`: the even `k` in the low half, the odd one in the high half). In the register kernels each
//! element of C is one chain of fused multiply-adds in step order, starting from C (when `load`) or from
//! zero, so kernels with the same step semantics give bit-identical results whatever their tile.

use half::{bf16, f16};

use crate::slices::Float;

#[cfg(target_arch = "x86_64")]
mod amx;
mod portable;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(target_arch = "x86_64")]
pub(crate) use amx::{peak_loop as tile_peak_loop, step_loop as tile_step_loop, TileAmx};
pub(crate) use portable::{DotModel, FmaPortable, FmaWideModel, TileModel};
#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{DotAvx512Bf16, FmaAvx2, FmaAvx512};

/// The largest `MR * NR` of any kernel: the size of an edge tile's scratch.
pub(crate) const MAX_TILE: usize = 32 * 32;

/// A micro-kernel's tile and the blocking around it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Blocking {
    /// Rows of a tile.
    pub(crate) mr: usize,
    /// Columns of a tile.
    pub(crate) nr: usize,
    /// `k`s per packed step: 1 (f32) or 2 (bf16 pairs).
    pub(crate) k_per_step: usize,
    /// Steps per k-block: each tile of C is loaded and stored once per k-block.
    pub(crate) kc: usize,
    /// Rows per parallel block of C (a multiple of `mr`): each B micro-panel of a k-block is swept by
    /// all of the block's `mc / mr` A micro-panels.
    pub(crate) mc: usize,
    /// Columns per parallel block of C (a multiple of `nr`).
    pub(crate) nc: usize,
    /// Steps per group of a packed A panel (`[steps / G][MR][G]`). Panels hold a multiple of `G` steps
    /// (the padding is zero), and `kc` is one too.
    pub(crate) a_group: usize,
    /// Whether the driver prefetches the next B micro-panel into L2 while the current one is swept:
    /// for a micro-panel swept from L1 (the AVX2 kernel's; measured +4-8% at 1024^3-2048^3 when the
    /// zmm kernels' were too, and +2-13% on the forced AVX2 path on a Zen 4 still). Not for one swept
    /// from L2: AMX (-10%: its tiles are too short to hide the extra instructions and traffic) and the
    /// zmm kernels since their 512-step k-blocks (on a Zen 4, 2 threads, with and without alternated
    /// call by call: zmm f32 4096^3 183 -> 209-211 GFLOP/s, other shapes -3% to +3%; `vdpbf16ps` +0-2%
    /// on each of 12 shapes).
    pub(crate) prefetch_next_b: bool,
}

/// The zmm kernels' k-block and block of rows: 512 steps and 288 rows. Their B micro-panel (128 KiB)
/// then outgrows L1 and is read from L2, which keeps up with their four vector loads per step, while
/// C's tiles are loaded and stored a quarter as often as with 128 steps and each B micro-panel serves
/// three times the A micro-panels that 96 rows gave it; a block's A slice (576 KiB) and B micro-panel
/// fit a Zen 4's 1 MiB L2 (Sapphire Rapids has 2 MiB). Measured on a Zen 4 (2
/// threads, interleaved in one process, against 128 steps and 96 rows): bf16 `vdpbf16ps` 4096^3
/// 375-390 -> 406-424 GFLOP/s, 2048^3 344-376 -> 383-413, BERT-base's FFN products +5-7%; zmm f32
/// 4096^3 158 -> 197, 2048^3 183 -> 204; the main job's products (1024 rows, k of 256 or 1024) within
/// noise.
const ZMM_KC: usize = 512;
const ZMM_MC: usize = 288;

/// 6 x 16 f32 tiles (two ymm per row): a 256-step B micro-panel is 16 KiB, a block's A slice 96 KiB.
/// (The zmm kernels' larger blocking measured the same to 5% faster on the AVX2 path forced on a Zen
/// 4, whose L2 is 1 MiB; its 576 KiB A slice would not stay in the 512 KiB L2 of a Zen 2 or 3 EPYC,
/// and the AVX2-only machine this project was measured on before was an EPYC of unknown generation.)
pub(crate) const F32_6X16: Blocking =
    Blocking { mr: 6, nr: 16, k_per_step: 1, kc: 256, mc: 96, nc: 256, a_group: 1, prefetch_next_b: true };
/// 6 x 64 f32 tiles (four zmm per row): a k-block's B micro-panel is 128 KiB.
pub(crate) const F32_6X64: Blocking = Blocking {
    mr: 6,
    nr: 64,
    k_per_step: 1,
    kc: ZMM_KC,
    mc: ZMM_MC,
    nc: 256,
    a_group: 1,
    prefetch_next_b: false,
};
/// 6 x 64 tiles of bf16 pairs (four zmm per row): a k-block's B micro-panel (1024 `k`) is 128 KiB.
pub(crate) const PAIRS_6X64: Blocking = Blocking {
    mr: 6,
    nr: 64,
    k_per_step: 2,
    kc: ZMM_KC,
    mc: ZMM_MC,
    nc: 256,
    a_group: 1,
    prefetch_next_b: false,
};

/// 32 x 32 tiles of bf16 pairs as four 16 x 16 AMX tiles of C, A in groups of 16 steps (32 `k`, one
/// tile product). A k-block of 1024 steps (2048 `k`) makes the B and A micro-panels 128 KiB each, swept
/// from L2, and loads and stores C's tiles a quarter as often as 256 steps did: measured 1990 -> 2315
/// GFLOP/s at 2048^3 and 1740 -> 1970 at 4096^3 on 2 threads, the same within noise at smaller `k`.
pub(crate) const AMX_32X32: Blocking = Blocking {
    mr: 32,
    nr: 32,
    k_per_step: 2,
    kc: 1024,
    mc: 128,
    nc: 256,
    a_group: 16,
    prefetch_next_b: false,
};

/// Where a tile's sums start.
#[derive(Clone, Copy, Debug)]
pub(crate) enum TileFrom {
    /// Zero.
    Zero,
    /// The f32 tile at `c` (what earlier k-blocks stored there, or C itself).
    Tile,
    /// These `NR` floats (a bias) in every row.
    Row(*const f32),
}

/// A half-precision element of C: a tile's sums are rounded to it once, after their last k-block (as
/// `half`'s `from_f32` does, through [`Float::narrow`]).
pub(crate) trait HalfC: Float {
    /// bf16 (else f16). Read by the x86 kernels, which round in registers.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    const BF16: bool;
}

impl HalfC for f16 {
    const BF16: bool = false;
}

impl HalfC for bf16 {
    const BF16: bool = true;
}

/// The AMX tile product with the roles of A and B traded (`driver::skinny_tiles`): a 32 x 32 tile of
/// `C^T = B^T·A^T` whose tile-product A operand is read where it lies.
pub(crate) trait TransposedTile {
    /// `tile[l * 32 + r] += sum_k w[l][k] · at[k][r]` over `groups` groups of 32 `k`, in the order of
    /// the AMX tile kernel: `w` holds 32 lines of bf16 bits `ldw` apart, `at` the step-major panel of
    /// A^T (`[16 * groups][32]` pairs, as a B panel is packed).
    ///
    /// # Safety
    /// `w` is valid for 32 lines of `32 * groups` values `ldw` apart, `at` for `16 * groups * 32` words;
    /// [`Micro::begin`] was called on this thread since the last [`Micro::end`].
    unsafe fn transposed_tile(
        self,
        groups: usize,
        w: (*const u16, usize),
        at: *const u32,
        tile: &mut [f32; 1024],
    );
}

/// A micro-kernel and its blocking. Values of implementing types exist only where the CPU runs them
/// (their constructors check), which is what makes [`Micro::tile`] callable.
pub(crate) trait Micro: Copy + Send + Sync {
    /// Packed element: `f32`, or `u32` holding a bf16 pair.
    type Packed: super::pack::PackInto;
    /// Tile and blocking.
    const B: Blocking;

    /// `C[MR x NR] = (load ? C : 0) + A·B` over `steps` packed steps.
    ///
    /// # Safety
    /// `a` is valid for `steps * MR` reads, `b` for `steps * NR`, and `c` for `MR` rows
    /// of `NR` f32 writes at distance `ldc`; [`Micro::begin`] was called on this thread since the last
    /// [`Micro::end`].
    unsafe fn tile(
        self,
        steps: usize,
        a: *const Self::Packed,
        b: *const Self::Packed,
        c: *mut f32,
        ldc: usize,
        load: bool,
    );

    /// `C[MR x NR] = row + A·B`: every row of the tile starts from the same `NR` floats (a bias), C is
    /// only written. By default the row is copied into C's rows and [`Micro::tile`] loads them; the
    /// AMX kernel loads it into its tiles directly.
    ///
    /// # Safety
    /// As [`Micro::tile`]; `row` is valid for `NR` reads.
    unsafe fn tile_from_row(
        self,
        steps: usize,
        a: *const Self::Packed,
        b: *const Self::Packed,
        c: *mut f32,
        ldc: usize,
        row: *const f32,
    ) {
        // SAFETY: the caller's guarantee: C holds MR rows of NR floats `ldc` apart, `row` NR floats.
        unsafe {
            for r in 0..Self::B.mr {
                std::ptr::copy_nonoverlapping(row, c.add(r * ldc), Self::B.nr);
            }
            self.tile(steps, a, b, c, ldc, true);
        }
    }

    /// The tile's last k-block into half-precision C: `out[MR x NR] = round(from + A·B)`, each sum
    /// rounded once. By default the sums are computed into the f32 tile at `c` (which a `TileFrom::Tile`
    /// start reads) and rounded from there; the zmm kernels round their registers and leave `c` alone.
    ///
    /// # Safety
    /// As [`Micro::tile`] (`c` is valid for reads and writes); `out` holds `MR` rows of `NR` elements
    /// `ldo` apart, valid for reads and writes and referenced by nothing else meanwhile; a
    /// `TileFrom::Row` holds `NR` floats.
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile_to_half<H: HalfC>(
        self,
        steps: usize,
        a: *const Self::Packed,
        b: *const Self::Packed,
        (c, ldc): (*mut f32, usize),
        from: TileFrom,
        (out, ldo): (*mut H, usize),
    ) {
        // SAFETY: the caller's guarantee.
        unsafe {
            match from {
                TileFrom::Zero => self.tile(steps, a, b, c, ldc, false),
                TileFrom::Tile => self.tile(steps, a, b, c, ldc, true),
                TileFrom::Row(row) => self.tile_from_row(steps, a, b, c, ldc, row),
            }
            for r in 0..Self::B.mr {
                let sums = std::slice::from_raw_parts(c.add(r * ldc), Self::B.nr);
                H::narrow(sums, std::slice::from_raw_parts_mut(out.add(r * ldo), Self::B.nr));
            }
        }
    }

    /// Whether the kernel reads A where it lies ([`Micro::tile_in_place`]) when A's lines are bf16 rows
    /// with `k` contiguous: AMX loads its A tiles from any row stride, so the driver need not copy them
    /// into panels first.
    const A_IN_PLACE: bool = false;

    /// The tile from `from` (into the f32 tile at `c`, or with `half`, rounded into half C from there)
    /// with A's `MR` lines read where they lie: bf16 rows `lda` values apart from `a`, each holding the
    /// tile's `2 * steps` values of `k` contiguously. Only called where [`Micro::A_IN_PLACE`] holds.
    ///
    /// # Safety
    /// As [`Micro::tile`] and [`Micro::tile_to_half`], with A's rows valid for those reads.
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile_in_place<H: HalfC>(
        self,
        _steps: usize,
        _a: (*const u16, usize),
        _b: *const Self::Packed,
        _c: (*mut f32, usize),
        _from: TileFrom,
        _half: Option<(*mut H, usize)>,
    ) {
        unreachable!("the driver reads A in place only for a kernel with A_IN_PLACE");
    }

    /// Prepares this thread before a block's tiles (AMX loads its tile configuration). Nothing for the
    /// register kernels.
    fn begin(self) {}

    /// After a block's tiles (AMX releases the tile state).
    fn end(self) {}
}
