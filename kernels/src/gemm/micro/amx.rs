//! The AMX micro-kernel: a 32 x 32 tile of C in four 16 x 16 f32 tile registers, `tdpbf16ps` on two
//! A tiles (16 lines x 16 bf16 pairs, one group of the A panel: 1 KiB, rows 64 bytes apart) and two B
//! tiles (16 steps x 16 columns of pairs from the step-major B panel, rows 128 bytes apart). For
//! products of few rows it also computes tiles of `C^T` ([`TransposedTile`]), whose A tiles are 16 rows
//! of a Linear's weight read where they lie (rows `ldw` values apart).
//!
//! The tile instructions have no stable intrinsics yet, so they are written as inline assembly. Tile
//! registers are never allocated by the compiler, so they keep their values between the `asm!` blocks of
//! one tile. Register use: tmm0..tmm3 the four quarters of C, tmm4 and tmm5 the two A tiles (lines 0..16
//! and 16..32), tmm6 and tmm7 the two B tiles (columns 0..16 and 16..32).

use std::arch::asm;

use super::x86::round_rows_32;
use super::{Blocking, HalfC, Micro, TileFrom, TransposedTile, AMX_32X32};
use crate::gemm::prefetch;
use crate::Isa;

/// AMX `tdpbf16ps`, 32 x 32 tiles. Constructible only where [`Isa::AmxBf16`] runs (the CPU has AMX and
/// the process has the OS's permission).
#[derive(Clone, Copy, Debug)]
pub(crate) struct TileAmx(());

impl TileAmx {
    pub(crate) fn new() -> Option<Self> {
        Isa::AmxBf16.is_supported().then_some(TileAmx(()))
    }
}

/// A tile configuration (`ldtilecfg`'s 64-byte operand): palette 1, eight tiles of 16 rows x 64 bytes.
#[repr(C, align(64))]
struct Config([u8; 64]);

static CONFIG: Config = {
    let mut bytes = [0u8; 64];
    bytes[0] = 1; // palette
    let mut t = 0;
    while t < 8 {
        bytes[16 + 2 * t] = 64; // bytes per row (little-endian u16)
        bytes[48 + t] = 16; // rows
        t += 1;
    }
    Config(bytes)
};

/// Steps per tile product (and per group of the A panel).
const GROUP: usize = AMX_32X32.a_group;
/// Bytes between rows of an A tile: one line of a group.
const A_ROW_BYTES: usize = GROUP * 4;
/// Bytes between rows of a B tile: one step of the 32-column panel.
const B_ROW_BYTES: usize = AMX_32X32.nr * 4;
/// Bytes of one group of an A micro-panel (its two A tiles) and of a B micro-panel (its two B tiles).
const A_GROUP_BYTES: usize = GROUP * AMX_32X32.mr * 4;
const B_GROUP_BYTES: usize = GROUP * AMX_32X32.nr * 4;

impl Micro for TileAmx {
    type Packed = u32;
    const B: Blocking = AMX_32X32;

    fn begin(self) {
        // SAFETY: a `TileAmx` exists only where AMX runs and the process may use tile data; CONFIG is a
        // valid palette-1 configuration.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly, preserves_flags)) }
    }

    fn end(self) {
        // SAFETY: as in `begin`; releasing returns the tile state to its initial (unused) state.
        unsafe { asm!("tilerelease", options(nostack, nomem, preserves_flags)) }
    }

    const A_IN_PLACE: bool = true;

    unsafe fn tile(self, steps: usize, a: *const u32, b: *const u32, c: *mut f32, ldc: usize, load: bool) {
        let start = if load { Start::C } else { Start::Zero };
        // SAFETY: the caller's guarantee.
        unsafe { self.run(steps, ALines::Panel(a), b, c, ldc, start) }
    }

    unsafe fn tile_in_place<H: HalfC>(
        self,
        steps: usize,
        (a, lda): (*const u16, usize),
        b: *const u32,
        (c, ldc): (*mut f32, usize),
        from: TileFrom,
        half: Option<(*mut H, usize)>,
    ) {
        // SAFETY: the caller's guarantee; as in `tile_to_half` for the rounding.
        unsafe {
            self.run(steps, ALines::Rows(a, lda), b, c, ldc, Start::of(from));
            if let Some((out, ldo)) = half {
                round_rows_32(AMX_32X32.mr, (c, ldc), (out.cast::<u16>(), ldo), H::BF16);
            }
        }
    }

