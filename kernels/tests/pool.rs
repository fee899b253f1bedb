//! `amp_kernels::pool` against a direct definition in f64, window by window, on random shapes
//! (padding up to half the window, strides, dilations, several planes) and in every dtype.
//!
//! The values are chosen so that the reference is exact: inputs are small integers (ties in max
//! windows are frequent, so the first-maximum rule is exercised), output gradients small integers, so
//! every f32 sum of them is exact and max pooling's results and gradients must match bit for bit, and
//! an average (an exact f32 sum divided once) is the f64 quotient rounded to f32. Only the average's
//! backward divides before it sums: each of its terms is one rounding of `dy / size`, so its error is
//! within `(terms + 1) u` of the sum of the terms' magnitudes.

use amp_kernels::conv::ConvShape;
use amp_kernels::pool::{avg_backward, avg_forward, max_backward, max_forward};
use half::{bf16, f16};
use proptest::prelude::*;

/// The windows of one shape, defined directly: for each output, the input indices it reads, in
/// row-major window order (the padding skipped).
fn windows(shape: &ConvShape) -> Vec<Vec<usize>> {
    let [rows, cols] = shape.output().expect("an output");
    let mut all = Vec::new();
    for p in 0..shape.channels {
        for (oh, ow) in (0..rows).flat_map(|oh| (0..cols).map(move |ow| (oh, ow))) {
            let mut window = Vec::new();
            for (i, j) in (0..shape.kernel[0]).flat_map(|i| (0..shape.kernel[1]).map(move |j| (i, j))) {
                let h = (oh * shape.stride[0] + i * shape.dilation[0]).checked_sub(shape.padding[0]);
                let w = (ow * shape.stride[1] + j * shape.dilation[1]).checked_sub(shape.padding[1]);
                if let (Some(h), Some(w)) = (h, w) {
                    if h < shape.height && w < shape.width {
                        window.push((p * shape.height + h) * shape.width + w);
                    }
                }
            }
            all.push(window);
        }
    }
    all
}

/// The first maximum of a window (a NaN wins: the first NaN), and where it is.
fn first_max(x: &[f32], window: &[usize]) -> Option<(f32, usize)> {
    let mut best: Option<(f32, usize)> = None;
    for &at in window {
        let v = x[at];
        best = match best {
            None => Some((v, at)),
            Some((b, _)) if (v > b || v.is_nan()) && !b.is_nan() => Some((v, at)),
            keep => keep,
        };
    }
    best
}

fn shape() -> impl Strategy<Value = ConvShape> {
    (
        1usize..4,
        1usize..13,
        1usize..13,
        [1usize..5, 1usize..5],
        [1usize..4, 1usize..4],
        [1usize..3, 1usize..3],
    )
        .prop_flat_map(|(channels, height, width, kernel, stride, dilation)| {
            let padding = [0..=kernel[0] / 2, 0..=kernel[1] / 2];
            (Just((channels, height, width, kernel, stride, dilation)), padding)
        })
        .prop_map(|((channels, height, width, kernel, stride, dilation), padding)| ConvShape {
            channels,
            height,
            width,
            kernel,
            padding,
            stride,
            dilation,
        })
        .prop_filter("an output", |s| s.output().is_some())
}

/// Small integers from a seed: `count` values in `-span..=span`.
fn integers(count: usize, seed: u64, span: i64) -> Vec<f32> {
    let mut state = seed | 1;
    (0..count)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state % (2 * span as u64 + 1)) as i64 - span) as f32
        })
        .collect()
}

fn outputs(shape: &ConvShape) -> usize {
    shape.output().map_or(0, |[r, c]| shape.channels * r * c)
}

