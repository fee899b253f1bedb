//! The GEMM against its f64 reference on every path, and the paths against each other bit for bit.

mod common;

use amp_kernels::gemm::{gemm_with, Compute, Dims, GemmError, GemmPath, MatMut, MatRef, Start};
use amp_kernels::reference;
use amp_kernels::Dtype;
use common::{assert_same, Owned, Rng};
use proptest::prelude::*;

/// A stored operand: its elements and the strides of its logical `(rows x cols)` view.
#[derive(Clone)]
struct Stored {
    data: Owned,
    row_stride: usize,
    col_stride: usize,
    batch_stride: usize,
}

impl Stored {
    /// `batch` matrices of `rows x cols` from `values`, stored row-major or (when `transposed`)
    /// column-major, each line padded by `pad` elements, matrices `gap` elements apart.
    fn new(
        values: &[f32],
        dtype: Dtype,
        (batch, rows, cols): (usize, usize, usize),
        transposed: bool,
        pad: usize,
    ) -> Stored {
        let (lines, len) = if transposed { (cols, rows) } else { (rows, cols) };
        let ld = len + pad;
        let batch_stride = lines * ld + 3;
        let mut flat = vec![f32::NAN; batch * batch_stride];
        for b in 0..batch {
            for i in 0..rows {
                for j in 0..cols {
                    let at = if transposed { j * ld + i } else { i * ld + j };
                    flat[b * batch_stride + at] = values[(b * rows + i) * cols + j];
                }
            }
        }
        let (row_stride, col_stride) = if transposed { (1, ld) } else { (ld, 1) };
        Stored { data: Owned::new(dtype, &flat), row_stride, col_stride, batch_stride }
    }

    fn view(&self) -> MatRef<'_> {
        MatRef {
            data: self.data.view(),
            row_stride: self.row_stride,
            col_stride: self.col_stride,
            batch_stride: self.batch_stride,
        }
    }
}

/// One product to run: shapes, layouts, dtypes.
#[derive(Clone, Copy, Debug)]
struct Case {
    dims: Dims,
    a: (Dtype, bool),
    b: (Dtype, bool),
    out: Dtype,
    compute: Compute,
    accumulate: bool,
}

struct Inputs {
    a: Stored,
    b: Stored,
    c0: Vec<f32>,
}

fn inputs(case: &Case, rng: &mut Rng, lo: i32, hi: i32) -> Inputs {
    let Dims { batch, m, n, k } = case.dims;
    let a = Stored::new(&rng.vec(batch * m * k, lo, hi), case.a.0, (batch, m, k), case.a.1, 1);
    let b = Stored::new(&rng.vec(batch * k * n, lo, hi), case.b.0, (batch, k, n), case.b.1, 0);
    let c0 = rng.vec(batch * m * n, lo, hi);
    Inputs { a, b, c0 }
}

/// C after the product on `path` (row-major, f32 view of the output dtype).
fn run(path: GemmPath, case: &Case, x: &Inputs) -> Vec<f32> {
    let mut c = Owned::new(case.out, &x.c0);
    let Dims { m, n, .. } = case.dims;
    let out = MatMut { data: c.view_mut(), row_stride: n, batch_stride: m * n };
    let start = if case.accumulate { Start::Output } else { Start::Zero };
    gemm_with(path, case.dims, x.a.view(), x.b.view(), out, case.compute, start).unwrap();
    c.to_f32()
}

/// Asserts `got` is within the reference's bound, element by element.
fn assert_within_bound(path: GemmPath, case: &Case, x: &Inputs, got: &[f32]) {
    let want = reference::gemm(case.dims, x.a.view(), x.b.view(), case.compute);
    let c0 = Owned::new(case.out, &x.c0).to_f32();
    for (i, &g) in got.iter().enumerate() {
        let base = if case.accumulate { f64::from(c0[i]) } else { 0.0 };
        let (w, bound) = (want.c[i] + base, want.bound(i, base, case.out));
        // Past the output format's largest finite value (f16: 65504) the result is that sign's infinity.
        let may_overflow = w.abs() + bound > largest(case.out);
        if may_overflow && g.is_infinite() && (g > 0.0) == (w > 0.0) {
            continue;
        }
        assert!(
            (f64::from(g) - w).abs() <= bound,
            "{path} {case:?}: C[{i}] = {g:e}, reference {w:e}, bound {bound:e}"
        );
    }
}

