//! `amp::ops` pooling: forward and gradient against window-by-window sums in f64 in every dtype, on the
//! CPU op and on the composed path other devices take (run here in f64); what candle's own pooling
//! cannot train; the errors.
//!
//! Tolerances: a max's value is exact (the first maximum's); its gradient sums the output gradient's
//! parts routed to an element in f32 (`tolerance(F32, 1, 4.0)`). An average rounds the input to its dtype (the
//! reference uses the rounded values), sums at most 9 values in f32 and divides: within
//! `tolerance(F32, 2, 4.0)` normwise; its gradient likewise; in a half dtype one more rounding of the
//! result (`tolerance(dtype, 1, 2.0)`).

mod common;

use amp::ops::{avg_pool1d, avg_pool2d, max_pool1d, max_pool2d};
use candle_core::{DType, Device, Result, Tensor, Var};

/// Window size, stride and padding per spatial dimension.
#[derive(Clone, Copy, Debug)]
struct Window {
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
}

const WINDOWS: [Window; 4] = [
    // ResNet's stem pool: overlapping, padded.
    Window { kernel: [3, 3], stride: [2, 2], padding: [1, 1] },
    // Overlapping at stride 1, rectangular.
    Window { kernel: [2, 3], stride: [1, 1], padding: [0, 1] },
    // candle's case: the window its stride, no padding.
    Window { kernel: [2, 2], stride: [2, 2], padding: [0, 0] },
    Window { kernel: [1, 3], stride: [1, 2], padding: [0, 1] },
];

/// `(y, dx)` of max or average pooling of `x (n, c, h, w)` with the gradient of `sum(y * r)`
/// (`r` as `common::value_and_grad` draws it), directly in f64.
fn direct(x: &Tensor, window: Window, max: bool) -> Result<(Tensor, Tensor)> {
    let (n, c, h, w) = x.dims4()?;
    let out =
        |d: usize, size: usize| (size + 2 * window.padding[d] - window.kernel[d]) / window.stride[d] + 1;
    let (oh, ow) = (out(0, h), out(1, w));
    let xv = x.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let r = common::randn_in(99, &[n, c, oh, ow], 1.0, DType::F32)?.to_dtype(x.dtype())?;
    let r = r.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let (mut y, mut dx) = (vec![0.0; r.len()], vec![0.0; xv.len()]);
    let size = (window.kernel[0] * window.kernel[1]) as f64;
    for (o, (plane, oy, ox)) in
        (0..n * c).flat_map(|p| (0..oh).flat_map(move |oy| (0..ow).map(move |ox| (p, oy, ox)))).enumerate()
    {
        let mut inside = Vec::new();
        for (i, j) in (0..window.kernel[0]).flat_map(|i| (0..window.kernel[1]).map(move |j| (i, j))) {
            let sy = (oy * window.stride[0] + i).checked_sub(window.padding[0]).filter(|&v| v < h);
            let sx = (ox * window.stride[1] + j).checked_sub(window.padding[1]).filter(|&v| v < w);
            if let (Some(sy), Some(sx)) = (sy, sx) {
                inside.push((plane * h + sy) * w + sx);
            }
        }
        if max {
            let first =
                inside.iter().copied().reduce(|a, b| if xv[b] > xv[a] { b } else { a }).expect("inside");
            y[o] = xv[first];
            dx[first] += r[o];
        } else {
            y[o] = inside.iter().map(|&at| xv[at]).sum::<f64>() / size;
            inside.iter().for_each(|&at| dx[at] += r[o] / size);
        }
    }
    let cpu = &Device::Cpu;
    Ok((Tensor::from_vec(y, (n, c, oh, ow), cpu)?, Tensor::from_vec(dx, x.dims(), cpu)?))
}

fn pool(x: &Tensor, window: Window, max: bool) -> Result<Tensor> {
    let Window { kernel: [kh, kw], stride: [sh, sw], padding: [ph, pw] } = window;
    if max {
        max_pool2d(x, (kh, kw), (sh, sw), (ph, pw))
    } else {
        avg_pool2d(x, (kh, kw), (sh, sw), (ph, pw))
    }
}

/// Values on a grid of 1/8 with many ties (so the first-maximum rule decides), in `dtype` exactly.
fn input(seed: u64, dims: &[usize], dtype: DType) -> Result<Tensor> {
    (common::randn_in(seed, dims, 3.0, DType::F32)? * 8.0)?.round()?.affine(0.125, 0.0)?.to_dtype(dtype)
}

