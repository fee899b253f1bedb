//! `amp::nn` convolutions: forward and gradients in fp32, fp16 and bf16 against direct sums in f64, on
//! amp's GEMM (im2col) and with candle's kernel forced; loading from candle-nn's constructors.
//!
//! The reference is a direct sum over every kernel tap in f64, not candle's convolution: candle 0.11.1's
//! CPU `conv1d` returns wrong gradients for a batch of more than one image (the first test shows it).
//!
//! Tolerances: `common::conv` states them (inputs and weights are f32, the layer casts at use; at most
//! 4 roundings of the compute format's `u` in the forward, 3 in each gradient, safety factor 4).

mod common;

use amp::dispatch::{with_override, Override};
use amp::nn::{conv1d, conv2d, Conv1d, Conv1dConfig, Conv2d, Conv2dConfig};
use amp::{AmpConfig, Layer, LayerPrecision, OptLevel, Param, Precision};
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{VarBuilder, VarMap};

fn in_precision(compute: Precision) -> LayerPrecision {
    LayerPrecision { compute, output: None }
}

/// `f(inputs)` for `common::value_and_grads`: a `Conv2d` in `precision` whose weight and bias are
/// `inputs[1]` and `inputs[2]`, applied to `inputs[0]`.
fn conv2d_layer(config: Conv2dConfig, precision: Precision) -> impl Fn(&[Tensor]) -> Result<Tensor> {
    move |t: &[Tensor]| {
        let mut conv = Conv2d::new(Param::from_tensor(&t[1])?, Some(Param::from_tensor(&t[2])?), config);
        conv.set_precision(in_precision(precision));
        conv.forward(&t[0])
    }
}

/// [`conv2d_layer`] for a `Conv1d`.
fn conv1d_layer(config: Conv1dConfig, precision: Precision) -> impl Fn(&[Tensor]) -> Result<Tensor> {
    move |t: &[Tensor]| {
        let mut conv = Conv1d::new(Param::from_tensor(&t[1])?, Some(Param::from_tensor(&t[2])?), config);
        conv.set_precision(in_precision(precision));
        conv.forward(&t[0])
    }
}

/// Zero padding, stride and dilation per spatial dimension (`[height, width]`) and groups.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    padding: [usize; 2],
    stride: [usize; 2],
    dilation: [usize; 2],
    groups: usize,
}

impl From<Conv2dConfig> for Geometry {
    fn from(c: Conv2dConfig) -> Self {
        Geometry {
            padding: [c.padding; 2],
            stride: [c.stride; 2],
            dilation: [c.dilation; 2],
            groups: c.groups,
        }
    }
}

impl From<Conv1dConfig> for Geometry {
    fn from(c: Conv1dConfig) -> Self {
        Geometry {
            padding: [0, c.padding],
            stride: [1, c.stride],
            dilation: [1, c.dilation],
            groups: c.groups,
        }
    }
}