    unsafe fn tile_from_row(
        self,
        steps: usize,
        a: *const u32,
        b: *const u32,
        c: *mut f32,
        ldc: usize,
        row: *const f32,
    ) {
        // SAFETY: the caller's guarantee; `row` holds the tile's 32 columns.
        unsafe { self.run(steps, ALines::Panel(a), b, c, ldc, Start::Row(row)) }
    }

    unsafe fn tile_to_half<H: HalfC>(
        self,
        steps: usize,
        a: *const u32,
        b: *const u32,
        (c, ldc): (*mut f32, usize),
        from: TileFrom,
        (out, ldo): (*mut H, usize),
    ) {
        // SAFETY: the caller's guarantee; `Isa::AmxBf16` runs only where AVX512-BF16 does, so AVX-512 is
        // there for the rounding.
        unsafe {
            self.run(steps, ALines::Panel(a), b, c, ldc, Start::of(from));
            round_rows_32(AMX_32X32.mr, (c, ldc), (out.cast::<u16>(), ldo), H::BF16);
        }
    }
}

/// Where a tile's sums start.
#[derive(Clone, Copy)]
enum Start {
    Zero,
    /// From C's tile.
    C,
    /// From one row of 32 floats, the same for every row of the tile (a bias): tile loads with row
    /// stride 0, so C is not written before the products.
    Row(*const f32),
}

impl Start {
    fn of(from: TileFrom) -> Start {
        match from {
            TileFrom::Zero => Start::Zero,
            TileFrom::Tile => Start::C,
            TileFrom::Row(row) => Start::Row(row),
        }
    }
}

/// Where a tile's 32 A lines are: a packed micro-panel (groups of 32 lines x 16 pairs), or bf16 rows
/// `lda` values apart read in place.
#[derive(Clone, Copy)]
enum ALines {
    Panel(*const u32),
    Rows(*const u16, usize),
}

impl ALines {
    /// Group `g`'s two A tiles (lines 0..16 and 16..32) and the bytes between their rows.
    ///
    /// # Safety
    /// The group lies inside the panel or the rows.
    unsafe fn group(self, g: usize) -> (*const u8, *const u8, usize) {
        // SAFETY: the caller's guarantee.
        unsafe {
            match self {
                ALines::Panel(a) => {
                    let a0 = a.add(g * GROUP * AMX_32X32.mr);
                    (a0.cast(), a0.add(16 * GROUP).cast(), A_ROW_BYTES)
                }
                ALines::Rows(a, lda) => {
                    let a0 = a.add(g * 2 * GROUP);
                    (a0.cast(), a0.add(16 * lda).cast(), 2 * lda)
                }
            }
        }
    }

    /// Group `g`'s lines into L1 ahead of their products (a packed group is contiguous; rows read in
    /// place are left to the hardware's prefetcher).
    ///
    /// # Safety
    /// As [`ALines::group`].
    unsafe fn prefetch(self, g: usize) {
        if let ALines::Panel(a) = self {
            // SAFETY: the caller's guarantee.
            unsafe { prefetch::bytes_to_l1(a.add(g * GROUP * AMX_32X32.mr).cast(), A_GROUP_BYTES) };
        }
    }
}