#[test]
fn pooling_matches_direct_sums_in_every_dtype_forward_and_backward() -> Result<()> {
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        // f64 runs the composed path that other devices take.
        let x = input(1, &[2, 3, 9, 8], dtype)?;
        for window in WINDOWS {
            for max in [true, false] {
                let what = format!("{} {dtype:?} {window:?}", if max { "max" } else { "avg" });
                let (y, dx) = common::value_and_grad(|x| pool(x, window, max), &x)?;
                assert_eq!((y.dtype(), dx.dtype()), (dtype, dtype), "{what}: dtypes");
                let (y_ref, dx_ref) = direct(&x, window, max)?;
                if max && dtype != DType::F64 {
                    let as_f64 = |t: &Tensor| t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>();
                    assert_eq!(as_f64(&y)?, as_f64(&y_ref)?, "{what}: the windows' maxima");
                    // The routed gradient: r in the dtype, its parts summed in f32 and rounded once.
                    let rounding = if dtype == DType::F32 { 0.0 } else { common::tolerance(dtype, 1, 2.0) };
                    let tolerance = common::tolerance(DType::F32, 1, 4.0) + rounding;
                    let dx = dx.to_dtype(DType::F64)?;
                    common::assert_close(&format!("{what} grad"), &dx, &dx_ref, tolerance)?;
                    continue;
                }
                let rounding = if matches!(dtype, DType::F32 | DType::F64) {
                    0.0
                } else {
                    common::tolerance(dtype, 1, 2.0)
                };
                let tolerance = common::tolerance(DType::F32, 2, 4.0) + rounding;
                let to_f64 = |t: &Tensor| t.to_dtype(DType::F64);
                common::assert_close(&format!("{what} forward"), &to_f64(&y)?, &y_ref, tolerance)?;
                common::assert_close(&format!("{what} grad"), &to_f64(&dx)?, &dx_ref, tolerance)?;
            }
        }
    }
    Ok(())
}

#[test]
fn one_dimensional_pooling_is_two_dimensional_pooling_of_height_one() -> Result<()> {
    let x = input(2, &[2, 4, 17], DType::F32)?;
    let x2 = x.unsqueeze(2)?;
    for (k, s, p) in [(3, 2, 1), (4, 1, 2), (2, 2, 0)] {
        let flat = |t: Tensor| t.flatten_all()?.to_vec1::<f32>();
        assert_eq!(flat(max_pool1d(&x, k, s, p)?)?, flat(max_pool2d(&x2, (1, k), (1, s), (0, p))?)?);
        assert_eq!(flat(avg_pool1d(&x, k, s, p)?)?, flat(avg_pool2d(&x2, (1, k), (1, s), (0, p))?)?);
        assert_eq!(max_pool1d(&x, k, s, p)?.dims(), [2, 4, (17 + 2 * p - k) / s + 1]);
    }
    Ok(())
}

#[test]
fn candles_pooling_cannot_train_overlapping_windows_where_amps_does() -> Result<()> {
    let x = Var::from_tensor(&input(3, &[2, 3, 8, 8], DType::F32)?)?;
    let err = x.as_tensor().max_pool2d_with_stride(3, 2)?.sum_all()?.backward().expect_err("candle 0.11.1");
    assert!(err.to_string().contains("backward not supported for maxpool2d"), "{err}");
    let err = x.as_tensor().avg_pool2d_with_stride(3, 1)?.sum_all()?.backward().expect_err("candle 0.11.1");
    assert!(err.to_string().contains("backward not supported for avgpool2d"), "{err}");
    for max in [true, false] {
        let grads = pool(x.as_tensor(), WINDOWS[0], max)?.sum_all()?.backward()?;
        assert!(grads.get(x.as_tensor()).is_some(), "amp's pooling has a gradient");
    }
    Ok(())
}

#[test]
fn where_candle_pools_amp_computes_its_values() -> Result<()> {
    // candle's case: no padding (its ops take none); values off the 1/8 grid, so sums round.
    let x = common::randn_in(4, &[2, 3, 9, 8], 1.0, DType::F32)?;
    for (k, s) in [(2, 2), (3, 2), (3, 1)] {
        let flat = |t: Tensor| t.flatten_all()?.to_vec1::<f32>();
        assert_eq!(flat(max_pool2d(&x, k, s, 0)?)?, flat(x.max_pool2d_with_stride(k, s)?)?, "max {k}/{s}");
        let ours = avg_pool2d(&x, k, s, 0)?;
        common::assert_close(
            &format!("avg {k}/{s}"),
            &ours,
            &x.avg_pool2d_with_stride(k, s)?,
            common::tolerance(DType::F32, 2, 4.0),
        )?;
    }
    Ok(())
}

