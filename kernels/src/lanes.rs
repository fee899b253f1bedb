//! Reductions in independent lanes, so that the loops around them vectorise while every version of a
//! loop (`widest_vectors!`) still computes the same bits: element `j` goes to lane `j % LANES`, and the
//! lanes are combined in a fixed order at the end. (A sum in element order is one chain of dependent
//! adds, which the compiler may not reorder: it stays scalar.)

/// Independent f64 accumulators of a sum, which the compiler keeps in vector registers: element `j`
/// goes to lane `j % LANES` (the last `d % LANES` to the first lanes), and the lanes are added in a fixed
/// tree at the end, so every version of the loop computes the same bits.
pub(crate) const LANES: usize = 8;

/// `sum over j < n of term(j)`, in lanes.
#[inline(always)]
pub(crate) fn lane_sum(n: usize, term: impl Fn(usize) -> f64) -> f64 {
    let mut acc = [0f64; LANES];
    let whole = n - n % LANES;
    for base in (0..whole).step_by(LANES) {
        for (l, a) in acc.iter_mut().enumerate() {
            *a += term(base + l);
        }
    }
    for (l, a) in acc.iter_mut().enumerate().take(n - whole) {
        *a += term(whole + l);
    }
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
}

/// Lanes of [`lane_max`]: one zmm register of f32.
const MAX_LANES: usize = 16;

/// `max over j < n of term(j)` as a fold with `f32::max` from `-inf` computes it (a NaN skipped), in
/// lanes. A maximum does not depend on the order it is taken in, so this is that fold's value (up to
/// which zero, `+0` or `-0`, when both are the maximum), only faster.
#[inline(always)]
pub(crate) fn lane_max(n: usize, term: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [f32::NEG_INFINITY; MAX_LANES];
    let whole = n - n % MAX_LANES;
    for base in (0..whole).step_by(MAX_LANES) {
        for (l, a) in acc.iter_mut().enumerate() {
            *a = a.max(term(base + l));
        }
    }
    for (l, a) in acc.iter_mut().enumerate().take(n - whole) {
        *a = a.max(term(whole + l));
    }
    acc.iter().fold(f32::NEG_INFINITY, |m, &a| m.max(a))
}
