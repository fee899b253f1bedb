//! Micro-kernels in plain Rust: f32 FMA chains, and the software models of the zmm FMA, `vdpbf16ps`
//! and AMX kernels.

use super::{Blocking, HalfC, Micro, TileFrom, TransposedTile, AMX_32X32, F32_6X16, F32_6X64, PAIRS_6X64};
use crate::gemm::dpbf16::{dpbf16_pair, tdpbf16_pair};

/// f32 fused multiply-adds, 6 x 16 tiles (LLVM vectorises the 16 columns where it can).
#[derive(Clone, Copy, Debug)]
pub(crate) struct FmaPortable;

/// The zmm FMA kernel's algorithm ([`super::FmaAvx512`]: 6 x 64 tiles, its k-blocks and blocks of
/// rows, no prefetch of the next B micro-panel) with portable fused multiply-adds: the same FMA chains
/// in the same order, so bit-identical to it (and to [`FmaPortable`]). It tests that path's packing,
/// blocking and edges on a CPU without AVX-512.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FmaWideModel;

/// The `vdpbf16ps` kernel's algorithm with each instruction replaced by [`dpbf16_pair`]: same packing,
/// tiles and blocking as [`super::DotAvx512Bf16`], bit-identical results.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DotModel;

/// The AMX kernel's algorithm (A in groups of 16 steps, 32 x 32 tiles, the same blocking) with
/// each element summed as Intel's pseudo-code for `tdpbf16ps` writes it ([`tdpbf16_pair`]). It tests the
/// AMX path's packing, padding, blocking and edges on any CPU; it is not bit-identical to the hardware,
/// which sums a tile product's 32 terms in an order of its own (see [`tdpbf16_pair`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct TileModel;