impl TileAmx {
    /// [`Micro::tile`] with its start and its A lines.
    ///
    /// # Safety
    /// As [`Micro::tile`] (or [`Micro::tile_in_place`] for rows read in place); a `Start::Row`
    /// pointer is valid for 32 floats.
    unsafe fn run(self, steps: usize, a: ALines, b: *const u32, c: *mut f32, ldc: usize, start: Start) {
        debug_assert_eq!(steps % GROUP, 0, "AMX panels are padded to whole groups");
        let c_row_bytes = ldc * 4;
        // SAFETY (whole body): `begin` configured the tiles on this thread; C holds 32 rows of 32 floats
        // `ldc` apart, A `steps / 16` groups of 32 lines x 16 pairs and B `steps` rows of 32 pairs (the
        // caller's guarantee), so every tile row loaded or stored lies inside them.
        unsafe {
            match start {
                Start::C => load_quarters(c, c_row_bytes),
                Start::Row(row) => asm!(
                    "tileloadd tmm0, [{r0} + {zero}*1]",
                    "tileloadd tmm1, [{r1} + {zero}*1]",
                    "tileloadd tmm2, [{r0} + {zero}*1]",
                    "tileloadd tmm3, [{r1} + {zero}*1]",
                    r0 = in(reg) row,
                    r1 = in(reg) row.add(16),
                    zero = in(reg) 0usize,
                    options(nostack, readonly, preserves_flags),
                ),
                Start::Zero => zero_quarters(),
            }
            let groups = steps / GROUP;
            for group in 0..groups {
                if group + 1 < groups {
                    // The next group's A and B tiles into L1 while this group's products run: the
                    // tile loads otherwise wait on L2 at every group.
                    a.prefetch(group + 1);
                    prefetch::bytes_to_l1(b.add((group + 1) * GROUP * AMX_32X32.nr).cast(), B_GROUP_BYTES);
                }
                products(a.group(group), b.add(group * GROUP * AMX_32X32.nr));
            }
            store_quarters(c, c_row_bytes);
        }
    }
}

/// Zeroes tmm0..tmm3, the four quarters of C.
///
/// # Safety
/// The tiles are configured on this thread.
#[inline(always)]
unsafe fn zero_quarters() {
    // SAFETY: as the caller guarantees; only tile registers are touched.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem, preserves_flags)
        );
    }
}

/// Loads the four quarters of the 32 x 32 f32 tile at `c` (rows `row_bytes` apart) into tmm0..tmm3:
/// rows 0..16 and 16..32 by columns 0..16 and 16..32.
///
/// # Safety
/// The tiles are configured on this thread; `c` holds 32 rows of 32 floats `row_bytes` apart.
#[inline(always)]
unsafe fn load_quarters(c: *const f32, row_bytes: usize) {
    // SAFETY: as the caller guarantees.
    unsafe {
        asm!(
            "tileloadd tmm0, [{c0} + {stride}*1]",
            "tileloadd tmm1, [{c1} + {stride}*1]",
            "tileloadd tmm2, [{c2} + {stride}*1]",
            "tileloadd tmm3, [{c3} + {stride}*1]",
            c0 = in(reg) c,
            c1 = in(reg) c.add(16),
            c2 = in(reg) c.byte_add(16 * row_bytes),
            c3 = in(reg) c.byte_add(16 * row_bytes).add(16),
            stride = in(reg) row_bytes,
            options(nostack, readonly, preserves_flags),
        );
    }
}

/// Stores tmm0..tmm3 into the 32 x 32 f32 tile at `c`, as [`load_quarters`] loads them.
///
/// # Safety
/// As [`load_quarters`], `c` writable.
#[inline(always)]
unsafe fn store_quarters(c: *mut f32, row_bytes: usize) {
    // SAFETY: as the caller guarantees.
    unsafe {
        asm!(
            "tilestored [{c0} + {stride}*1], tmm0",
            "tilestored [{c1} + {stride}*1], tmm1",
            "tilestored [{c2} + {stride}*1], tmm2",
            "tilestored [{c3} + {stride}*1], tmm3",
            c0 = in(reg) c,
            c1 = in(reg) c.add(16),
            c2 = in(reg) c.byte_add(16 * row_bytes),
            c3 = in(reg) c.byte_add(16 * row_bytes).add(16),
            stride = in(reg) row_bytes,
            options(nostack, preserves_flags),
        );
    }
}

