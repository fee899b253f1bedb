//! Reductions in independent lanes, so that the loops around them vectorise while every version of a
//! loop (`widest_vectors!`) still computes the same bits: element `j` goes to lane `j % LANES`, and the
//! lanes are combined in a fixed order at the end. (A sum in element order is one chain of dependent
//! adds, which the compiler may not reorder: it stays scalar.)

/// Lanes of [`lane_sum`]: f64 accumulators, one zmm register.
pub(crate) const LANES: usize = 8;

/// `sum over j of term(a[j], b[j])` (`a` and `b` of one length) in f64 lanes: element `j` goes to lane
/// `j % LANES` (the last `len % LANES` to the first lanes), and the lanes are added in a fixed tree at
/// the end. The slices are read as arrays of `LANES`, so the loop has no bounds checks and vectorises.
#[inline(always)]
pub(crate) fn lane_sum(a: &[f32], b: &[f32], term: impl Fn(f32, f32) -> f64) -> f64 {
    assert_eq!(a.len(), b.len(), "lane_sum: lengths");
    let (a_whole, a_rest) = a.as_chunks::<LANES>();
    let (b_whole, b_rest) = b.as_chunks::<LANES>();
    let mut acc = [0f64; LANES];
    for (x, y) in a_whole.iter().zip(b_whole) {
        for l in 0..LANES {
            acc[l] += term(x[l], y[l]);
        }
    }
    for (l, (&x, &y)) in a_rest.iter().zip(b_rest).enumerate() {
        acc[l] += term(x, y);
    }
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
}

/// Lanes of [`lane_max`]: one zmm register of f32.
const MAX_LANES: usize = 16;

/// The maximum of `a` as a fold with `f32::max` from `-inf` computes it (a NaN skipped), in lanes. A
/// maximum does not depend on the order it is taken in, so this is that fold's value (up to which
/// zero, `+0` or `-0`, when both are the maximum), only faster.
#[inline(always)]
pub(crate) fn lane_max(a: &[f32]) -> f32 {
    let (whole, rest) = a.as_chunks::<MAX_LANES>();
    let mut acc = [f32::NEG_INFINITY; MAX_LANES];
    for x in whole {
        for l in 0..MAX_LANES {
            acc[l] = acc[l].max(x[l]);
        }
    }
    for (l, &x) in rest.iter().enumerate() {
        acc[l] = acc[l].max(x);
    }
    acc.iter().fold(f32::NEG_INFINITY, |m, &a| m.max(a))
}
