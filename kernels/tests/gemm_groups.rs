//! Products in groups (`gemm_new_groups`, and `gemm_groups_into` a C the caller holds): each product
//! where `gemm_with` alone would put it, bit for bit, and what a `Triangle` skips left out without
//! changing a bit of what is kept.

mod common;

use amp_kernels::gemm::{
    gemm_groups_into, gemm_new_groups, gemm_with, Compute, Dims, GemmError, GemmPath, Groups, MatMut, MatRef,
    NewOutput, OutputType, Placement, Start, Triangle,
};
use amp_kernels::Dtype;
use common::{assert_same, Owned, Rng};

/// The paths this CPU runs with what each computes in: f32 on the FMA paths, bf16 on the dot ones.
fn paths() -> impl Iterator<Item = (GemmPath, Compute)> {
    GemmPath::supported().map(|p| (p, if p.is_bf16_dot() { Compute::Bf16 } else { Compute::F32 }))
}

/// The output types tried with `compute`: f32, and bf16 for bf16 products (rounded from a scratch block
/// after the last k-block).
fn outputs(compute: Compute) -> &'static [(Dtype, OutputType)] {
    match compute {
        Compute::Bf16 => &[(Dtype::F32, OutputType::F32), (Dtype::Bf16, OutputType::Bf16)],
        _ => &[(Dtype::F32, OutputType::F32)],
    }
}

fn to_f32(c: NewOutput) -> Vec<f32> {
    match c {
        NewOutput::F32(v) => v,
        NewOutput::F16(v) => v.iter().map(|h| h.to_f32()).collect(),
        NewOutput::Bf16(v) => v.iter().map(|h| h.to_f32()).collect(),
    }
}

/// `count` operands of `(batch, rows, cols)` in one buffer: side by side in each row (`interleaved`:
/// product `g` the columns `g * cols ..`; transposed, the rows) or one after another, the views of
/// product 0 and the step between products. `value(g, b, i, j)` gives the elements.
fn grouped(
    dtype: Dtype,
    (count, batch, rows, cols): (usize, usize, usize, usize),
    (transposed, interleaved): (bool, bool),
    value: impl Fn(usize, usize, usize, usize) -> f32,
) -> (Owned, [usize; 3], usize) {
    let (lines, len) = if transposed { (cols, rows) } else { (rows, cols) };
    let (line_stride, batch_stride, step) = if interleaved {
        (count * len + 1, lines * (count * len + 1), len)
    } else {
        (len + 1, lines * (len + 1) + 2, batch * (lines * (len + 1) + 2))
    };
    let mut flat = vec![f32::NAN; count * batch * lines * line_stride + count * step];
    for g in 0..count {
        for b in 0..batch {
            for i in 0..rows {
                for j in 0..cols {
                    let (line, at) = if transposed { (j, i) } else { (i, j) };
                    flat[g * step + b * batch_stride + line * line_stride + at] = value(g, b, i, j);
                }
            }
        }
    }
    let (row_stride, col_stride) = if transposed { (1, line_stride) } else { (line_stride, 1) };
    (Owned::new(dtype, &flat), [row_stride, col_stride, batch_stride], step)
}

fn view(data: &Owned, [row_stride, col_stride, batch_stride]: [usize; 3]) -> MatRef<'_> {
    MatRef { data: data.view(), row_stride, col_stride, batch_stride }
}