/// The largest finite value of `dtype`.
fn largest(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::F32 => f64::from(f32::MAX),
        Dtype::F16 => f64::from(half::f16::MAX.to_f32()),
        Dtype::Bf16 => f64::from(half::bf16::MAX.to_f32()),
    }
}

fn dtype() -> impl Strategy<Value = Dtype> {
    prop_oneof![Just(Dtype::F32), Just(Dtype::F16), Just(Dtype::Bf16)]
}

fn compute() -> impl Strategy<Value = Compute> {
    prop_oneof![Just(Compute::F32), Just(Compute::F16), Just(Compute::Bf16)]
}

/// Shapes 1..300 in each dimension (edges of every tile and block size), at most ~2.5 M terms so that
/// the f64 reference stays quick; batches of 1 to 3.
fn case() -> impl Strategy<Value = Case> {
    let dims = (1usize..=3, 1usize..300, 1usize..300, 1usize..300)
        .prop_filter("bounded work", |&(b, m, n, k)| b * m * n * k <= 2_500_000)
        .prop_map(|(batch, m, n, k)| Dims { batch, m, n, k });
    (dims, (dtype(), any::<bool>()), (dtype(), any::<bool>()), dtype(), compute(), any::<bool>())
        .prop_map(|(dims, a, b, out, compute, accumulate)| Case { dims, a, b, out, compute, accumulate })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Every path this CPU runs (and the software model of the bf16 path) is within `gamma_k sum|ab|` of
    /// the f64 product of the rounded operands, on random shapes, layouts, dtypes and batch strides.
    #[test]
    fn every_path_is_within_the_f32_accumulation_bound_of_the_f64_reference(case in case(), seed in any::<u64>()) {
        let x = inputs(&case, &mut Rng(seed), -6, 6);
        for path in GemmPath::supported().filter(|p| !p.is_bf16_dot() || case.compute == Compute::Bf16) {
            assert_within_bound(path, &case, &x, &run(path, &case, &x));
        }
    }
}

/// Shapes that cut every tile and block edge of every path, batched and not, all layouts.
fn edge_cases(compute: Compute, out: Dtype, accumulate: bool) -> Vec<Case> {
    let shapes = [
        (1, 1, 1, 1),
        (1, 1, 64, 1),
        (1, 7, 65, 3),
        (2, 6, 64, 2),
        (1, 97, 257, 257),
        (3, 13, 129, 130),
        (1, 16, 300, 64),
        (1, 40, 70, 600),
        // Two blocks of rows for the zmm kernels (288 rows a block), their edge inside a tile.
        (1, 301, 257, 35),
        // More than one AMX k-block (1024 steps, 2048 `k`): C's tiles stored and loaded back between.
        (1, 33, 40, 2100),
        // Few rows whose B the FMA paths read in place (`k` of 32 a row): every tile shape's edge, a
        // `k` tail, a batch.
        (1, 1, 50, 47),
        (1, 5, 70, 200),
        (2, 9, 33, 300),
    ];
    let mut cases = Vec::new();
    for (batch, m, n, k) in shapes {
        for (a_t, b_t) in [(false, false), (false, true), (true, false), (true, true)] {
            let dims = Dims { batch, m, n, k };
            cases.push(Case { dims, a: (Dtype::Bf16, a_t), b: (Dtype::Bf16, b_t), out, compute, accumulate });
        }
    }
    cases
}

/// Values that exercise the instruction's corners: denormals (read as zero), infinities, NaN, products
/// that overflow f32 or land near its smallest normal, signed zeros, ordinary values.
fn special(rng: &mut Rng) -> f32 {
    match rng.next_u64() % 12 {
        0 => f32::from_bits(0x0001_0000) * if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 },
        1 => 2f32.powi(-63) * (1.0 + rng.unit()),
        2 => 2f32.powi(60) * (1.0 + rng.unit()),
        3 if rng.next_u64().is_multiple_of(8) => f32::INFINITY,
        4 if rng.next_u64().is_multiple_of(16) => f32::NAN,
        5 => -0.0,
        _ => rng.spread(-4, 4),
    }
}

