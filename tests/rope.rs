//! `amp::ops::rope`, `rope_i` and `rope_thd`: rotary position embeddings with a backward, against f64
//! references (candle-nn's differentiable `rope_slow` and `rope_i_slow` run in f64), in f32, f16 and
//! bf16, with angle tables shared by the batch and per sequence; and a query projection that trains
//! through them where candle-nn's kernels leave it without a gradient.
//!
//! Tolerances (normwise relative, `common::tolerance`): the rotation is computed in f32 on the half
//! input's exact values and rounded once to the input's dtype (1 rounding, safety 2); its gradient is
//! the inverse rotation of the output's gradient, rounded once (the upstream gradient in the half
//! output's dtype is a second rounding: 2 roundings, safety 2).

mod common;

use amp::ops;
use candle_core::{DType, Device, Result, Tensor};
use candle_nn::rotary_emb;

/// Angle tables `p * 10000^(-2i/d)`, `(rows, d / 2)`, f32.
fn tables(rows: usize, d: usize) -> Result<(Tensor, Tensor)> {
    let half = d / 2;
    let angles: Vec<f32> = (0..rows * half)
        .map(|k| ((k / half) as f64 * 10_000f64.powf(-2.0 * (k % half) as f64 / d as f64)) as f32)
        .collect();
    let angles = Tensor::from_vec(angles, (rows, half), &Device::Cpu)?;
    Ok((angles.cos()?, angles.sin()?))
}

/// The variants, each with its f64 reference: candle-nn's slow (differentiable) rotations, per
/// sequence where the tables are, transposed for the `(batch, positions, heads, d)` layout.
type Rotation = fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>;

fn per_sequence(x: &Tensor, cos: &Tensor, sin: &Tensor, f: Rotation) -> Result<Tensor> {
    if cos.rank() == 2 {
        return f(x, cos, sin);
    }
    let sequences = (0..x.dim(0)?)
        .map(|b| f(&x.narrow(0, b, 1)?, &cos.get(b)?, &sin.get(b)?))
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&sequences, 0)
}

fn reference_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    per_sequence(x, cos, sin, rotary_emb::rope_slow)
}

fn reference_rope_i(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    per_sequence(x, cos, sin, rotary_emb::rope_i_slow)
}

fn reference_thd(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let heads_first = x.transpose(1, 2)?.contiguous()?;
    per_sequence(&heads_first, cos, sin, rotary_emb::rope_slow)?.transpose(1, 2)?.contiguous()
}

#[test]
fn every_variant_matches_f64_in_every_dtype_with_shared_and_per_sequence_tables() -> Result<()> {
    let (batch, heads, positions, d) = (2, 3, 6, 16);
    let (cos, sin) = tables(positions + 2, d)?;
    // Per sequence: sequence b's positions start at b (as in a batch of continued sequences), with
    // more rows than positions.
    let (cos3, sin3) = (
        Tensor::stack(&[cos.narrow(0, 0, positions + 1)?, cos.narrow(0, 1, positions + 1)?], 0)?,
        Tensor::stack(&[sin.narrow(0, 0, positions + 1)?, sin.narrow(0, 1, positions + 1)?], 0)?,
    );
    let variants: [(&str, Rotation, Rotation, [usize; 4]); 3] = [
        ("rope", ops::rope, reference_rope, [batch, heads, positions, d]),
        ("rope_i", ops::rope_i, reference_rope_i, [batch, heads, positions, d]),
        ("rope_thd", ops::rope_thd, reference_thd, [batch, positions, heads, d]),
    ];
    for (name, ours, reference, dims) in variants {
        for (tables, (c, s)) in [("shared", (&cos, &sin)), ("per sequence", (&cos3, &sin3))] {
            let (c64, s64) = (c.to_dtype(DType::F64)?, s.to_dtype(DType::F64)?);
            // The reference reads exactly the first `positions` rows of each table.
            let (c64, s64) = match c64.rank() {
                2 => (c64.narrow(0, 0, positions)?, s64.narrow(0, 0, positions)?),
                _ => (c64.narrow(1, 0, positions)?, s64.narrow(1, 0, positions)?),
            };
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let x = common::randn_in(7, &dims, 2.0, DType::F32)?.to_dtype(dtype)?;
                let (y, dx) = common::value_and_grad(|x| ours(x, c, s), &x)?;
                let x64 = x.to_dtype(DType::F64)?;
                let (y_ref, dx_ref) = common::value_and_grad(|x| reference(x, &c64, &s64), &x64)?;
                assert_eq!((y.dtype(), dx.dtype()), (dtype, dtype));
                let what = format!("{name} {tables} {dtype:?}");
                let tolerance = |roundings| common::tolerance(dtype, roundings, 2.0);
                common::assert_close(&format!("{what} forward"), &y, &y_ref, tolerance(1))?;
                common::assert_close(&format!("{what} grad x"), &dx, &dx_ref, tolerance(2))?;
            }
        }
    }
    Ok(())
}

