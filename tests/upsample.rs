//! `amp::ops::upsample_bilinear2d`: values against PyTorch's definition evaluated directly in f64 and
//! against candle's own (forward-only) kernel, the gradient against the definition's adjoint in f64, in
//! f32, bf16 and f64; what candle cannot train; the errors.
//!
//! Tolerances: in f32 the blend rounds its weights and each of its two steps' products and sums: a
//! few units of f32 roundoff (`tolerance(F32, 4, 4.0)`, normwise). In bf16 the input is exact (the
//! reference reads the rounded values) and the result is rounded once more: `tolerance(BF16, 1, 2.0)`.

mod common;

use amp::ops::{upsample_bilinear2d, upsample_bilinear2d_with_scale};
use candle_core::{DType, Device, Result, Tensor, Var};

/// PyTorch's source of output `o` along an axis of `input` elements resized to `output`: the two
/// neighbours and the weight of the second.
fn source(
    o: usize,
    input: usize,
    output: usize,
    align_corners: bool,
    scale: Option<f64>,
) -> (usize, usize, f64) {
    let at = if align_corners {
        if output > 1 {
            o as f64 * (input - 1) as f64 / (output - 1) as f64
        } else {
            0.0
        }
    } else {
        let step = scale.map_or(input as f64 / output as f64, |s| 1.0 / s);
        (o as f64 + 0.5) * step - 0.5
    }
    .max(0.0);
    let first = (at.floor() as usize).min(input - 1);
    (first, (first + 1).min(input - 1), (at - first as f64).min(1.0))
}

/// `(y, dx)` for `sum(y * r)` (`r` as `common::value_and_grad` draws it), directly in f64.
fn direct(
    x: &Tensor,
    out: (usize, usize),
    align_corners: bool,
    scale: Option<(f64, f64)>,
) -> Result<(Tensor, Tensor)> {
    let (n, c, h, w) = x.dims4()?;
    let xv = x.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let r = common::randn_in(99, &[n, c, out.0, out.1], 1.0, DType::F32)?.to_dtype(x.dtype())?;
    let r = r.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let (mut y, mut dx) = (vec![0.0; r.len()], vec![0.0; xv.len()]);
    for (o, (plane, oy, ox)) in (0..n * c)
        .flat_map(|p| (0..out.0).flat_map(move |oy| (0..out.1).map(move |ox| (p, oy, ox))))
        .enumerate()
    {
        let (y0, y1, ty) = source(oy, h, out.0, align_corners, scale.map(|s| s.0));
        let (x0, x1, tx) = source(ox, w, out.1, align_corners, scale.map(|s| s.1));
        for (sy, wy) in [(y0, 1.0 - ty), (y1, ty)] {
            for (sx, wx) in [(x0, 1.0 - tx), (x1, tx)] {
                let at = (plane * h + sy) * w + sx;
                y[o] += wy * wx * xv[at];
                dx[at] += wy * wx * r[o];
            }
        }
    }
    let cpu = &Device::Cpu;
    Ok((Tensor::from_vec(y, (n, c, out.0, out.1), cpu)?, Tensor::from_vec(dx, x.dims(), cpu)?))
}

const SIZES: [((usize, usize), bool); 5] =
    [((14, 16), false), ((14, 16), true), ((11, 5), false), ((3, 23), true), ((1, 1), false)];

#[test]
fn upsampling_matches_the_definition_and_candles_values_forward_and_backward() -> Result<()> {
    for dtype in [DType::F32, DType::BF16, DType::F64] {
        let x = common::randn_in(1, &[2, 3, 7, 8], 1.0, dtype)?;
        for (out, align_corners) in SIZES {
            let what = format!("{dtype:?} {out:?} align_corners {align_corners}");
            let (y, dx) =
                common::value_and_grad(|x| upsample_bilinear2d(x, out.0, out.1, align_corners), &x)?;
            assert_eq!((y.dtype(), dx.dtype()), (dtype, dtype), "{what}");
            let (y_ref, dx_ref) = direct(&x, out, align_corners, None)?;
            let tolerance = match dtype {
                DType::BF16 => common::tolerance(DType::BF16, 1, 2.0),
                _ => common::tolerance(DType::F32, 4, 4.0),
            };
            let wide = |t: &Tensor| t.to_dtype(DType::F64);
            common::assert_close(&format!("{what} forward"), &wide(&y)?, &y_ref, tolerance)?;
            common::assert_close(&format!("{what} grad"), &wide(&dx)?, &dx_ref, tolerance)?;
            if dtype == DType::F32 {
                let candle = x.upsample_bilinear2d(out.0, out.1, align_corners)?;
                common::assert_close(
                    &format!("{what} vs candle"),
                    &y,
                    &candle,
                    common::tolerance(DType::F32, 4, 4.0),
                )?;
            }
        }
    }
    Ok(())
}