fn run_max(shape: &ConvShape, x: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (mut y, mut dx) = (vec![f32::NAN; outputs(shape)], vec![f32::NAN; x.len()]);
    max_forward(shape, x.into(), (&mut y[..]).into());
    max_backward(shape, x.into(), dy.into(), (&mut dx[..]).into());
    (y, dx)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|v| v.to_bits()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn max_pooling_and_its_gradient_are_the_first_maximum_of_each_window(shape in shape(), seed in any::<u64>()) {
        let x = integers(shape.image_len(), seed, 3);
        let dy = integers(outputs(&shape), seed ^ 0x9e37, 8);
        let (y, dx) = run_max(&shape, &x, &dy);
        let mut expected_dx = vec![0.0f32; x.len()];
        for ((window, &y), &g) in windows(&shape).iter().zip(&y).zip(&dy) {
            match first_max(&x, window) {
                Some((max, at)) => {
                    prop_assert_eq!(y.to_bits(), max.to_bits());
                    expected_dx[at] += g;
                }
                None => prop_assert_eq!(y, f32::NEG_INFINITY),
            }
        }
        prop_assert_eq!(bits(&dx), bits(&expected_dx));
    }

    #[test]
    fn average_pooling_divides_each_windows_sum_by_its_size_padding_included(shape in shape(), seed in any::<u64>()) {
        let shape = ConvShape { dilation: [1, 1], ..shape };
        let x = integers(shape.image_len(), seed, 50);
        let dy = integers(outputs(&shape), seed ^ 0x51ed, 50);
        let size = (shape.kernel[0] * shape.kernel[1]) as f64;
        let (mut y, mut dx) = (vec![f32::NAN; dy.len()], vec![f32::NAN; x.len()]);
        avg_forward(&shape, (&x[..]).into(), (&mut y[..]).into());
        avg_backward(&shape, (&dy[..]).into(), (&mut dx[..]).into());
        let (mut expected_dx, mut terms, mut magnitude) = (vec![0f64; x.len()], vec![0usize; x.len()], vec![0f64; x.len()]);
        for ((window, &y), &g) in windows(&shape).iter().zip(&y).zip(&dy) {
            let sum: f64 = window.iter().map(|&at| f64::from(x[at])).sum();
            prop_assert_eq!(y.to_bits(), ((sum / size) as f32).to_bits());
            for &at in window {
                expected_dx[at] += f64::from(g) / size;
                terms[at] += 1;
                magnitude[at] += (f64::from(g) / size).abs();
            }
        }
        for (i, &got) in dx.iter().enumerate() {
            let bound = (terms[i] + 1) as f64 * f64::from(f32::EPSILON) / 2.0 * magnitude[i];
            prop_assert!((f64::from(got) - expected_dx[i]).abs() <= bound, "dx[{}] {} vs {}", i, got, expected_dx[i]);
        }
    }

    #[test]
    fn half_planes_pool_as_their_f32_values_do_and_round_the_gradient_once(shape in shape(), seed in any::<u64>()) {
        // Integers up to 3 and gradients up to 8 are exact in both half formats, and so are the
        // gradient's sums here (at most 16 windows x 8 = 128 < 2^8): the half results are the f32 ones.
        let x = integers(shape.image_len(), seed, 3);
        let dy = integers(outputs(&shape), seed ^ 0x7f4a, 8);
        let (y, dx) = run_max(&shape, &x, &dy);
        let avg_shape = ConvShape { dilation: [1, 1], ..shape };
        let mut avg = vec![0.0f32; outputs(&avg_shape)];
        avg_forward(&avg_shape, (&x[..]).into(), (&mut avg[..]).into());
        macro_rules! check {
            ($t:ty) => {{
                let to = |v: &[f32]| v.iter().map(|&v| <$t>::from_f32(v)).collect::<Vec<$t>>();
                let (xh, dyh) = (to(&x), to(&dy));
                let (mut yh, mut dxh) = (vec![<$t>::NAN; y.len()], vec![<$t>::NAN; x.len()]);
                max_forward(&shape, (&xh[..]).into(), (&mut yh[..]).into());
                max_backward(&shape, (&xh[..]).into(), (&dyh[..]).into(), (&mut dxh[..]).into());
                prop_assert_eq!(yh, to(&y));
                prop_assert_eq!(dxh, to(&dx));
                let mut avg_h = vec![<$t>::NAN; avg.len()];
                avg_forward(&avg_shape, (&xh[..]).into(), (&mut avg_h[..]).into());
                prop_assert_eq!(avg_h, to(&avg), "the f32 mean rounded once");
            }};
        }
        check!(f16);
        check!(bf16);
    }
}

#[test]
fn a_nan_wins_its_windows_and_takes_their_gradient() {
    // 1 x 5, windows of 3 at stride 1: [0 1 2], [1 2 3], [2 3 4]; a NaN at 1 and at 3.
    let shape = ConvShape { kernel: [1, 3], ..ConvShape::new(1, 1, 5) };
    let x = [5.0, f32::NAN, 9.0, f32::NAN, 1.0];
    let (y, dx) = run_max(&shape, &x, &[1.0, 10.0, 100.0]);
    assert!(y.iter().all(|v| v.is_nan()), "{y:?}");
    // Each window's first NaN: 1, 1, 3.
    assert_eq!(dx, [0.0, 11.0, 0.0, 100.0, 0.0]);
}

#[test]
fn windows_of_negative_infinities_route_their_gradient_to_their_first_element() {
    let shape = ConvShape { kernel: [2, 2], padding: [1, 1], ..ConvShape::new(1, 2, 2) };
    let x = [f32::NEG_INFINITY; 4];
    let (y, dx) = run_max(&shape, &x, &[1.0; 9]);
    assert_eq!(y, [f32::NEG_INFINITY; 9]);
    // Output (oh, ow) reads rows oh - 1, oh and columns ow - 1, ow: its first inside element.
    assert_eq!(dx, [4.0, 2.0, 2.0, 1.0]);
}

#[test]
fn planes_run_in_parallel_with_the_same_bits_as_one_at_a_time() {
    let shape = ConvShape { kernel: [3, 3], stride: [2, 2], padding: [1, 1], ..ConvShape::new(64, 30, 30) };
    let x = integers(shape.image_len(), 7, 1000).iter().map(|v| v / 7.0).collect::<Vec<f32>>();
    let dy = integers(outputs(&shape), 8, 1000).iter().map(|v| v / 3.0).collect::<Vec<f32>>();
    let one_thread = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("a pool");
    let (y1, dx1) = one_thread.install(|| run_max(&shape, &x, &dy));
    let (y, dx) = run_max(&shape, &x, &dy);
    assert_eq!((bits(&y), bits(&dx)), (bits(&y1), bits(&dx1)));
    let (mut a1, mut a) = (vec![0.0f32; x.len()], vec![0.0f32; x.len()]);
    one_thread.install(|| avg_backward(&shape, (&dy[..]).into(), (&mut a1[..]).into()));
    avg_backward(&shape, (&dy[..]).into(), (&mut a[..]).into());
    assert_eq!(bits(&a), bits(&a1));
}