/// Each product of a group, side by side or stacked, holds the bits `gemm_with` writes for it alone
/// into its place of a C it does not read (NaN-filled): every path, both operand layouts (heads side by
/// side in a row, matrices one after another), transposed or not, f32 and bf16 C, edge shapes.
#[test]
fn each_product_of_a_group_is_what_it_would_be_alone() {
    let mut rng = Rng(41);
    // The last shape is skinny (m <= 64, k >= 32): with A's rows and B's columns contiguous, a bf16 dot
    // path computes it as dot products where the operands lie, a product at a time.
    let shapes = [
        (3, 1, 1, 1, 1),
        (4, 2, 7, 65, 3),
        (3, 1, 97, 130, 257),
        (2, 3, 13, 9, 70),
        (1, 2, 6, 64, 2),
        (3, 2, 5, 17, 40),
    ];
    for (count, batch, m, n, k) in shapes {
        let dims = Dims::batched(batch, m, n, k);
        let xa = rng.vec(count * batch * m * k, -4, 4);
        let xb = rng.vec(count * batch * k * n, -4, 4);
        for (path, compute) in paths() {
            for &(out, out_type) in outputs(compute) {
                let layouts = [(false, true), (true, false), (false, false), (true, true)];
                // Both operands alike, and A row-major with B transposed (the skinny path's layout).
                let pairs = layouts.into_iter().map(|l| (l, l)).chain([((false, true), (true, true))]);
                for (a_layout, b_layout) in pairs {
                    let layout = (a_layout, b_layout);
                    let a_of = |g, b, i, j| xa[((g * batch + b) * m + i) * k + j];
                    let b_of = |g, b, i, j| xb[((g * batch + b) * k + i) * n + j];
                    let (a, a_strides, a_step) = grouped(Dtype::Bf16, (count, batch, m, k), a_layout, a_of);
                    let (b, b_strides, b_step) = grouped(Dtype::Bf16, (count, batch, k, n), b_layout, b_of);
                    for placement in [Placement::SideBySide, Placement::Stacked] {
                        let (row_stride, batch_stride, c_step) = match placement {
                            Placement::SideBySide => (count * n, m * count * n, n),
                            Placement::Stacked => (n, m * n, batch * m * n),
                        };
                        let mut alone = Owned::new(out, &vec![f32::NAN; count * batch * m * n]);
                        for g in 0..count {
                            let a = MatRef { data: a.view().split_at(g * a_step).1, ..view(&a, a_strides) };
                            let b = MatRef { data: b.view().split_at(g * b_step).1, ..view(&b, b_strides) };
                            let data = alone.view_mut().split_at(g * c_step).1;
                            let c = MatMut { data, row_stride, batch_stride };
                            gemm_with(path, dims, a, b, c, compute, Start::Zero).unwrap();
                        }
                        let groups = Groups { count, a_step, b_step, placement };
                        let operands = (view(&a, a_strides), view(&b, b_strides));
                        let together =
                            gemm_new_groups(path, dims, operands, groups, out_type, compute, Triangle::Full);
                        let what = format!("{path} {dims:?} x{count} {layout:?} {placement:?} {out:?}");
                        assert_same(&what, &to_f32(together.unwrap()), &alone.to_f32());
                        // Into a NaN-filled C two elements longer: every element written, the rest left.
                        let len = count * batch * m * n;
                        let mut into = Owned::new(out, &vec![f32::NAN; len + 2]);
                        gemm_groups_into(
                            path,
                            dims,
                            operands,
                            groups,
                            into.view_mut(),
                            compute,
                            Triangle::Full,
                        )
                        .unwrap();
                        let into = into.to_f32();
                        assert_same(&format!("{what}, into"), &into[..len], &alone.to_f32());
                        assert!(into[len..].iter().all(|x| x.is_nan()), "{what}: past C");
                    }
                }
            }
        }
    }
}

/// A group of no products is an empty C on every path, the skinny one's layout included (it had written
/// a whole product through the empty vector's dangling pointer).
#[test]
fn a_group_of_no_products_is_empty() {
    let (a, b) = (vec![1.0f32; 2 * 64 * 40], vec![1.0f32; 2 * 40 * 17]);
    let dims = Dims::batched(2, 64, 17, 40);
    let a = Owned::new(Dtype::Bf16, &a);
    let b = Owned::new(Dtype::Bf16, &b);
    // A row-major, B transposed: the skinny path's layout.
    let operands = (
        MatRef { data: a.view(), row_stride: 40, col_stride: 1, batch_stride: 64 * 40 },
        MatRef { data: b.view(), row_stride: 1, col_stride: 40, batch_stride: 40 * 17 },
    );
    for (path, compute) in paths() {
        for &(_, out_type) in outputs(compute) {
            for placement in [Placement::SideBySide, Placement::Stacked] {
                let groups = Groups { count: 0, a_step: 0, b_step: 0, placement };
                let c = gemm_new_groups(path, dims, operands, groups, out_type, compute, Triangle::Full);
                assert!(to_f32(c.unwrap()).is_empty(), "{path} {placement:?}");
            }
        }
    }
}

/// A group whose last product would read past its operand's slice is refused, by that operand.
#[test]
fn a_group_reaching_past_its_operand_is_refused() {
    let (a, b) = (vec![1.0f32; 4 * 8], vec![1.0f32; 8 * 2]);
    let dims = Dims::new(4, 2, 4);
    let operands = (MatRef::row_major(&a[..], 8), MatRef::row_major(&b[..], 2));
    let run = |count, a_step| {
        let groups = Groups { count, a_step, b_step: 0, placement: Placement::Stacked };
        gemm_new_groups(
            GemmPath::Portable,
            dims,
            operands,
            groups,
            OutputType::F32,
            Compute::F32,
            Triangle::Full,
        )
    };
    assert!(run(2, 4).is_ok(), "two heads of 4 columns side by side fit");
    for (count, a_step) in [(3, 4), (2, 5), (2, usize::MAX)] {
        match run(count, a_step) {
            Err(GemmError::OutOfBounds { operand: "A", .. }) => {}
            other => panic!("{count} products {a_step} apart: {other:?}"),
        }
    }
}