#[test]
fn the_avx512_bf16_kernel_is_bit_identical_to_its_software_model() {
    if !GemmPath::Avx512Bf16.is_supported() {
        eprintln!("skipped: this CPU has no avx512_bf16; the model's own tests still run");
        return;
    }
    let mut rng = Rng(7);
    for out in [Dtype::F32, Dtype::Bf16] {
        for accumulate in [false, true] {
            for case in edge_cases(Compute::Bf16, out, accumulate) {
                for special_values in [false, true] {
                    let x = if special_values {
                        inputs_of(&case, &mut rng, special)
                    } else {
                        inputs(&case, &mut rng, -8, 8)
                    };
                    let hw = run(GemmPath::Avx512Bf16, &case, &x);
                    let model = run(GemmPath::Avx512Bf16Model, &case, &x);
                    assert_same(&format!("{case:?} special={special_values}"), &hw, &model);
                }
            }
        }
    }
}

#[test]
fn the_software_models_are_within_the_bound_on_every_edge_shape() {
    let mut rng = Rng(11);
    for model in [GemmPath::Avx512Bf16Model, GemmPath::AmxBf16Model] {
        for case in edge_cases(Compute::Bf16, Dtype::F32, true) {
            let x = inputs(&case, &mut rng, -6, 6);
            assert_within_bound(model, &case, &x, &run(model, &case, &x));
        }
    }
}

/// The AMX kernel cannot be held to a bit-exact model (the hardware's order of summation inside one
/// `tdpbf16ps` is not the documented one; see `amp_kernels::gemm::tdpbf16_pair`). It is held to the
/// bound on every edge shape, and on special values to the model's classes: NaN where the model gives
/// NaN, the same infinity where it gives one (no input here is large enough for sums to overflow in one
/// order and not the other). How often the two agree bit for bit is printed.
#[test]
fn the_amx_kernel_is_within_the_bound_and_has_its_models_nan_and_infinities() {
    if !GemmPath::AmxBf16.is_supported() {
        eprintln!("skipped: no AMX here (or the OS refused tile data); the AMX model's tests still run");
        return;
    }
    let mut rng = Rng(17);
    let (mut same_bits, mut elements) = (0usize, 0usize);
    for out in [Dtype::F32, Dtype::Bf16] {
        for accumulate in [false, true] {
            for case in edge_cases(Compute::Bf16, out, accumulate) {
                let x = inputs(&case, &mut rng, -8, 8);
                let hw = run(GemmPath::AmxBf16, &case, &x);
                assert_within_bound(GemmPath::AmxBf16, &case, &x, &hw);
                let model = run(GemmPath::AmxBf16Model, &case, &x);
                same_bits += hw.iter().zip(&model).filter(|(h, m)| h.to_bits() == m.to_bits()).count();
                elements += hw.len();

                let x = inputs_of(&case, &mut rng, special_but_small);
                let (hw, model) = (run(GemmPath::AmxBf16, &case, &x), run(GemmPath::AmxBf16Model, &case, &x));
                for (i, (h, m)) in hw.iter().zip(&model).enumerate() {
                    let class = |v: f32| {
                        if v.is_nan() {
                            0
                        } else if v.is_infinite() {
                            v.signum() as i32
                        } else {
                            2
                        }
                    };
                    assert_eq!(class(*h), class(*m), "{case:?}: C[{i}] = {h:e} on AMX, {m:e} in the model");
                }
            }
        }
    }
    eprintln!(
        "AMX and the pseudo-code model agree bit for bit on {same_bits} of {elements} elements ({:.1}%)",
        100.0 * same_bits as f64 / elements as f64
    );
}

/// Bf16 operands and a C drawn value by value from `value`.
fn inputs_of(case: &Case, rng: &mut Rng, value: fn(&mut Rng) -> f32) -> Inputs {
    let Dims { batch, m, n, k } = case.dims;
    let mut values = |len| (0..len).map(|_| value(rng)).collect::<Vec<_>>();
    let a = Stored::new(&values(batch * m * k), Dtype::Bf16, (batch, m, k), case.a.1, 1);
    let b = Stored::new(&values(batch * k * n), Dtype::Bf16, (batch, k, n), case.b.1, 0);
    Inputs { a, b, c0: values(batch * m * n) }
}

/// [`special`] without the huge values: infinities, NaN, denormals (read as zero), signed zeros and
/// ordinary values, so that no finite sum can overflow.
fn special_but_small(rng: &mut Rng) -> f32 {
    match special(rng) {
        x if x.is_finite() && x.abs() > 1e6 => rng.spread(-4, 4),
        x => x,
    }
}