/// One tile product of each quarter: A's lines 0..16 and 16..32 (tmm4, tmm5: 16 rows of 16 pairs from
/// `a_lines.0` and `a_lines.1`, rows `a_lines.2` bytes apart) by B's columns 0..16 and 16..32 (tmm6,
/// tmm7: 16 steps of a 32-column step-major panel from `b`) into tmm0..tmm3.
///
/// # Safety
/// The tiles are configured on this thread; A holds 16 rows of 64 bytes from each of its two
/// pointers, B 16 steps of 32 pairs.
#[inline(always)]
unsafe fn products((a, a_low, a_row_bytes): (*const u8, *const u8, usize), b: *const u32) {
    // SAFETY: as the caller guarantees.
    unsafe {
        asm!(
            "tileloadd tmm4, [{a0} + {sa}*1]",
            "tileloadd tmm5, [{a1} + {sa}*1]",
            "tileloadd tmm6, [{b0} + {sb}*1]",
            "tileloadd tmm7, [{b1} + {sb}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            a0 = in(reg) a,
            a1 = in(reg) a_low,
            b0 = in(reg) b,
            b1 = in(reg) b.add(16),
            sa = in(reg) a_row_bytes,
            sb = in(reg) B_ROW_BYTES,
            options(nostack, readonly, preserves_flags),
        );
    }
}

impl TransposedTile for TileAmx {
    unsafe fn transposed_tile(
        self,
        groups: usize,
        (w, ldw): (*const u16, usize),
        at: *const u32,
        tile: &mut [f32; 1024],
    ) {
        // C^T's quarters in tmm0..tmm3 (the tile's rows are 32 floats), 16 lines of w as each A tile
        // (rows `ldw` values apart), A^T's panel as B.
        const TILE_ROW_BYTES: usize = 32 * 4;
        let t = tile.as_mut_ptr();
        // SAFETY: `begin` configured the tiles on this thread; `w` holds 32 lines of `32 * groups`
        // values `ldw` apart and `at` `16 * groups` steps of 32 pairs (the caller's guarantee), and the
        // tile 32 rows of 32 floats, so every tile row loaded or stored lies inside them.
        unsafe {
            load_quarters(t, TILE_ROW_BYTES);
            for group in 0..groups {
                let w0 = w.add(group * 32);
                products((w0.cast(), w0.add(16 * ldw).cast(), ldw * 2), at.add(group * GROUP * 32));
            }
            store_quarters(t, TILE_ROW_BYTES);
        }
    }
}

/// `iters` rounds of four independent `tdpbf16ps` on zeroed tiles: the instruction's peak rate.
///
/// # Safety
/// [`Isa::AmxBf16`] must be supported.
pub(crate) unsafe fn peak_loop(iters: usize) {
    let amx = TileAmx(());
    amx.begin();
    // SAFETY: tiles configured by `begin`; only tile registers are touched.
    unsafe {
        zero_quarters();
        asm!(
            "tilezero tmm4",
            "tilezero tmm5",
            "tilezero tmm6",
            "tilezero tmm7",
            options(nostack, nomem, preserves_flags)
        );
        for _ in 0..iters {
            asm!(
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                options(nostack, nomem, preserves_flags)
            );
        }
    }
    amx.end();
}

/// Two A and two B tiles of ones, each 16 rows of 64 bytes, on cache lines: 4 KiB that stay in L1.
#[repr(C, align(64))]
struct StepTiles([u16; 2048]);

static STEP_TILES: StepTiles = StepTiles([0x3F80; 2048]);

/// `iters` steps of the 2 x 2 tile loop on operands in L1: the four tile loads and four `tdpbf16ps` of
/// one group of the kernel ([`products`]), again and again.
///
/// # Safety
/// [`Isa::AmxBf16`] must be supported.
pub(crate) unsafe fn step_loop(iters: usize) {
    let amx = TileAmx(());
    amx.begin();
    let base = STEP_TILES.0.as_ptr().cast::<u8>();
    // SAFETY: tiles configured by `begin`; each tile load reads 16 rows of 64 bytes inside the 4 KiB
    // (A at 0 and 1 KiB with rows 64 bytes apart; B at 2 KiB and 64 bytes on, rows 128 bytes apart).
    unsafe {
        zero_quarters();
        for _ in 0..iters {
            products((base, base.add(1024), A_ROW_BYTES), base.add(2048).cast());
        }
    }
    amx.end();
}
