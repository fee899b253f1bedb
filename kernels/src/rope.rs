//! Rotary position embeddings (RoPE): each row of `d` values (one head of one token) is cut into `d / 2`
//! pairs, and pair `i` is rotated by the angle whose cosine and sine are `cos[i]` and `sin[i]` of the
//! row's position:
//!
//! `y1 = x1 * cos - x2 * sin`, `y2 = x1 * sin + x2 * cos`.
//!
//! The backward pass is the inverse rotation of the output's gradient (a rotation's inverse is its
//! transpose): `dx1 = dy1 * cos + dy2 * sin`, `dx2 = dy2 * cos - dy1 * sin`.
//!
//! Computed in f32 whatever the storage: half rows are widened exactly and the result rounded once
//! (candle-nn's kernels compute in the storage's type, rounding each product and the sum in bf16 or
//! f16). In f32 each value is the products rounded, then their difference or sum rounded, in that
//! order and without fused multiply-adds: candle-nn's `rope`, `rope_i` and `rope_thd` compute the same
//! bits.

use crate::slices::Float;
use crate::{GradSlice, GradSliceMut};

/// Which values of a row form a pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pairing {
    /// Value `i` with value `i + d / 2` (GPT-NeoX and Llama's layout; candle-nn's `rope` and
    /// `rope_thd`).
    Halves,
    /// Value `2i` with value `2i + 1` (the original paper's and GPT-J's; candle-nn's `rope_i`).
    Adjacent,
}

/// The rotation, or its inverse (the backward pass).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// By the angle: the forward pass.
    Forward,
    /// By minus the angle: the backward pass, applied to the output's gradient.
    Inverse,
}

/// How the rows of `x` are ordered, which gives each row's position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowOrder {
    /// `(batch, heads, positions, d)`: a head's positions are consecutive rows.
    HeadsThenPositions,
    /// `(batch, positions, heads, d)`: a position's heads are consecutive rows.
    PositionsThenHeads,
}

/// A rotation of rows of `d` values: their pairing, order and shape, and the angle table.
#[derive(Clone, Copy, Debug)]
pub struct Rope<'a> {
    /// Which values form a pair.
    pub pairing: Pairing,
    /// How rows map to positions.
    pub order: RowOrder,
    /// Heads per token.
    pub heads: usize,
    /// Positions (tokens) per sequence.
    pub positions: usize,
    /// Values per row (even).
    pub d: usize,
    /// Cosines, rows of `d / 2`: row `p` for position `p` (at least `positions` rows), or, when
    /// `per_sequence`, row `b * positions + p` for sequence `b`.
    pub cos: &'a [f32],
    /// Sines, laid out as `cos`.
    pub sin: &'a [f32],
    /// Whether each sequence of the batch has angles of its own.
    pub per_sequence: bool,
}

impl Rope<'_> {
    /// The row of the angle tables that row `row` of `x` reads.
    fn angle_row(&self, row: usize) -> usize {
        let (position, sequence) = match self.order {
            RowOrder::HeadsThenPositions => (row % self.positions, row / (self.heads * self.positions)),
            RowOrder::PositionsThenHeads => {
                (row / self.heads % self.positions, row / (self.heads * self.positions))
            }
        };
        if self.per_sequence {
            sequence * self.positions + position
        } else {
            position
        }
    }

    /// Panics unless `len` values from row `first_row` are whole rows of whole pairs, and the angle
    /// tables cover each of those rows.
    fn check(&self, first_row: usize, len: usize) {
        let (d, half) = (self.d, self.d / 2);
        assert!(d > 0 && d.is_multiple_of(2), "rope: a row of {d} values is not whole pairs");
        assert!(len.is_multiple_of(d), "rope: a length of {len} is not whole rows of {d}");
        let rows = first_row..first_row + len / d;
        let last = rows.clone().map(|r| self.angle_row(r)).max().map_or(0, |a| a + 1);
        let need = last * half;
        assert!(
            self.cos.len() >= need && self.sin.len() >= need,
            "rope: rows {rows:?} read {last} rows of angles ({need} values); cos has {}, sin {}",
            self.cos.len(),
            self.sin.len()
        );
    }

    /// Rotates rows `first_row..` of a tensor: `x` holds those whole rows, `y` receives them, in the
    /// same dtype (f32, f16 or bf16; f32 inside).
    ///
    /// # Panics
    /// If `x` and `y` differ in length or dtype, are not whole rows, or the angle tables are short.
    pub fn rotate(&self, direction: Direction, x: GradSlice<'_>, first_row: usize, y: GradSliceMut<'_>) {
        assert_eq!(x.len(), y.len(), "rope: x and y lengths");
        match (x, y) {
            (GradSlice::F32(x), GradSliceMut::F32(y)) => self.rotate_rows(direction, x, first_row, y),
            (GradSlice::F16(x), GradSliceMut::F16(y)) => self.rotate_rows(direction, x, first_row, y),
            (GradSlice::Bf16(x), GradSliceMut::Bf16(y)) => self.rotate_rows(direction, x, first_row, y),
            (x, y) => panic!("rope: x is {:?} but y {:?}", x.dtype(), y.dtype()),
        }
    }

    fn rotate_rows<T: Float>(&self, direction: Direction, x: &[T], first_row: usize, y: &mut [T]) {
        let d = self.d;
        self.check(first_row, x.len());
        let half = d / 2;
        let (mut wide, mut out) = (vec![0f32; d], vec![0f32; d]);
        for (i, (x, y)) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)).enumerate() {
            let angles = self.angle_row(first_row + i) * half;
            let (cos, sin) = (&self.cos[angles..angles + half], &self.sin[angles..angles + half]);
            let x = match T::as_f32(x) {
                Some(x) => x,
                None => {
                    T::widen(x, &mut wide);
                    &wide
                }
            };
            match T::as_f32_mut(y) {
                Some(y) => rotate_row(self.pairing, direction, x, cos, sin, y),
                None => {
                    rotate_row(self.pairing, direction, x, cos, sin, &mut out);
                    T::narrow(&out, y);
                }
            }
        }
    }
}