#[test]
fn simd_f32_paths_are_bit_identical_to_the_portable_path() {
    let mut rng = Rng(3);
    for compute in [Compute::F32, Compute::F16, Compute::Bf16] {
        for mut case in edge_cases(compute, Dtype::F32, true) {
            case.a.0 = Dtype::F32;
            let x = inputs(&case, &mut rng, -10, 10);
            let portable = run(GemmPath::Portable, &case, &x);
            for path in GemmPath::supported().filter(|p| !p.is_bf16_dot() && *p != GemmPath::Portable) {
                assert_same(&format!("{path} {case:?}"), &run(path, &case, &x), &portable);
            }
        }
    }
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let case = Case {
        dims: Dims { batch: 2, m: 200, n: 300, k: 700 },
        a: (Dtype::Bf16, false),
        b: (Dtype::Bf16, true),
        out: Dtype::F32,
        compute: Compute::Bf16,
        accumulate: false,
    };
    let x = inputs(&case, &mut Rng(5), -4, 4);
    let pool = |threads| rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    for path in GemmPath::supported() {
        let one = pool(1).install(|| run(path, &case, &x));
        let three = pool(3).install(|| run(path, &case, &x));
        assert_same(&format!("{path}"), &one, &three);
    }
}

#[test]
fn half_output_is_the_f32_result_rounded_once() {
    let mut rng = Rng(9);
    for out in [Dtype::F16, Dtype::Bf16] {
        for accumulate in [false, true] {
            for mut case in edge_cases(Compute::Bf16, out, accumulate) {
                let x = inputs(&case, &mut rng, -4, 4);
                for path in GemmPath::supported() {
                    let half = run(path, &case, &x);
                    // The same product into f32, from C widened, then rounded: the same bits.
                    case.out = Dtype::F32;
                    let wide_inputs =
                        Inputs { a: x.a.clone(), b: x.b.clone(), c0: Owned::new(out, &x.c0).to_f32() };
                    let full = run(path, &case, &wide_inputs);
                    case.out = out;
                    assert_same(&format!("{path} {case:?}"), &half, &Owned::new(out, &full).to_f32());
                }
            }
        }
    }
}

#[test]
fn a_bias_row_into_half_output_is_the_f32_result_rounded_once() {
    let mut rng = Rng(21);
    for out in [Dtype::F16, Dtype::Bf16] {
        for case in edge_cases(Compute::Bf16, out, false) {
            let x = inputs(&case, &mut rng, -4, 4);
            let Dims { batch, m, n, .. } = case.dims;
            let bias = rng.vec(n, -2, 2);
            for path in GemmPath::supported() {
                let product = |dtype: Dtype| {
                    let mut c = Owned::new(dtype, &vec![f32::NAN; batch * m * n]);
                    let view = MatMut { data: c.view_mut(), row_stride: n, batch_stride: m * n };
                    let (a, b) = (x.a.view(), x.b.view());
                    gemm_with(path, case.dims, a, b, view, case.compute, Start::Bias(&bias)).unwrap();
                    c.to_f32()
                };
                let rounded = Owned::new(out, &product(Dtype::F32)).to_f32();
                assert_same(&format!("{path} {case:?}"), &product(out), &rounded);
            }
        }
    }
}

#[test]
fn k_zero_writes_zeros_or_leaves_c_when_accumulating() {
    for path in GemmPath::supported() {
        for accumulate in [false, true] {
            let (a, b) = (vec![0.0f32; 0], vec![0.0f32; 0]);
            let mut c = vec![5.0f32; 6];
            let dims = Dims::new(2, 3, 0);
            let out = MatMut::row_major(&mut c[..], 3);
            gemm_with(
                path,
                dims,
                MatRef::row_major(&a[..], 0),
                MatRef::row_major(&b[..], 3),
                out,
                Compute::Bf16,
                if accumulate { Start::Output } else { Start::Zero },
            )
            .unwrap();
            assert_eq!(c, [if accumulate { 5.0 } else { 0.0 }; 6], "{path} accumulate={accumulate}");
            let mut c = vec![5.0f32; 6];
            let out = MatMut::row_major(&mut c[..], 3);
            let (a, b) = (MatRef::row_major(&a[..], 0), MatRef::row_major(&b[..], 3));
            gemm_with(path, dims, a, b, out, Compute::Bf16, Start::Bias(&[1.0, 2.0, 3.0])).unwrap();
            assert_eq!(c, [1.0, 2.0, 3.0, 1.0, 2.0, 3.0], "{path}: k = 0 leaves the bias");
        }
    }
}

