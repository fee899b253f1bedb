//! Every version of the crate's `widest_vectors!` loops (packing, column sums, softmax, GELU, ReLU,
//! layer norm) computes
//! the same bits: each kernel runs with the loops capped at the baseline, at AVX2 and uncapped, and the
//! results are compared bit for bit. On a CPU without AVX2 or AVX-512 the capped runs pick the same
//! version as the uncapped one, and the test says so.
//!
//! One test function: the cap is process-wide, so nothing else may run in this binary meanwhile.

use amp_kernels::gemm::{gemm_with, Compute, Dims, GemmPath, MatMut, MatRef, Start};
use amp_kernels::softmax::{self, Mask};
use amp_kernels::{
    channel_affine, gelu, layer_norm, reduce, relu, rms_norm, rope, vectorise, GradSlice, GradSliceMut, Isa,
};
use half::{bf16, f16};

fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| (((i * 7919 + seed * 104_729) % 4001) as f32 / 500.0 - 4.0) * 1.37).collect()
}

/// Every kernel's outputs, as bits.
fn outputs() -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    // GEMM on the portable micro-kernels, so that only the packing differs between versions: f32 and
    // half sources, row-major and transposed operands, f32 panels for each compute precision (rounded
    // or widened in registers where AVX2 is allowed), bf16 pairs (`vdpbf16ps` model) and AMX groups.
    // More than 64 rows: every path packs both operands (on AMX fewer rows may read B in place).
    let (m, n, k) = (69, 70, 45);
    let (a32, b32) = (values(m * k, 1), values(k * n, 2));
    let a16: Vec<f16> = a32.iter().map(|&v| f16::from_f32(v)).collect();
    let bb16: Vec<bf16> = b32.iter().map(|&v| bf16::from_f32(v)).collect();
    let operands: [(MatRef<'_>, MatRef<'_>); 3] = [
        (MatRef::row_major(&a32[..], k), MatRef::row_major(&b32[..], n)),
        (MatRef::transposed(&a16[..], m), MatRef::transposed(&bb16[..], k)),
        (MatRef::row_major(&a16[..], k), MatRef::transposed(&b32[..], k)),
    ];
    for (a, b) in operands {
        for (path, compute) in [
            (GemmPath::Portable, Compute::F32),
            (GemmPath::Portable, Compute::Bf16),
            (GemmPath::Portable, Compute::F16),
            (GemmPath::Avx512Model, Compute::F32),
            (GemmPath::Avx512Model, Compute::F16),
            (GemmPath::Avx512Bf16Model, Compute::Bf16),
            (GemmPath::AmxBf16Model, Compute::Bf16),
        ] {
            let mut c = vec![0f32; m * n];
            gemm_with(path, Dims::new(m, n, k), a, b, MatMut::row_major(&mut c[..], n), compute, Start::Zero)
                .expect("a valid product");
            out.push(c.iter().map(|v| v.to_bits()).collect());
        }
    }
    // Column sums of f32 and bf16 matrices.
    let (rows, cols) = (53, 301);
    let x = values(rows * cols, 3);
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    for src in [GradSlice::F32(&x), GradSlice::Bf16(&xb)] {
        let mut sums = vec![0f32; cols];
        reduce::column_sums(src, rows, cols, &mut sums);
        out.push(sums.iter().map(|v| v.to_bits()).collect());
    }
    // Softmax, causal and scaled, forward and backward.
    let dy = values(rows * cols, 4);
    let (mut y, mut dx) = (vec![0f32; rows * cols], vec![0f32; rows * cols]);
    softmax::forward(&x, cols, 0.3, Mask::Causal { rows_per_matrix: 17 }, &mut y);
    softmax::backward(&y, &dy, cols, 0.3, &mut dx);
    out.push(y.iter().chain(&dx).map(|v| v.to_bits()).collect());
    // GELU, f32 and bf16 with an f16 gradient.
    let dyh: Vec<f16> = dy.iter().map(|&v| f16::from_f32(v)).collect();
    let (mut g, mut dg) = (vec![0f32; x.len()], vec![0f32; x.len()]);
    gelu::forward(GradSlice::F32(&x), GradSliceMut::F32(&mut g));
    gelu::backward(GradSlice::F32(&x), GradSlice::F32(&dy), GradSliceMut::F32(&mut dg));
    let (mut gb, mut dgb) = (vec![bf16::ZERO; x.len()], vec![bf16::ZERO; x.len()]);
    gelu::forward(GradSlice::Bf16(&xb), GradSliceMut::Bf16(&mut gb));
    gelu::backward(GradSlice::Bf16(&xb), GradSlice::F16(&dyh), GradSliceMut::Bf16(&mut dgb));
    out.push(g.iter().chain(&dg).map(|v| v.to_bits()).collect());
    out.push(gb.iter().chain(&dgb).map(|v| u32::from(v.to_bits())).collect());
    // ReLU (f32 into a new buffer, bf16 in place) and its masked gradient, bf16's with an f16 one.
    let (mut r, mut dr) = (vec![0f32; x.len()], vec![0f32; x.len()]);
    relu::forward(GradSlice::F32(&x), GradSliceMut::F32(&mut r));
    relu::backward(GradSlice::F32(&r), GradSlice::F32(&dy), GradSliceMut::F32(&mut dr));
    let (mut rb, mut drh) = (xb.clone(), vec![f16::ZERO; x.len()]);
    relu::forward_in_place(GradSliceMut::Bf16(&mut rb));
    relu::backward(GradSlice::Bf16(&rb), GradSlice::F16(&dyh), GradSliceMut::F16(&mut drh));
    out.push(r.iter().chain(&dr).map(|v| v.to_bits()).collect());
    out.push(rb.iter().map(|v| v.to_bits()).chain(drh.iter().map(|v| v.to_bits())).map(u32::from).collect());
    // Layer norm, forward with and without a bias and backward, rows of 301 (not a multiple of a lane).
    let (w, b) = (values(cols, 5), values(cols, 6));
    let (mut ln, mut ln_free) = (vec![0f32; x.len()], vec![0f32; x.len()]);
    layer_norm::forward(GradSlice::F32(&x), cols, &w, Some(&b), 1e-5, &mut ln);
    layer_norm::forward(GradSlice::Bf16(&xb), cols, &w, None, 1e-5, &mut ln_free);
    let (mut dln, mut dw, mut db) = (vec![0f32; x.len()], vec![0f32; cols], vec![0f32; cols]);
    layer_norm::backward(GradSlice::F32(&x), GradSlice::F32(&dy), cols, &w, 1e-5, &mut dln, &mut dw, &mut db);
    out.push([&ln, &ln_free, &dln, &dw, &db].into_iter().flatten().map(|v| v.to_bits()).collect());
    // RMS norm, forward and backward (the layer norm's passes without a mean).
    let rms = rms_norm::forward_new(GradSlice::Bf16(&xb), cols, &w, 1e-5);
    let (mut drms, mut drw) = (vec![0f32; x.len()], vec![0f32; cols]);
    rms_norm::backward(GradSlice::F32(&x), GradSlice::F32(&dy), cols, &w, 1e-5, &mut drms, &mut drw);
    out.push([&rms, &drms, &drw].into_iter().flatten().map(|v| v.to_bits()).collect());
    // A per-channel affine over the rows as channels of 301 values (not a multiple of a lane).
    let planes = channel_affine::Planes { channels: 7, inner: cols };
    let (cw, cb) = (values(7, 7), values(7, 8));
    let affine = channel_affine::forward_new(&x[..7 * cols], planes, &cw, &cb);
    let (mut dca, mut dcw, mut dcb) = (vec![0f32; 7 * cols], vec![0f32; 7], vec![0f32; 7]);
    channel_affine::backward(&x[..7 * cols], &dy[..7 * cols], planes, &cw, &mut dca, &mut dcw, &mut dcb);
    out.push([&affine, &dca, &dcw, &dcb].into_iter().flatten().map(|v| v.to_bits()).collect());
    // Rotary embeddings, both pairings and directions, rows of 300 values (one short of the 301 columns).
    let (angles_cos, angles_sin) = (values(150 * 53, 9), values(150 * 53, 10));
    for pairing in [rope::Pairing::Halves, rope::Pairing::Adjacent] {
        let r = rope::Rope {
            pairing,
            order: rope::RowOrder::HeadsThenPositions,
            heads: 1,
            positions: 53,
            d: 300,
            cos: &angles_cos,
            sin: &angles_sin,
            per_sequence: false,
        };
        for direction in [rope::Direction::Forward, rope::Direction::Inverse] {
            let mut rotated = vec![0f32; 53 * 300];
            r.rotate(direction, GradSlice::F32(&x[..53 * 300]), 0, GradSliceMut::F32(&mut rotated));
            out.push(rotated.iter().map(|v| v.to_bits()).collect());
        }
    }
    out
}

#[test]
fn every_vector_width_computes_the_same_bits() {
    let widest = outputs();
    for cap in [Isa::Avx2, Isa::Portable] {
        if !cap.is_supported() || (cap == Isa::Avx2 && !Isa::Avx512.is_supported()) {
            println!("{cap:?} cap: this CPU runs no wider version than it; skipped");
            continue;
        }
        assert_eq!(vectorise::limit_width(Some(cap)), None, "no cap was set before");
        assert!(!vectorise::allows(Isa::Avx512) && vectorise::allows(cap));
        let capped = outputs();
        assert_eq!(vectorise::limit_width(None), Some(cap));
        for (i, (a, b)) in widest.iter().zip(&capped).enumerate() {
            assert!(a == b, "output {i}: the {cap:?} version differs from the widest");
        }
    }
}