widest_vectors! {
    /// One row, f32 in and out.
    fn rotate_row(pairing: Pairing, direction: Direction, x: &[f32], cos: &[f32], sin: &[f32], y: &mut [f32]) => rotate_row_any;
}

#[inline(always)]
fn rotate_row_any(
    pairing: Pairing,
    direction: Direction,
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    y: &mut [f32],
) {
    let half = cos.len();
    let sin = &sin[..half];
    // The rotation of one pair; its inverse is the rotation by the negated sine.
    let rotate = |x1: f32, x2: f32, c: f32, s: f32| match direction {
        Direction::Forward => (x1 * c - x2 * s, x1 * s + x2 * c),
        Direction::Inverse => (x1 * c + x2 * s, x2 * c - x1 * s),
    };
    match pairing {
        Pairing::Halves => {
            let (x1, x2) = x[..2 * half].split_at(half);
            let (y1, y2) = y[..2 * half].split_at_mut(half);
            for i in 0..half {
                (y1[i], y2[i]) = rotate(x1[i], x2[i], cos[i], sin[i]);
            }
        }
        Pairing::Adjacent => {
            let (xs, ys) = (x[..2 * half].as_chunks::<2>().0, y[..2 * half].as_chunks_mut::<2>().0);
            for i in 0..half {
                let [x1, x2] = xs[i];
                let (y1, y2) = rotate(x1, x2, cos[i], sin[i]);
                ys[i] = [y1, y2];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;

    fn values(n: usize, seed: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.5 - 1.0) * scale).collect()
    }

    /// Angles `p * 10000^(-2i/d)` as f32 cosines and sines, `rows` of `d / 2`.
    fn angles(rows: usize, d: usize) -> (Vec<f32>, Vec<f32>) {
        let theta = |r: usize, i: usize| r as f64 * 10_000f64.powf(-2.0 * i as f64 / d as f64);
        let table = |f: fn(f64) -> f64| -> Vec<f32> {
            (0..rows * d / 2).map(|k| f(theta(k / (d / 2), k % (d / 2))) as f32).collect()
        };
        (table(f64::cos), table(f64::sin))
    }

    /// The rotation in f64, from the definition, with the pair and position of each value found the
    /// slow way.
    fn reference(rope: &Rope<'_>, direction: Direction, x: &[f32]) -> Vec<f64> {
        let (d, half) = (rope.d, rope.d / 2);
        let mut y = vec![0f64; x.len()];
        for r in 0..x.len() / d {
            let (b, rest) = (r / (rope.heads * rope.positions), r % (rope.heads * rope.positions));
            let p = match rope.order {
                RowOrder::HeadsThenPositions => rest % rope.positions,
                RowOrder::PositionsThenHeads => rest / rope.heads,
            };
            let a = if rope.per_sequence { b * rope.positions + p } else { p };
            for i in 0..half {
                let (j1, j2) = match rope.pairing {
                    Pairing::Halves => (i, i + half),
                    Pairing::Adjacent => (2 * i, 2 * i + 1),
                };
                let (c, s) = (f64::from(rope.cos[a * half + i]), f64::from(rope.sin[a * half + i]));
                let s = if direction == Direction::Forward { s } else { -s };
                let (x1, x2) = (f64::from(x[r * d + j1]), f64::from(x[r * d + j2]));
                y[r * d + j1] = x1 * c - x2 * s;
                y[r * d + j2] = x1 * s + x2 * c;
            }
        }
        y
    }

    /// Every pairing, row order and angle layout, both directions, rows rotated a block at a time from
    /// any first row: within 2 f32 roundings of the f64 rotation (two rounded products and a rounded
    /// sum of values of at most |x|), and the inverse undoes the forward to the same bound.
    #[test]
    fn matches_the_f64_rotation_and_the_inverse_undoes_it() {
        let (batch, heads, positions, d) = (2, 3, 5, 8);
        let (cos, sin) = angles(batch * positions + 3, d);
        let x = values(batch * heads * positions * d, 1, 3.0);
        for pairing in [Pairing::Halves, Pairing::Adjacent] {
            for order in [RowOrder::HeadsThenPositions, RowOrder::PositionsThenHeads] {
                for per_sequence in [false, true] {
                    let rope =
                        Rope { pairing, order, heads, positions, d, cos: &cos, sin: &sin, per_sequence };
                    let what = format!("{pairing:?} {order:?} per sequence {per_sequence}");
                    let mut y = vec![0f32; x.len()];
                    // Two calls: rows 0..7 and 7.. (a block boundary inside a sequence).
                    let (x_a, x_b) = x.split_at(7 * d);
                    let (y_a, y_b) = y.split_at_mut(7 * d);
                    rope.rotate(Direction::Forward, GradSlice::F32(x_a), 0, GradSliceMut::F32(y_a));
                    rope.rotate(Direction::Forward, GradSlice::F32(x_b), 7, GradSliceMut::F32(y_b));
                    let want = reference(&rope, Direction::Forward, &x);
                    let bound = 2.0 * f64::from(f32::EPSILON) * 3.0;
                    for (i, (&got, &want)) in y.iter().zip(&want).enumerate() {
                        assert!((f64::from(got) - want).abs() <= bound, "{what} [{i}]: {got} vs {want}");
                    }
                    let mut back = vec![0f32; x.len()];
                    rope.rotate(Direction::Inverse, GradSlice::F32(&y), 0, GradSliceMut::F32(&mut back));
                    for (i, (&got, &want)) in back.iter().zip(&x).enumerate() {
                        assert!(
                            (got - want).abs() <= 3.0 * bound as f32,
                            "{what} inverse [{i}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// A bf16 row is the f32 rotation of its exact widening, rounded once.
    #[test]
    fn a_half_row_is_the_f32_rotation_rounded_once() {
        let (heads, positions, d) = (2, 4, 6);
        let (cos, sin) = angles(positions, d);
        let rope = Rope {
            pairing: Pairing::Halves,
            order: RowOrder::HeadsThenPositions,
            heads,
            positions,
            d,
            cos: &cos,
            sin: &sin,
            per_sequence: false,
        };
        let halves: Vec<bf16> =
            values(heads * positions * d, 2, 5.0).iter().map(|&v| bf16::from_f32(v)).collect();
        let widened: Vec<f32> = halves.iter().map(|v| v.to_f32()).collect();
        let (mut y, mut y32) = (vec![bf16::ZERO; halves.len()], vec![0f32; halves.len()]);
        rope.rotate(Direction::Forward, GradSlice::Bf16(&halves), 0, GradSliceMut::Bf16(&mut y));
        rope.rotate(Direction::Forward, GradSlice::F32(&widened), 0, GradSliceMut::F32(&mut y32));
        for (h, v) in y.iter().zip(&y32) {
            assert_eq!(h.to_bits(), bf16::from_f32(*v).to_bits());
        }
    }

    #[test]
    fn odd_rows_short_angle_tables_and_mixed_dtypes_are_refused() {
        let refused = |f: &dyn Fn()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err();
        let (cos, sin) = angles(4, 6);
        let rope = |d: usize, positions: usize| Rope {
            pairing: Pairing::Halves,
            order: RowOrder::HeadsThenPositions,
            heads: 1,
            positions,
            d,
            cos: &cos,
            sin: &sin,
            per_sequence: false,
        };
        let x = [0f32; 30];
        let rotate = |r: Rope<'_>, n: usize| {
            let mut y = vec![0f32; n];
            r.rotate(Direction::Forward, GradSlice::F32(&x[..n]), 0, GradSliceMut::F32(&mut y));
        };
        assert!(refused(&|| rotate(rope(5, 4), 30)), "odd d");
        assert!(refused(&|| rotate(rope(6, 5), 30)), "5 positions, 4 rows of angles");
        assert!(refused(&|| rotate(rope(6, 4), 28)), "a partial row");
        rotate(rope(6, 4), 24);
        assert!(refused(&|| {
            let mut y = vec![bf16::ZERO; 24];
            rope(6, 4).rotate(Direction::Forward, GradSlice::F32(&x[..24]), 0, GradSliceMut::Bf16(&mut y));
        }));
    }
}