/// The portable tile loop: `acc[r][j] = step(acc[r][j], a[r], b[j])` for every step.
///
/// # Safety
/// As [`Micro::tile`].
#[inline(always)]
unsafe fn tile_with<P: Copy, const MR: usize, const NR: usize>(
    steps: usize,
    a: *const P,
    b: *const P,
    c: *mut f32,
    ldc: usize,
    load: bool,
    step: impl Fn(f32, P, P) -> f32,
) {
    let mut acc = [[0.0f32; NR]; MR];
    if load {
        for (r, row) in acc.iter_mut().enumerate() {
            // SAFETY: the caller guarantees MR rows of NR floats at distance ldc.
            row.copy_from_slice(unsafe { std::slice::from_raw_parts(c.add(r * ldc), NR) });
        }
    }
    for s in 0..steps {
        // SAFETY: the caller guarantees `steps` steps of MR (A) and NR (B) packed elements.
        let (a, b) = unsafe {
            (std::slice::from_raw_parts(a.add(s * MR), MR), std::slice::from_raw_parts(b.add(s * NR), NR))
        };
        for (row, &a) in acc.iter_mut().zip(a) {
            for (x, &b) in row.iter_mut().zip(b) {
                *x = step(*x, a, b);
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts_mut(c.add(r * ldc), NR) }.copy_from_slice(row);
    }
}

impl Micro for FmaPortable {
    type Packed = f32;
    const B: Blocking = F32_6X16;

    unsafe fn tile(self, steps: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, load: bool) {
        // SAFETY: forwarded from the caller.
        unsafe { tile_with::<f32, 6, 16>(steps, a, b, c, ldc, load, |acc, a, b| a.mul_add(b, acc)) }
    }
}

impl Micro for FmaWideModel {
    type Packed = f32;
    const B: Blocking = F32_6X64;

    unsafe fn tile(self, steps: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, load: bool) {
        // SAFETY: forwarded from the caller.
        unsafe { tile_with::<f32, 6, 64>(steps, a, b, c, ldc, load, |acc, a, b| a.mul_add(b, acc)) }
    }
}

impl Micro for DotModel {
    type Packed = u32;
    const B: Blocking = PAIRS_6X64;

    unsafe fn tile(self, steps: usize, a: *const u32, b: *const u32, c: *mut f32, ldc: usize, load: bool) {
        // SAFETY: forwarded from the caller.
        unsafe { tile_with::<u32, 6, 64>(steps, a, b, c, ldc, load, dpbf16_pair) }
    }
}

impl Micro for TileModel {
    type Packed = u32;
    const B: Blocking = AMX_32X32;
    const A_IN_PLACE: bool = true;

    unsafe fn tile_in_place<H: HalfC>(
        self,
        steps: usize,
        a: (*const u16, usize),
        b: *const u32,
        (c, ldc): (*mut f32, usize),
        from: TileFrom,
        half: Option<(*mut H, usize)>,
    ) {
        // The lines gathered into a panel, then the packed tile: the model of reading them in place.
        // SAFETY: the caller's guarantees, the panel holding `steps` steps of MR lines.
        unsafe {
            let panel = Self::gathered(steps, a);
            let a = panel.as_ptr();
            match (half, from) {
                (Some(out), from) => self.tile_to_half(steps, a, b, (c, ldc), from, out),
                (None, TileFrom::Zero) => self.tile(steps, a, b, c, ldc, false),
                (None, TileFrom::Tile) => self.tile(steps, a, b, c, ldc, true),
                (None, TileFrom::Row(row)) => self.tile_from_row(steps, a, b, c, ldc, row),
            }
        }
    }

    unsafe fn tile(self, steps: usize, a: *const u32, b: *const u32, c: *mut f32, ldc: usize, load: bool) {
        const MR: usize = AMX_32X32.mr;
        const NR: usize = AMX_32X32.nr;
        const GROUP: usize = AMX_32X32.a_group;
        // SAFETY: the caller guarantees `steps` steps of MR lines (A, in groups) and NR columns (B), and
        // MR rows of NR floats of C at distance ldc.
        let (a, b) =
            unsafe { (std::slice::from_raw_parts(a, steps * MR), std::slice::from_raw_parts(b, steps * NR)) };
        for r in 0..MR {
            // SAFETY: row r of C, as above.
            let row = unsafe { std::slice::from_raw_parts_mut(c.add(r * ldc), NR) };
            if !load {
                row.fill(0.0);
            }
            for (s, b_row) in b.chunks_exact(NR).enumerate() {
                let x = a[(s / GROUP) * MR * GROUP + r * GROUP + s % GROUP];
                for (acc, &y) in row.iter_mut().zip(b_row) {
                    *acc = tdpbf16_pair(*acc, x, y);
                }
            }
        }
    }
}

impl TileModel {
    /// A's `MR` lines of `steps` pairs, read in place (bf16 rows `lda` values apart), as the AMX panel
    /// holds them: groups of `GROUP` steps, line by line.
    ///
    /// # Safety
    /// Each of the `MR` rows from `a` holds `2 * steps` values.
    unsafe fn gathered(steps: usize, (a, lda): (*const u16, usize)) -> Vec<u32> {
        const MR: usize = AMX_32X32.mr;
        const GROUP: usize = AMX_32X32.a_group;
        let mut panel = vec![0u32; steps * MR];
        for r in 0..MR {
            // SAFETY: the caller's guarantee.
            let row = unsafe { std::slice::from_raw_parts(a.add(r * lda), 2 * steps) };
            for (s, pair) in row.chunks_exact(2).enumerate() {
                panel[(s / GROUP) * MR * GROUP + r * GROUP + s % GROUP] =
                    u32::from(pair[0]) | u32::from(pair[1]) << 16;
            }
        }
        panel
    }
}

impl TransposedTile for TileModel {
    unsafe fn transposed_tile(
        self,
        groups: usize,
        (w, ldw): (*const u16, usize),
        at: *const u32,
        tile: &mut [f32; 1024],
    ) {
        const LINES: usize = 32;
        let steps = groups * AMX_32X32.a_group;
        // SAFETY: the caller guarantees `steps` steps of 32 pairs of A^T.
        let at = unsafe { std::slice::from_raw_parts(at, steps * LINES) };
        for (l, line) in tile.chunks_exact_mut(LINES).enumerate() {
            // SAFETY: line `l` of w holds `2 * steps` values (the caller's guarantee).
            let w = unsafe { std::slice::from_raw_parts(w.add(l * ldw), 2 * steps) };
            for (pair, a_step) in w.chunks_exact(2).zip(at.chunks_exact(LINES)) {
                let x = u32::from(pair[0]) | u32::from(pair[1]) << 16;
                for (acc, &y) in line.iter_mut().zip(a_step) {
                    *acc = tdpbf16_pair(*acc, x, y);
                }
            }
        }
    }
}