/// `y = x ⋆ w + bias` for `x (n, c, h, w)` and `w (o, c / groups, kh, kw)`, and the gradients of
/// `sum(y * r)` (`r` as `common::value_and_grads` draws it) for x, w and bias, each a direct sum in f64.
fn direct(x: &Tensor, w: &Tensor, bias: &Tensor, g: Geometry) -> Result<(Tensor, [Tensor; 3])> {
    let (n, c, h, wd) = x.dims4()?;
    let (o, cg, kh, kw) = w.dims4()?;
    let og = o / g.groups;
    let out = |d: usize, size: usize, k: usize| {
        (size + 2 * g.padding[d] - g.dilation[d] * (k - 1) - 1) / g.stride[d] + 1
    };
    let (oh, ow) = (out(0, h, kh), out(1, wd, kw));
    let flat = |t: &Tensor| t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>();
    let (xv, wv, bv) = (flat(x)?, flat(w)?, flat(bias)?);
    let r = flat(&common::randn_in(99, &[n, o, oh, ow], 1.0, DType::F32)?)?;
    let (mut y, mut dx, mut dw, mut db) =
        (vec![0.0; r.len()], vec![0.0; xv.len()], vec![0.0; wv.len()], vec![0.0; o]);
    let source = |d: usize, at: usize, tap: usize, size: usize| {
        (at * g.stride[d] + tap * g.dilation[d]).checked_sub(g.padding[d]).filter(|&v| v < size)
    };
    for b in 0..n {
        for oc in 0..o {
            for (yy, xx) in (0..oh).flat_map(|yy| (0..ow).map(move |xx| (yy, xx))) {
                let at = ((b * o + oc) * oh + yy) * ow + xx;
                let mut sum = bv[oc];
                for (ci, i, j) in
                    (0..cg).flat_map(|ci| (0..kh).flat_map(move |i| (0..kw).map(move |j| (ci, i, j))))
                {
                    let (Some(sy), Some(sx)) = (source(0, yy, i, h), source(1, xx, j, wd)) else { continue };
                    let xi = ((b * c + oc / og * cg + ci) * h + sy) * wd + sx;
                    let wi = ((oc * cg + ci) * kh + i) * kw + j;
                    sum += xv[xi] * wv[wi];
                    dx[xi] += r[at] * wv[wi];
                    dw[wi] += r[at] * xv[xi];
                }
                y[at] = sum;
                db[oc] += r[at];
            }
        }
    }
    let cpu = &Device::Cpu;
    Ok((
        Tensor::from_vec(y, (n, o, oh, ow), cpu)?,
        [
            Tensor::from_vec(dx, x.dims(), cpu)?,
            Tensor::from_vec(dw, w.dims(), cpu)?,
            Tensor::from_vec(db, o, cpu)?,
        ],
    ))
}

#[test]
fn candle_conv1d_gradients_are_wrong_for_batches_where_a_direct_sum_and_amp_agree() -> Result<()> {
    let x = common::randn_in(4, &[3, 5, 20], 1.0, DType::F32)?;
    let w = common::randn_in(5, &[7, 5, 3], 0.3, DType::F32)?;
    let b = Tensor::zeros(7, DType::F32, &Device::Cpu)?;
    let reference = direct(&x.unsqueeze(2)?, &w.unsqueeze(2)?, &b, Conv1dConfig::default().into())?;
    let candle = common::value_and_grads(|t| t[0].conv1d(&t[1], 0, 1, 1, 1), &[x.clone(), w.clone()])?;
    let dw = reference.1[1].squeeze(2)?.to_dtype(DType::F32)?;
    let candle_error = common::relative_error(&candle.1[1], &dw)?;
    assert!(candle_error > 0.5, "candle 0.11.1's conv1d kernel gradient is off by {candle_error:.2}: fixed?");
    let layer =
        |t: &[Tensor]| Conv1d::new(Param::from_tensor(&t[1])?, None, Conv1dConfig::default()).forward(&t[0]);
    let (_, grads) = common::value_and_grads(layer, &[x, w])?;
    common::assert_close("amp conv1d grad weight", &grads[1], &dw, common::tolerance(DType::F32, 3, 4.0))?;
    Ok(())
}

fn conv2d_configs() -> [Conv2dConfig; 3] {
    [
        Conv2dConfig { padding: 1, stride: 2, ..Default::default() },
        Conv2dConfig { padding: 2, dilation: 2, groups: 2, ..Default::default() },
        Conv2dConfig::default(),
    ]
}

