//! Register-blocked micro-kernels: one `MR x NR` tile of C from packed panels of A and B.
//!
//! A packed A panel holds `MR` rows step by step (`[steps][MR]`), a packed B panel `NR` columns
//! (`[steps][NR]`). A step is one `k` for the f32 kernels and a pair of consecutive `k`s for the bf16
//! dot-product kernels (element type `u32`: the even `k` in the low half, the odd one in the high half).
//! Each element of C is one chain of fused multiply-adds in step order, starting from C (when `load`)
//! or from zero, so kernels with the same step semantics give bit-identical results whatever their tile.

mod portable;
#[cfg(target_arch = "x86_64")]
mod x86;

pub(crate) use portable::{DotModel, FmaPortable};
#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{DotAvx512Bf16, FmaAvx2, FmaAvx512};

/// The largest `MR * NR` of any kernel: the size of an edge tile's scratch.
pub(crate) const MAX_TILE: usize = 6 * 64;

/// A micro-kernel's tile and the blocking around it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Blocking {
    /// Rows of a tile.
    pub(crate) mr: usize,
    /// Columns of a tile.
    pub(crate) nr: usize,
    /// `k`s per packed step: 1 (f32) or 2 (bf16 pairs).
    pub(crate) k_per_step: usize,
    /// Steps per k-block (a B micro-panel of `kc x nr` stays in L1 across a block's tiles).
    pub(crate) kc: usize,
    /// Rows per parallel block of C (a multiple of `mr`).
    pub(crate) mc: usize,
    /// Columns per parallel block of C (a multiple of `nr`).
    pub(crate) nc: usize,
}

/// 6 x 16 f32 tiles (two ymm per row): a 256-step B micro-panel is 16 KiB.
pub(crate) const F32_6X16: Blocking = Blocking { mr: 6, nr: 16, k_per_step: 1, kc: 256, mc: 96, nc: 256 };
/// 6 x 64 f32 tiles (four zmm per row): a 128-step B micro-panel is 32 KiB.
pub(crate) const F32_6X64: Blocking = Blocking { mr: 6, nr: 64, k_per_step: 1, kc: 128, mc: 96, nc: 256 };
/// 6 x 64 tiles of bf16 pairs (four zmm per row): a 128-step B micro-panel is 32 KiB.
pub(crate) const PAIRS_6X64: Blocking = Blocking { mr: 6, nr: 64, k_per_step: 2, kc: 128, mc: 96, nc: 256 };

/// A micro-kernel and its blocking. Values of implementing types exist only where the CPU runs them
/// (their constructors check), which is what makes [`Micro::tile`] callable.
pub(crate) trait Micro: Copy + Send + Sync {
    /// Packed element: `f32`, or `u32` holding a bf16 pair.
    type Packed: Copy + Default + Send + Sync;
    /// Tile and blocking.
    const B: Blocking;

    /// `C[MR x NR] = (load ? C : 0) + A·B` over `steps` packed steps.
    ///
    /// # Safety
    /// `a` is valid for `steps * MR` reads, `b` for `steps * NR`, and `c` for `MR` rows of `NR` f32
    /// writes at distance `ldc`.
    unsafe fn tile(
        self,
        steps: usize,
        a: *const Self::Packed,
        b: *const Self::Packed,
        c: *mut f32,
        ldc: usize,
        load: bool,
    );
}