#[test]
fn k_zero_into_half_output_writes_the_start_rounded() {
    let (a, b) = (vec![0.0f32; 0], vec![0.0f32; 0]);
    let dims = Dims::new(2, 3, 0);
    for path in GemmPath::supported() {
        for out in [Dtype::F16, Dtype::Bf16] {
            for (start, want) in [
                (Start::Zero, [0.0; 3]),
                (Start::Output, [5.0; 3]),
                (Start::Bias(&[1.0, 2.0, 1.0e-3]), [1.0, 2.0, 1.0e-3]),
            ] {
                let mut c = Owned::new(out, &[5.0; 6]);
                let view = MatMut { data: c.view_mut(), row_stride: 3, batch_stride: 6 };
                let (a, b) = (MatRef::row_major(&a[..], 0), MatRef::row_major(&b[..], 3));
                gemm_with(path, dims, a, b, view, Compute::Bf16, start).unwrap();
                let want = Owned::new(out, &[want, want].concat()).to_f32();
                assert_same(&format!("{path} {out:?} {start:?}"), &c.to_f32(), &want);
            }
        }
    }
}

#[test]
fn bad_views_are_refused_and_nothing_is_written() {
    let (a, b) = (vec![1.0f32; 6], vec![1.0f32; 6]);
    let mut c = vec![7.0f32; 4];
    let path = GemmPath::Portable;
    // A is 2 x 3 but declared with row stride 4: element (1, 2) is index 6, past the end.
    let bad_a = MatRef { data: a[..].into(), row_stride: 4, col_stride: 1, batch_stride: 0 };
    let err = gemm_with(
        path,
        Dims::new(2, 2, 3),
        bad_a,
        MatRef::row_major(&b[..], 2),
        MatMut::row_major(&mut c[..], 2),
        Compute::F32,
        Start::Zero,
    )
    .unwrap_err();
    assert!(matches!(err, GemmError::OutOfBounds { operand: "A", needed: 7, len: 6, .. }), "{err}");
    assert!(err.to_string().contains("check its strides"), "{err}");
    // C rows overlapping: row stride 1 for 2 columns.
    let overlap = MatMut { data: (&mut c[..]).into(), row_stride: 1, batch_stride: 0 };
    let err = gemm_with(
        path,
        Dims::new(2, 2, 3),
        MatRef::row_major(&a[..], 3),
        MatRef::row_major(&b[..], 2),
        overlap,
        Compute::F32,
        Start::Zero,
    )
    .unwrap_err();
    assert!(matches!(err, GemmError::OverlappingOutput { .. }), "{err}");
    // A stride product that overflows usize is refused, not wrapped.
    let huge = MatRef { data: a[..].into(), row_stride: usize::MAX / 2, col_stride: 1, batch_stride: 0 };
    let err = gemm_with(
        path,
        Dims::new(3, 2, 3),
        huge,
        MatRef::row_major(&b[..], 2),
        MatMut::row_major(&mut c[..], 2),
        Compute::F32,
        Start::Zero,
    );
    assert!(matches!(err, Err(GemmError::OutOfBounds { needed: usize::MAX, .. })), "{err:?}");
    // Operands that repeat one element through zero strides pass the bounds check at any k; a k this
    // large once wrapped the packed lengths to nothing (in a release build) and the kernel read past
    // them. Refused before anything is packed.
    let one = [1.0f32; 1];
    let repeat = MatRef { data: one[..].into(), row_stride: 0, col_stride: 0, batch_stride: 0 };
    let mut c6 = [7.0f32; 6];
    for k in [1usize << 63, usize::MAX, (isize::MAX as usize) / 4] {
        let err = gemm_with(
            path,
            Dims::new(6, 1, k),
            repeat,
            repeat,
            MatMut::row_major(&mut c6[..], 1),
            Compute::F32,
            Start::Zero,
        )
        .unwrap_err();
        assert!(matches!(err, GemmError::TooLarge { m: 6, n: 1, .. }), "{err}");
        assert!(err.to_string().contains("split it along k"), "{err}");
    }
    assert_eq!(c6, [7.0; 6]);
    assert_eq!(c, [7.0; 4]);
}