#[test]
fn conv2d_matches_direct_sums_in_every_precision_forward_and_backward() -> Result<()> {
    // The last: a 1 x 1 kernel, whose image is its own columns matrix (no unfold, no fold).
    let cases = conv2d_configs().into_iter().chain([Conv2dConfig::default()]);
    for (config, (image, k)) in
        cases.zip([([2, 4, 9, 9], 3), ([3, 4, 8, 11], 3), ([2, 4, 5, 13], 3), ([3, 4, 5, 7], 1)])
    {
        let inputs = [
            common::randn_in(1, &image, 1.0, DType::F32)?,
            common::randn_in(2, &[6, 4 / config.groups, k, k], 0.3, DType::F32)?,
            common::randn_in(3, &[6], 0.5, DType::F32)?,
        ];
        let reference = direct(&inputs[0], &inputs[1], &inputs[2], config.into())?;
        for precision in Precision::ALL {
            let result = common::value_and_grads(conv2d_layer(config, precision), &inputs)?;
            assert_eq!(result.0.dtype(), DType::F32, "output returns in the input's dtype");
            let what = format!("conv2d {precision} {config:?} kernel {k}");
            common::conv::assert_matches_direct(&what, result, &reference, precision)?;
        }
    }
    Ok(())
}

fn conv1d_configs() -> [Conv1dConfig; 3] {
    [
        Conv1dConfig { padding: 1, dilation: 2, ..Default::default() },
        Conv1dConfig { padding: 2, stride: 3, groups: 5, ..Default::default() },
        Conv1dConfig::default(),
    ]
}

#[test]
fn conv1d_matches_direct_sums_in_every_precision_forward_and_backward() -> Result<()> {
    let cases = conv1d_configs().into_iter().zip([3, 3, 3]).chain([(Conv1dConfig::default(), 1)]);
    for (config, k) in cases {
        let inputs = [
            common::randn_in(4, &[3, 5, 20], 1.0, DType::F32)?,
            common::randn_in(5, &[10, 5 / config.groups, k], 0.3, DType::F32)?,
            common::randn_in(6, &[10], 0.5, DType::F32)?,
        ];
        let reference =
            direct(&inputs[0].unsqueeze(2)?, &inputs[1].unsqueeze(2)?, &inputs[2], config.into())?;
        for precision in Precision::ALL {
            let result = common::value_and_grads(conv1d_layer(config, precision), &inputs)?;
            let what = format!("conv1d {precision} {config:?} kernel {k}");
            common::conv::assert_matches_direct(&what, result, &reference, precision)?;
        }
    }
    Ok(())
}

#[test]
fn with_candles_kernel_forced_convolutions_still_match_the_direct_sums() -> Result<()> {
    let x2 = common::randn_in(1, &[2, 4, 9, 9], 1.0, DType::F32)?;
    let x1 = common::randn_in(4, &[3, 5, 20], 1.0, DType::F32)?;
    let config2 = conv2d_configs()[1];
    let config1 = conv1d_configs()[0];
    let inputs2 = [
        x2,
        common::randn_in(2, &[6, 2, 3, 3], 0.3, DType::F32)?,
        common::randn_in(3, &[6], 0.5, DType::F32)?,
    ];
    let inputs1 = [
        x1,
        common::randn_in(5, &[10, 5, 3], 0.3, DType::F32)?,
        common::randn_in(6, &[10], 0.5, DType::F32)?,
    ];
    let reference2 = direct(&inputs2[0], &inputs2[1], &inputs2[2], config2.into())?;
    let reference1 =
        direct(&inputs1[0].unsqueeze(2)?, &inputs1[1].unsqueeze(2)?, &inputs1[2], config1.into())?;
    with_override(Override::Candle, || -> Result<()> {
        // candle has no CPU bf16 conv2d (the layer's exact f32 path) and a wrong conv1d backward (the
        // layer's 2-d route): both must still be right.
        for precision in [Precision::Fp32, Precision::Bf16] {
            let result = common::value_and_grads(conv2d_layer(config2, precision), &inputs2)?;
            common::conv::assert_matches_direct(
                &format!("candle conv2d {precision}"),
                result,
                &reference2,
                precision,
            )?;
            let result = common::value_and_grads(conv1d_layer(config1, precision), &inputs1)?;
            common::conv::assert_matches_direct(
                &format!("candle conv1d {precision}"),
                result,
                &reference1,
                precision,
            )?;
        }
        Ok(())
    })
    .expect("candle can always be forced")
}

