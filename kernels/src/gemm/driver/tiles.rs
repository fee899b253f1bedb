//! The tiles the micro-kernel does not take whole: the steps a triangle leaves, tiles with none, and
//! tiles cut by C's edge.

use crate::gemm::layout::Triangle;
use crate::gemm::micro::{HalfC, Micro, TileFrom, MAX_TILE};

/// The steps `(first, count)` of the k-block `k0..k0 + kc` that the tile of rows `(row, rows)` (of its
/// matrix) and columns from `col` sums, given what `triangle` skips: whole groups of steps (a group of
/// A's layout; a step is one `k`, or a pair), so the steps kept hold every non-zero term. `count` 0:
/// the tile is only started.
pub(super) fn tile_steps<M: Micro>(
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
pub(super) unsafe fn bare_tile<H: HalfC>(
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
pub(super) unsafe fn edge_tile<M: Micro, H: HalfC>(
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