#[test]
fn upsampling_by_scale_factors_matches_candles_sizes_and_values() -> Result<()> {
    let x = common::randn_in(2, &[2, 3, 7, 8], 1.0, DType::F32)?;
    for (scale, align_corners) in
        [((2.0, 2.0), false), ((1.5, 0.75), false), ((2.5, 3.0), true), ((1.1, 1.5), false)]
    {
        let what = format!("scale {scale:?} align_corners {align_corners}");
        let (y, dx) = common::value_and_grad(
            |x| upsample_bilinear2d_with_scale(x, scale.0, scale.1, align_corners),
            &x,
        )?;
        let candle = x.upsample_bilinear2d_with_scale(scale.0, scale.1, align_corners)?;
        assert_eq!(y.dims(), candle.dims(), "{what}");
        let tolerance = common::tolerance(DType::F32, 4, 4.0);
        common::assert_close(&format!("{what} vs candle"), &y, &candle, tolerance)?;
        let (_, _, oh, ow) = y.dims4()?;
        let (y_ref, dx_ref) = direct(&x, (oh, ow), align_corners, Some(scale))?;
        common::assert_close(&format!("{what} forward"), &y.to_dtype(DType::F64)?, &y_ref, tolerance)?;
        common::assert_close(&format!("{what} grad"), &dx.to_dtype(DType::F64)?, &dx_ref, tolerance)?;
    }
    // Factors that leave both sizes as they are (7 x 1.1 floors to 7): the input itself, as candle's.
    let same = upsample_bilinear2d_with_scale(&x, 1.1, 1.05, false)?;
    assert_eq!(same.flatten_all()?.to_vec1::<f32>()?, x.flatten_all()?.to_vec1::<f32>()?);
    Ok(())
}

#[test]
fn candles_bilinear_upsampling_cannot_train_where_amps_does() -> Result<()> {
    let x = Var::from_tensor(&common::randn_in(3, &[1, 2, 4, 4], 1.0, DType::F32)?)?;
    let err =
        x.as_tensor().upsample_bilinear2d(8, 8, false)?.sum_all()?.backward().expect_err("candle 0.11.1");
    assert!(err.to_string().contains("backward not supported for upsample_bilinear2d"), "{err}");
    let grads = upsample_bilinear2d(x.as_tensor(), 8, 8, false)?.sum_all()?.backward()?;
    // Each output spreads weights summing to one: the input's gradient sums to the outputs' count.
    let total = grads.get(x.as_tensor()).expect("a gradient").sum_all()?.to_scalar::<f32>()?;
    assert!((total - 128.0).abs() < 1e-3, "{total}");
    Ok(())
}

#[test]
fn upsampling_it_cannot_do_is_refused_with_the_reason() -> Result<()> {
    let x = Tensor::zeros((1, 2, 4, 4), DType::F32, &Device::Cpu)?;
    let message = |r: Result<Tensor>| r.expect_err("refused").to_string();
    let err = message(upsample_bilinear2d(&x.squeeze(0)?, 8, 8, false));
    assert!(err.contains("(batch, channels, height, width), got shape [2, 4, 4]"), "{err}");
    let err = message(upsample_bilinear2d(&x, 0, 8, false));
    assert!(err.contains("a target size of 0 x 8"), "{err}");
    let err = message(upsample_bilinear2d_with_scale(&x, f64::NAN, 2.0, false));
    assert!(err.contains("a scale factor of NaN"), "{err}");
    Ok(())
}
