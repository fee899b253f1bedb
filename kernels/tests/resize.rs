//! `amp_kernels::resize`: the backward is the forward's adjoint (`<forward(x), dy> = <x, backward(dy)>`,
//! checked in f64 to the f32 rounding of both sides), each output a convex blend of its sources, and the
//! half dtypes the f32 result rounded once.

use amp_kernels::resize::{bilinear_backward, bilinear_forward, Planes, Taps};
use half::bf16;
use proptest::prelude::*;

/// Taps of `output` elements over `input`: random sources (second >= first) and weights.
fn taps(input: usize, output: usize, seed: u64) -> Taps {
    let mut state = seed | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut taps = Taps::default();
    for _ in 0..output {
        let first = (next() % input as u64) as u32;
        taps.first.push(first);
        taps.second.push((first + 1).min(input as u32 - 1));
        taps.weight.push((next() % 1025) as f32 / 1024.0);
    }
    taps
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as u64 * 7919).wrapping_add(seed.wrapping_mul(104_729)) % 2003) as f32 / 1001.5 - 1.0)
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn the_backward_is_the_forwards_adjoint(
        count in 1usize..4, height in 1usize..9, width in 1usize..9, rows in 1usize..17, cols in 1usize..17, seed in any::<u64>()
    ) {
        let (row_taps, col_taps) = (taps(height, rows, seed), taps(width, cols, seed ^ 0xabc));
        let planes = Planes { count, height, width, rows: &row_taps, cols: &col_taps };
        let (x, dy) = (values(count * height * width, seed), values(count * rows * cols, seed.wrapping_add(1)));
        let (mut y, mut dx) = (vec![f32::NAN; dy.len()], vec![f32::NAN; x.len()]);
        bilinear_forward(&planes, (&x[..]).into(), (&mut y[..]).into());
        bilinear_backward(&planes, (&dy[..]).into(), (&mut dx[..]).into());
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>();
        let magnitude = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(a, b)| f64::from(*a).abs() * f64::from(*b).abs()).sum::<f64>();
        let (lhs, rhs) = (dot(&y, &dy), dot(&x, &dx));
        // Each side carries at most a few f32 roundings per term (the blend's two steps, the sums).
        let bound = 64.0 * f64::from(f32::EPSILON) * (magnitude(&y, &dy) + magnitude(&x, &dx) + 1e-30);
        prop_assert!((lhs - rhs).abs() <= bound, "{} vs {}", lhs, rhs);
        // A convex blend of values in [-1, 1] stays there.
        prop_assert!(y.iter().all(|v| v.abs() <= 1.0 + 1e-6));
        // bf16: the f32 blend of the same (rounded) values, rounded once.
        let xh: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let xr: Vec<f32> = xh.iter().map(|v| v.to_f32()).collect();
        let (mut yh, mut yr) = (vec![bf16::NAN; y.len()], vec![0f32; y.len()]);
        bilinear_forward(&planes, (&xh[..]).into(), (&mut yh[..]).into());
        bilinear_forward(&planes, (&xr[..]).into(), (&mut yr[..]).into());
        prop_assert_eq!(yh, yr.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>());
    }
}