#[test]
fn candle_conv2d_refuses_bf16_on_cpu() -> Result<()> {
    let x = common::randn_in(1, &[2, 4, 8, 8], 1.0, DType::BF16)?;
    let w = common::randn_in(2, &[6, 4, 3, 3], 0.2, DType::BF16)?;
    let err = x.conv2d(&w, 1, 1, 1, 1).expect_err("candle 0.11 has no CPU bf16 conv2d");
    assert!(err.to_string().contains("unsupported dtype BF16"), "{err}");
    Ok(())
}

#[test]
fn convolutions_accumulate_in_f32_in_both_half_formats() -> Result<()> {
    // 2304 = 256 channels x 3 x 3 products of 1 x 1: representable in fp16 and bf16, but an accumulator in
    // either format would stall (at 2048 in fp16, 256 in bf16), as candle's half sums do.
    for half in [Precision::Fp16, Precision::Bf16] {
        let mut conv = Conv2d::new(
            Param::from_tensor(&Tensor::ones((1, 256, 3, 3), DType::F32, &Device::Cpu)?)?,
            None,
            Default::default(),
        );
        conv.set_precision(in_precision(half));
        let y = conv.forward(&Tensor::ones((1, 256, 3, 3), half.dtype(), &Device::Cpu)?)?;
        assert_eq!(y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, [2304.0], "conv2d {half}");
        let mut conv = Conv1d::new(
            Param::from_tensor(&Tensor::ones((1, 768, 3), DType::F32, &Device::Cpu)?)?,
            None,
            Default::default(),
        );
        conv.set_precision(in_precision(half));
        let y = conv.forward(&Tensor::ones((1, 768, 3), half.dtype(), &Device::Cpu)?)?;
        assert_eq!(y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, [2304.0], "conv1d {half}");
    }
    Ok(())
}

#[test]
fn convs_load_what_candle_nn_constructors_create_and_match_them_in_f32() -> Result<()> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let x = common::randn_in(7, &[2, 4, 9, 9], 1.0, DType::F32)?;
    let tolerance = common::tolerance(DType::F32, 2, 4.0);
    for (i, config) in conv2d_configs().into_iter().enumerate() {
        let theirs = candle_nn::conv2d(4, 6, 3, config, vb.pp(format!("c2_{i}")))?;
        let ours = conv2d(4, 6, 3, config, vb.pp(format!("c2_{i}")))?;
        let expected = theirs.forward(&x)?;
        common::assert_close(&format!("conv2d {i}"), &ours.forward(&x)?, &expected, tolerance)?;
        // candle's own kernel, forced: the same values bit for bit.
        let forced = with_override(Override::Candle, || ours.forward(&x)).expect("candle can be forced")?;
        assert_eq!(forced.flatten_all()?.to_vec1::<f32>()?, expected.flatten_all()?.to_vec1::<f32>()?);
        let theirs = candle_nn::conv2d_no_bias(4, 6, 3, config, vb.pp(format!("n2_{i}")))?;
        let ours = amp::nn::conv2d_no_bias(4, 6, 3, config, vb.pp(format!("n2_{i}")))?;
        common::assert_close(
            &format!("conv2d {i} no bias"),
            &ours.forward(&x)?,
            &theirs.forward(&x)?,
            tolerance,
        )?;
    }
    let config = Conv1dConfig { padding: 1, ..Default::default() };
    let theirs = candle_nn::conv1d(5, 7, 3, config, vb.pp("c1"))?;
    let ours = conv1d(5, 7, 3, config, vb.pp("c1"))?;
    let x = common::randn_in(8, &[3, 5, 20], 1.0, DType::F32)?;
    common::assert_close("conv1d", &ours.forward(&x)?, &theirs.forward(&x)?, tolerance)?;
    let names: Vec<&str> = ours.params().iter().map(|(name, _)| *name).collect();
    assert_eq!(names, ["weight", "bias"]);
    let stored = varmap.data().lock().unwrap().get("c1.weight").cloned().expect("c1.weight in the VarMap");
    assert_eq!(
        ours.weight().trainable().as_tensor().id(),
        stored.as_tensor().id(),
        "shares the VarMap's variable"
    );
    Ok(())
}