#[test]
fn forcing_a_path_the_cpu_lacks_names_the_missing_features() {
    for path in GemmPath::ALL.into_iter().filter(|p| !p.is_supported()) {
        let (a, b) = ([1.0f32; 1], [1.0f32; 1]);
        let mut c = [0.0f32; 1];
        let err = gemm_with(
            path,
            Dims::new(1, 1, 1),
            MatRef::row_major(&a[..], 1),
            MatRef::row_major(&b[..], 1),
            MatMut::row_major(&mut c[..], 1),
            Compute::Bf16,
            Start::Zero,
        )
        .unwrap_err();
        assert!(err.to_string().contains("this CPU lacks"), "{err}");
    }
}

/// C for `case` on `path` from `start`: `Start::Output` from `x.c0`, a bias from `bias`.
fn run_from(path: GemmPath, case: &Case, x: &Inputs, bias: Option<&[f32]>) -> Vec<f32> {
    let mut c = Owned::new(case.out, &x.c0);
    let Dims { m, n, .. } = case.dims;
    let out = MatMut { data: c.view_mut(), row_stride: n, batch_stride: m * n };
    let start = match (bias, case.accumulate) {
        (Some(bias), _) => Start::Bias(bias),
        (None, true) => Start::Output,
        (None, false) => Start::Zero,
    };
    gemm_with(path, case.dims, x.a.view(), x.b.view(), out, case.compute, start).unwrap();
    c.to_f32()
}

/// `in_place` and `packed` (the same values with one operand stored the other way) from one `seed`,
/// lines padded with NaN as `pads` says (A's, B's: a read past `k` would show), run on `path` from zero
/// or C as their case says and from a bias row: the same bits each time, and from zero or C within the
/// bound.
fn assert_layouts_agree(path: GemmPath, (in_place, packed): (&Case, &Case), seed: u64, pads: (usize, usize)) {
    let stored = |case: &Case| {
        let (mut rng, Dims { batch, m, n, k }) = (Rng(seed), case.dims);
        let a = Stored::new(&rng.vec(batch * m * k, -6, 6), case.a.0, (batch, m, k), case.a.1, pads.0);
        let b = Stored::new(&rng.vec(batch * k * n, -6, 6), case.b.0, (batch, k, n), case.b.1, pads.1);
        Inputs { a, b, c0: rng.vec(batch * m * n, -6, 6) }
    };
    let (x, y) = (stored(in_place), stored(packed));
    let bias = Rng(seed ^ 1).vec(in_place.dims.n, -2, 2);
    for bias in [None, Some(&bias[..])] {
        let got = run_from(path, in_place, &x, bias);
        let what = format!("{path} {in_place:?} bias {}", bias.is_some());
        assert_same(&what, &got, &run_from(path, packed, &y, bias));
        if bias.is_none() {
            assert_within_bound(path, in_place, &x, &got);
        }
    }
}

/// On AMX a product whose A is bf16 with `k` contiguous and whose tiles are all whole (`m` and `n`
/// multiples of 32, `k` of 32) reads A's rows where they lie; the same values with A stored the other
/// way take the packed path. The two give the same bits, on the model and on the hardware, for every
/// start and output type, batched or not, and are within the bound. A's rows are padded with NaN (a
/// read past `k` would show); shapes with a partial tile take the packed path either way.
#[test]
fn amx_products_reading_a_in_place_match_the_packed_path_bit_for_bit() {
    let paths = [GemmPath::AmxBf16Model, GemmPath::AmxBf16].into_iter().filter(|p| p.is_supported());
    let shapes = [(1, 96, 32, 32), (2, 128, 64, 96), (1, 160, 96, 256), (2, 96, 40, 64), (1, 100, 64, 64)];
    let mut rng = Rng(31);
    for path in paths {
        for (batch, m, n, k) in shapes {
            for (out, accumulate) in
                [(Dtype::F32, false), (Dtype::Bf16, true), (Dtype::F16, false), (Dtype::F32, true)]
            {
                let dims = Dims { batch, m, n, k };
                let in_place = Case {
                    dims,
                    a: (Dtype::Bf16, false),
                    b: (Dtype::Bf16, false),
                    out,
                    compute: Compute::Bf16,
                    accumulate,
                };
                let packed = Case { a: (Dtype::Bf16, true), ..in_place };
                // A's rows padded with NaN (B's lines as they are).
                assert_layouts_agree(path, (&in_place, &packed), rng.next_u64(), (3, 0));
            }
        }
    }
}