/// What each triangle promises of A: `A[i][p]` is zero outside it.
fn kept(triangle: Triangle, i: usize, p: usize) -> bool {
    match triangle {
        Triangle::ZeroAboveA => p <= i,
        Triangle::ZeroBelowA => p >= i,
        Triangle::Full | Triangle::LowerC => true,
    }
}

/// With A's zeros where the triangle says, the product that skips them holds the full product's bits
/// (the causal mask's shapes: square, and `k` past `m` and short of it, across k-blocks of every
/// kernel, in groups); with `LowerC`, C below and on the diagonal holds the full product's bits and
/// above it either those or zero (tiles wholly above it are not computed).
#[test]
fn skipping_a_triangle_keeps_every_bit_of_what_it_keeps() {
    let mut rng = Rng(43);
    let shapes = [
        (2, 1, 130, 70, 130),
        (1, 2, 97, 33, 97),
        (2, 1, 40, 65, 600),
        (1, 1, 600, 20, 40),
        (1, 1, 20, 600, 40),
        // The last row (64) meets the first column of a tile on every kernel.
        (1, 1, 65, 130, 65),
        (1, 1, 1100, 9, 1100),
    ];
    let triangles = [Triangle::ZeroAboveA, Triangle::ZeroBelowA, Triangle::LowerC];
    for (count, batch, m, n, k) in shapes {
        let dims = Dims::batched(batch, m, n, k);
        let xa = rng.vec(count * batch * m * k, -4, 4);
        let xb = rng.vec(count * batch * k * n, -4, 4);
        for triangle in triangles {
            for (path, compute) in paths() {
                for &(_, out_type) in outputs(compute) {
                    for layout in [(false, true), (true, false)] {
                        let a_of = |g, b, i, p| {
                            if kept(triangle, i, p) {
                                xa[((g * batch + b) * m + i) * k + p]
                            } else {
                                0.0
                            }
                        };
                        let b_of = |g, b, p, j| xb[((g * batch + b) * k + p) * n + j];
                        let (a, a_strides, a_step) = grouped(Dtype::Bf16, (count, batch, m, k), layout, a_of);
                        let (b, b_strides, b_step) = grouped(Dtype::Bf16, (count, batch, k, n), layout, b_of);
                        let groups = Groups { count, a_step, b_step, placement: Placement::Stacked };
                        let operands = (view(&a, a_strides), view(&b, b_strides));
                        let run = |t| {
                            to_f32(
                                gemm_new_groups(path, dims, operands, groups, out_type, compute, t).unwrap(),
                            )
                        };
                        // This thread's packing buffers filled with NaN first: a step that the skipping
                        // product left unpacked but read would show.
                        let nan_a = Owned::new(Dtype::Bf16, &vec![f32::NAN; a.len()]);
                        let nan = (view(&nan_a, a_strides), view(&b, b_strides));
                        gemm_new_groups(path, dims, nan, groups, out_type, compute, Triangle::Full).unwrap();
                        let skipped = run(triangle);
                        let full = run(Triangle::Full);
                        let what = format!("{path} {dims:?} x{count} {triangle:?} {layout:?} {out_type:?}");
                        if triangle != Triangle::LowerC {
                            assert_same(&what, &skipped, &full);
                            continue;
                        }
                        let mut zeroed = 0;
                        for (e, (&s, &f)) in skipped.iter().zip(&full).enumerate() {
                            let (i, j) = (e / n % m, e % n);
                            let same = s.to_bits() == f.to_bits();
                            assert!(
                                same || (j > i && s.to_bits() == 0),
                                "{what}: C[{e}] (row {i}, column {j}) {s} vs {f}"
                            );
                            zeroed += usize::from(!same);
                        }
                        // A C twice as wide as it is tall has whole tiles above the diagonal on every kernel.
                        if n >= 2 * m {
                            assert!(zeroed > 0, "{what}: no tile above the diagonal was skipped");
                        }
                    }
                }
            }
        }
    }
}

/// A C too short for the group's products is refused, and nothing is written.
#[test]
fn a_c_too_short_for_the_group_is_refused() {
    let (a, b) = (vec![1.0f32; 4 * 8], vec![1.0f32; 8 * 2]);
    let dims = Dims::new(4, 2, 4);
    let operands = (MatRef::row_major(&a[..], 8), MatRef::row_major(&b[..], 2));
    let groups = Groups { count: 2, a_step: 4, b_step: 0, placement: Placement::SideBySide };
    let mut c = [7.0f32; 2 * 4 * 2 - 1];
    let run = gemm_groups_into(
        GemmPath::Portable,
        dims,
        operands,
        groups,
        (&mut c[..]).into(),
        Compute::F32,
        Triangle::Full,
    );
    match run {
        Err(GemmError::OutOfBounds { operand: "C", needed: 16, len: 15, .. }) => {}
        other => panic!("{other:?}"),
    }
    assert!(c.iter().all(|&x| x == 7.0), "nothing written");
}