/// In bf16 candle-nn's kernel rounds both products and their sum to bf16; amp rounds once. Both read
/// the same bf16 tables (candle-nn requires the input's dtype), which the reference reads too.
#[test]
fn in_bf16_the_rotation_is_rounded_once_not_three_times() -> Result<()> {
    let (cos, sin) = tables(64, 64)?;
    let (cos, sin) = (cos.to_dtype(DType::BF16)?, sin.to_dtype(DType::BF16)?);
    let x = common::randn_in(8, &[4, 8, 64, 64], 2.0, DType::F32)?.to_dtype(DType::BF16)?;
    let wide = |t: &Tensor| t.to_dtype(DType::F64);
    let y_ref = reference_rope(&wide(&x)?, &wide(&cos)?, &wide(&sin)?)?;
    let theirs = common::relative_error(&rotary_emb::rope(&x, &cos, &sin)?, &y_ref)?;
    let ours = common::relative_error(&ops::rope(&x, &cos, &sin)?, &y_ref)?;
    eprintln!("bf16 rope: relative error amp {ours:.3e}, candle-nn {theirs:.3e}");
    assert!(ours <= common::tolerance(DType::BF16, 1, 1.0), "amp: {ours:e}");
    // Measured 1.6e-3 against 2.1e-3: the two product roundings add a third to the last one's error.
    assert!(ours < 0.9 * theirs, "amp {ours:e} against candle-nn {theirs:e}");
    Ok(())
}

/// A query projection whose output is rotated: through candle-nn's kernel its weight gets no gradient
/// (the kernel has no backward), through amp's it gets the gradient of the f32 composition.
#[test]
fn a_projection_before_the_rotation_trains_through_amps_op_and_not_through_candles() -> Result<()> {
    let dev = Device::Cpu;
    let (cos, sin) = tables(5, 8)?;
    let w = candle_core::Var::from_tensor(&Tensor::randn(0f32, 0.3, (16, 16), &dev)?)?;
    let x = Tensor::randn(0f32, 1.0, (5, 16), &dev)?;
    let grad_of_w = |rotate: Rotation| -> Result<Option<Tensor>> {
        // (5 positions, 16) -> (1 sequence, 2 heads, 5 positions, 8)
        let q = x.matmul(w.as_tensor())?.reshape((5, 2, 8))?.transpose(0, 1)?.unsqueeze(0)?.contiguous()?;
        let loss = rotate(&q, &cos, &sin)?.sqr()?.sum_all()?;
        Ok(loss.backward()?.get(w.as_tensor()).cloned())
    };
    assert!(grad_of_w(rotary_emb::rope)?.is_none(), "candle-nn's rope: no gradient");
    let ours = grad_of_w(ops::rope)?.expect("a gradient through amp's rope");
    // A rotation keeps lengths, so d/dW of sum(rotated^2) is d/dW of sum(q^2) = 2 x^T (x W).
    let want = (x.t()?.matmul(&x.matmul(w.as_tensor())?)? * 2.0)?;
    common::assert_close("dW through the rotation", &ours, &want, common::tolerance(DType::F32, 0, 0.0))?;
    Ok(())
}