/// On AMX a product of at most 64 rows whose B is bf16 with `k` contiguous (a Linear's weight) reads B
/// where it lies, its tiles computing `C^T`; the same values with B stored the other way take the
/// packed path. The two give the same bits, on the model and on the hardware, for every start and
/// output type, and are within the bound.
#[test]
fn skinny_amx_products_reading_the_weight_in_place_match_the_packed_path_bit_for_bit() {
    let paths = [GemmPath::AmxBf16Model, GemmPath::AmxBf16].into_iter().filter(|p| p.is_supported());
    // Whole blocks of 32 columns and tile products of `k`, batched or not; a last block moved back to
    // end at `n` (columns summed twice, written once); a last `k % 32` through its zero-padded tile;
    // and k or n below 32, which take the packed path.
    let shapes = [
        (1, 1, 32, 32),
        (1, 16, 40, 64),
        (2, 9, 64, 96),
        (2, 33, 70, 100),
        (1, 64, 33, 1100),
        (1, 7, 96, 2112),
        (1, 3, 40, 31),
        (1, 5, 31, 64),
    ];
    let mut rng = Rng(29);
    for path in paths {
        for (batch, m, n, k) in shapes {
            for (out, accumulate, a_dtype, a_t) in [
                (Dtype::F32, false, Dtype::Bf16, false),
                (Dtype::Bf16, true, Dtype::F32, true),
                (Dtype::F16, false, Dtype::F32, false),
                (Dtype::F32, true, Dtype::Bf16, true),
            ] {
                let dims = Dims { batch, m, n, k };
                let in_place = Case {
                    dims,
                    a: (a_dtype, a_t),
                    b: (Dtype::Bf16, true),
                    out,
                    compute: Compute::Bf16,
                    accumulate,
                };
                let packed = Case { b: (Dtype::Bf16, false), ..in_place };
                // B's lines padded with NaN.
                assert_layouts_agree(path, (&in_place, &packed), rng.next_u64(), (1, 3));
            }
        }
    }
}

#[test]
fn a_bias_row_starts_every_row_and_is_rounded_with_the_sum_once() {
    let mut rng = Rng(13);
    for out in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
        for mut case in edge_cases(Compute::Bf16, out, false) {
            case.a.0 = Dtype::F32;
            let x = inputs(&case, &mut rng, -4, 4);
            let Dims { batch, m, n, .. } = case.dims;
            let bias = rng.vec(n, -2, 2);
            let want = reference::gemm(case.dims, x.a.view(), x.b.view(), case.compute);
            for path in GemmPath::supported() {
                let mut c = Owned::new(out, &vec![f32::NAN; batch * m * n]);
                let view = MatMut { data: c.view_mut(), row_stride: n, batch_stride: m * n };
                gemm_with(path, case.dims, x.a.view(), x.b.view(), view, case.compute, Start::Bias(&bias))
                    .unwrap();
                for (i, g) in c.to_f32().into_iter().enumerate() {
                    let b = f64::from(bias[i % n]);
                    let (w, bound) = (want.c[i] + b, want.bound(i, b, out));
                    assert!(
                        (f64::from(g) - w).abs() <= bound,
                        "{path} {case:?}: C[{i}] = {g:e}, want {w:e} +- {bound:e}"
                    );
                }
            }
        }
    }
    let (a, b) = ([1.0f32; 4], [1.0f32; 4]);
    let mut c = [0.0f32; 4];
    let short = [0.0f32; 1];
    let err = gemm_with(
        GemmPath::Portable,
        Dims::new(2, 2, 2),
        MatRef::row_major(&a[..], 2),
        MatRef::row_major(&b[..], 2),
        MatMut::row_major(&mut c[..], 2),
        Compute::F32,
        Start::Bias(&short),
    )
    .unwrap_err();
    assert_eq!(err, GemmError::BiasLength { len: 1, n: 2 });
}