#[test]
fn under_o2_the_kernels_gradient_leaves_amps_gemm_in_f32_for_the_master() -> amp::Result<()> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mut conv = conv2d(4, 6, 3, conv2d_configs()[0], vb.pp("c"))?;
    amp::initialize(&mut conv, AmpConfig { opt_level: OptLevel::O2, half: Precision::Bf16 })?;
    let x = common::randn_in(1, &[2, 4, 9, 9], 1.0, DType::F32)?;
    let y = conv.forward(&x)?;
    let r = common::randn_in(99, y.dims(), 1.0, DType::F32)?;
    let grads = (&y * &r)?.sum_all()?.backward()?;
    let weight = conv.weight();
    assert!(grads.get(weight.trainable().as_tensor()).is_none(), "nothing reaches the bf16 working copy");
    let grad = weight.grad("weight", &grads)?.expect("the master's gradient");
    assert_eq!(grad.dtype(), DType::F32);
    let through_bf16 = grad.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
    assert!(
        grad.ne(&through_bf16)?.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()? > 0.0,
        "never rounded to bf16"
    );
    // Against direct sums of the same f32 values: the operands' bf16 roundings only.
    let bias = conv.bias().expect("a bias").master().as_tensor().clone();
    let reference = direct(&x, weight.master().as_tensor(), &bias, conv2d_configs()[0].into())?;
    let expected = reference.1[1].to_dtype(DType::F32)?;
    common::assert_close("O2 conv2d grad weight", grad, &expected, common::tolerance(DType::BF16, 3, 4.0))?;
    Ok(())
}

#[test]
fn a_conv_input_it_cannot_read_is_refused_in_its_own_terms() -> Result<()> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let layer = conv1d(3, 4, 3, Conv1dConfig::default(), vb.pp("c"))?;
    let message = |x: Tensor| layer.forward(&x).expect_err("refused").to_string();
    let err = message(Tensor::zeros((3, 10), DType::F32, &Device::Cpu)?);
    assert!(err.contains("(batch, channels, length), got shape [3, 10]"), "{err}");
    assert!(err.contains("`.unsqueeze(0)`") && !err.contains("rank 4"), "{err}");
    let err = message(Tensor::zeros((2, 5, 10), DType::F32, &Device::Cpu)?);
    assert!(err.contains("has 5 channels (shape [2, 5, 10]); the layer takes 3"), "{err}");
    assert_eq!(layer.forward(&Tensor::zeros((1, 3, 10), DType::F32, &Device::Cpu)?)?.dims(), &[1, 4, 8]);
    let grouped = Conv2dConfig { groups: 2, ..Default::default() };
    let layer = conv2d(4, 6, 3, grouped, vb.pp("d"))?;
    let err =
        layer.forward(&Tensor::zeros((4, 8, 8), DType::F32, &Device::Cpu)?).expect_err("rank 3").to_string();
    assert!(
        err.contains("Conv2d: the input must be (batch, channels, height, width), got shape [4, 8, 8]"),
        "{err}"
    );
    let err =
        layer.forward(&Tensor::zeros((1, 2, 8, 8), DType::F32, &Device::Cpu)?).expect_err("2").to_string();
    assert!(err.contains("has 2 channels (shape [1, 2, 8, 8]); the layer takes 4"), "{err}");
    Ok(())
}