#[test]
fn a_nan_in_a_window_is_its_maximum() -> Result<()> {
    let mut values = vec![0f32; 16];
    values[5] = f32::NAN;
    let x = Tensor::from_vec(values, (1, 1, 4, 4), &Device::Cpu)?;
    let y = max_pool2d(&x, 2, 2, 0)?.flatten_all()?.to_vec1::<f32>()?;
    assert!(y[0].is_nan() && y[1..].iter().all(|v| *v == 0.0), "{y:?}");
    Ok(())
}

#[test]
fn pooling_it_cannot_do_is_refused_with_the_reason() -> Result<()> {
    let x = Tensor::zeros((1, 2, 5, 5), DType::F32, &Device::Cpu)?;
    let message = |r: Result<Tensor>| r.expect_err("refused").to_string();
    let err = message(max_pool2d(&x, 3, 2, 2));
    assert!(err.contains("max_pool2d: padding [2, 2] exceeds half the window [3, 3]"), "{err}");
    let err = message(avg_pool2d(&x, 3, 0, 0));
    assert!(err.contains("avg_pool2d: kernel [3, 3] and stride [0, 0] must be at least 1"), "{err}");
    let err = message(max_pool2d(&x, 8, 1, 1));
    assert!(err.contains("window [8, 8] larger than the input [1, 2, 5, 5] padded by [1, 1]"), "{err}");
    let err = message(max_pool2d(&x.squeeze(0)?, 2, 2, 0));
    assert!(
        err.contains("(batch, channels, height, width), got shape [2, 5, 5]") && err.contains("unsqueeze(0)"),
        "{err}"
    );
    let err = message(max_pool1d(&x, 2, 2, 0));
    assert!(
        err.contains("max_pool1d: the input must be (batch, channels, length), got shape [1, 2, 5, 5]"),
        "{err}"
    );
    let err = message(max_pool2d(&x.to_dtype(DType::U8)?, 2, 2, 0));
    assert!(err.contains("pools floats, got U8"), "{err}");
    Ok(())
}

#[test]
fn a_step_through_candles_pool_names_amps_and_changes_nothing() -> amp::Result<()> {
    use amp::optim::{AdamConfig, FusedAdamW, ParamGroups};
    use amp::scaler::ScalerConfig;
    use amp::varmap::AmpVarMap;
    use amp::{AmpConfig, AmpModuleExt, Error, GradScaler, OptLevel};

    let device = Device::Cpu;
    let varmap = AmpVarMap::new(AmpConfig::new(OptLevel::O2, &device));
    let vb = varmap.var_builder(&device);
    let w = vb.get_with_hints((1, 2, 6, 6), "w", candle_nn::Init::Const(0.5))?;
    let mut optimizer = FusedAdamW::new(ParamGroups::from_model(&varmap)?, AdamConfig::default())?;
    let mut scaler = GradScaler::for_model(&varmap, ScalerConfig::default())?;
    let x = input(5, &[1, 2, 6, 6], w.dtype())?;
    let master = |v: &AmpVarMap| -> amp::Result<Vec<f32>> {
        Ok(v.named_params()[0].1.master().as_tensor().flatten_all()?.to_vec1::<f32>()?)
    };
    let before = master(&varmap)?;
    let loss = (&x * &w)?.max_pool2d_with_stride(3, 2)?.to_dtype(DType::F32)?.sum_all()?;
    let err = scaler.step_fused(&loss, &mut optimizer, None).expect_err("candle cannot differentiate it");
    assert!(matches!(err, Error::NoBackward { .. }), "{err}");
    let message = err.to_string();
    assert!(
        message.contains("backward not supported for maxpool2d") && message.contains("ops::max_pool2d"),
        "{message}"
    );
    assert_eq!(master(&varmap)?, before, "nothing changed");
    // Through amp's pool the same step trains.
    let loss = max_pool2d(&(&x * &w)?, 3, 2, 0)?.to_dtype(DType::F32)?.sum_all()?;
    scaler.step_fused(&loss, &mut optimizer, None)?;
    assert_ne!(master(&varmap)?, before);
    Ok(())
}