/// `gemm_new` allocates C and writes every element once: the same bits as `gemm_with` into a C it
/// does not read (NaN-filled here), on every path, output type, layout and edge shape, with and
/// without a bias row.
#[test]
fn a_new_c_holds_what_gemm_with_writes() {
    use amp_kernels::gemm::{gemm_new, NewOutput, OutputType};
    let mut rng = Rng(29);
    for (out, out_type) in
        [(Dtype::F32, OutputType::F32), (Dtype::Bf16, OutputType::Bf16), (Dtype::F16, OutputType::F16)]
    {
        for compute in [Compute::F32, Compute::Bf16, Compute::F16] {
            for case in edge_cases(compute, out, false) {
                let x = inputs(&case, &mut rng, -4, 4);
                let Dims { batch, m, n, .. } = case.dims;
                let bias = rng.vec(n, -2, 2);
                for path in GemmPath::supported().filter(|p| !p.is_bf16_dot() || compute == Compute::Bf16) {
                    for with_bias in [false, true] {
                        let mut c = Owned::new(out, &vec![f32::NAN; batch * m * n]);
                        let view = MatMut { data: c.view_mut(), row_stride: n, batch_stride: m * n };
                        let start = if with_bias { Start::Bias(&bias) } else { Start::Zero };
                        gemm_with(path, case.dims, x.a.view(), x.b.view(), view, compute, start).unwrap();
                        let bias = with_bias.then_some(&bias[..]);
                        let fresh =
                            gemm_new(path, case.dims, x.a.view(), x.b.view(), out_type, compute, bias)
                                .unwrap();
                        let fresh: Vec<f32> = match fresh {
                            NewOutput::F32(v) => v,
                            NewOutput::F16(v) => v.iter().map(|h| h.to_f32()).collect(),
                            NewOutput::Bf16(v) => v.iter().map(|h| h.to_f32()).collect(),
                        };
                        assert_same(&format!("{path} {case:?} bias {with_bias}"), &fresh, &c.to_f32());
                    }
                }
            }
        }
    }
}

/// `gemm_new_streamed` writes what `gemm_new` writes, bit for bit, on every path, layout and edge
/// shape (several blocks, blocks cut by C's edge, more than one AMX k-block, rows off a cache line),
/// with and without a bias, and says whether C is all finite: checked against C itself, with operands
/// that hold infinities and NaNs, that overflow, or neither.
#[test]
fn a_streamed_c_holds_what_gemm_new_writes_and_knows_whether_it_is_finite() {
    use amp_kernels::gemm::{gemm_new, gemm_new_streamed, NewOutput, OutputType};
    let mut rng = Rng(31);
    let mut shapes: Vec<Case> = edge_cases(Compute::F32, Dtype::F32, false);
    // Blocks of C on the AMX kernel (128 x 256) and the zmm kernel, and a row stride off a line.
    for (m, n, k) in [(300, 530, 40), (257, 1030, 70)] {
        let dims = Dims { batch: 1, m, n, k };
        shapes.push(Case { dims, a: (Dtype::Bf16, false), b: (Dtype::Bf16, true), ..shapes[0] });
    }
    for compute in [Compute::F32, Compute::Bf16, Compute::F16] {
        for case in &shapes {
            let case = Case { compute, ..*case };
            let ordinary: fn(&mut Rng) -> f32 = |r| r.spread(-4, 4);
            for (what, value) in [("ordinary", ordinary), ("special", special), ("small", special_but_small)]
            {
                let x = inputs_of(&case, &mut rng, value);
                let n = case.dims.n;
                let bias = rng.vec(n, -2, 2);
                for path in GemmPath::supported().filter(|p| !p.is_bf16_dot() || compute == Compute::Bf16) {
                    for bias in [None, Some(&bias[..])] {
                        let (a, b) = (x.a.view(), x.b.view());
                        let NewOutput::F32(want) =
                            gemm_new(path, case.dims, a, b, OutputType::F32, compute, bias).unwrap()
                        else {
                            unreachable!("an f32 C")
                        };
                        let (got, finite) = gemm_new_streamed(path, case.dims, a, b, compute, bias).unwrap();
                        let name = format!("{path} {case:?} {what} bias {}", bias.is_some());
                        assert_same(&name, &got, &want);
                        assert_eq!(finite, want.iter().all(|x| x.is_finite()), "{name}: finite");
                    }
                }
            }
        }
    }
}
