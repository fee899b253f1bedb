//! `amp::nn` transposed convolutions: forward and gradients in fp32, fp16 and bf16 against direct sums
//! in f64, on amp's GEMM and with candle's kernel forced; loading from candle-nn's constructors; what
//! candle's own transposed convolutions cannot train.
//!
//! Tolerances: `common::conv` states them (the same as for convolutions: at most 4 roundings of the
//! compute format's `u` in the forward, 3 in each gradient, safety factor 4).

mod common;

use amp::dispatch::{with_override, Override};
use amp::nn::{
    conv_transpose1d, conv_transpose2d, ConvTranspose1d, ConvTranspose1dConfig, ConvTranspose2d,
    ConvTranspose2dConfig,
};
use amp::{AmpConfig, Layer, LayerPrecision, OptLevel, Param, Precision};
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{VarBuilder, VarMap};

fn in_precision(compute: Precision) -> LayerPrecision {
    LayerPrecision { compute, output: None }
}

/// `f(inputs)` for `common::value_and_grads`: a `ConvTranspose2d` in `precision` whose weight and bias
/// are `inputs[1]` and `inputs[2]`, applied to `inputs[0]`.
fn layer_2d(config: ConvTranspose2dConfig, precision: Precision) -> impl Fn(&[Tensor]) -> Result<Tensor> {
    move |t: &[Tensor]| {
        let (weight, bias) = (Param::from_tensor(&t[1])?, Some(Param::from_tensor(&t[2])?));
        let mut layer = ConvTranspose2d::new(weight, bias, config);
        layer.set_precision(in_precision(precision));
        layer.forward(&t[0])
    }
}

/// [`layer_2d`] for a `ConvTranspose1d`.
fn layer_1d(config: ConvTranspose1dConfig, precision: Precision) -> impl Fn(&[Tensor]) -> Result<Tensor> {
    move |t: &[Tensor]| {
        let (weight, bias) = (Param::from_tensor(&t[1])?, Some(Param::from_tensor(&t[2])?));
        let mut layer = ConvTranspose1d::new(weight, bias, config);
        layer.set_precision(in_precision(precision));
        layer.forward(&t[0])
    }
}

/// Padding, output padding, stride and dilation per spatial dimension (`[height, width]`), and groups.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    padding: [usize; 2],
    output_padding: [usize; 2],
    stride: [usize; 2],
    dilation: [usize; 2],
    groups: usize,
}

impl From<ConvTranspose2dConfig> for Geometry {
    fn from(c: ConvTranspose2dConfig) -> Self {
        Geometry {
            padding: [c.padding; 2],
            output_padding: [c.output_padding; 2],
            stride: [c.stride; 2],
            dilation: [c.dilation; 2],
            groups: 1,
        }
    }
}

impl From<ConvTranspose1dConfig> for Geometry {
    fn from(c: ConvTranspose1dConfig) -> Self {
        Geometry {
            padding: [0, c.padding],
            output_padding: [0, c.output_padding],
            stride: [1, c.stride],
            dilation: [1, c.dilation],
            groups: c.groups,
        }
    }
}

/// `y = x ⋆ᵀ w + bias` for `x (n, c, h, w)` and `w (c, o / groups, kh, kw)`, scattering each input
/// element through each kernel tap: `y[oc][iy s + ky d - p][ix s + kx d - p] += x[ic][iy][ix] w[ic][j]
/// [ky][kx]` with `oc = group(ic) (o / groups) + j`; and the gradients of `sum(y * r)` (`r` as
/// `common::value_and_grads` draws it) for x, w and bias. All in f64.
fn direct(x: &Tensor, w: &Tensor, bias: &Tensor, g: Geometry) -> Result<(Tensor, [Tensor; 3])> {
    let (n, c, h, wd) = x.dims4()?;
    let (_, og, kh, kw) = w.dims4()?;
    let (o, cg) = (og * g.groups, c / g.groups);
    let out = |d: usize, size: usize, k: usize| {
        (size - 1) * g.stride[d] + g.dilation[d] * (k - 1) + g.output_padding[d] + 1 - 2 * g.padding[d]
    };
    let (oh, ow) = (out(0, h, kh), out(1, wd, kw));
    let flat = |t: &Tensor| t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>();
    let (xv, wv, bv) = (flat(x)?, flat(w)?, flat(bias)?);
    let r = flat(&common::randn_in(99, &[n, o, oh, ow], 1.0, DType::F32)?)?;
    let (mut y, mut dx, mut dw) = (vec![0.0; r.len()], vec![0.0; xv.len()], vec![0.0; wv.len()]);
    let target = |d: usize, at: usize, tap: usize, size: usize| {
        (at * g.stride[d] + tap * g.dilation[d]).checked_sub(g.padding[d]).filter(|&v| v < size)
    };
    for (b, ic, iy, ix) in (0..n).flat_map(|b| {
        (0..c).flat_map(move |ic| (0..h).flat_map(move |iy| (0..wd).map(move |ix| (b, ic, iy, ix))))
    }) {
        let xi = ((b * c + ic) * h + iy) * wd + ix;
        for (j, ky, kx) in
            (0..og).flat_map(|j| (0..kh).flat_map(move |ky| (0..kw).map(move |kx| (j, ky, kx))))
        {
            let (Some(ty), Some(tx)) = (target(0, iy, ky, oh), target(1, ix, kx, ow)) else { continue };
            let oc = ic / cg * og + j;
            let at = ((b * o + oc) * oh + ty) * ow + tx;
            let wi = ((ic * og + j) * kh + ky) * kw + kx;
            y[at] += xv[xi] * wv[wi];
            dx[xi] += r[at] * wv[wi];
            dw[wi] += r[at] * xv[xi];
        }
    }
    let mut db = vec![0.0; o];
    for (at, (y, r)) in y.iter_mut().zip(&r).enumerate() {
        let oc = at / (oh * ow) % o;
        *y += bv[oc];
        db[oc] += r;
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

/// A decoder's upsampling by 2 (`output_padding` 1 makes the output exactly twice the input), a
/// dilated one whose output padding reaches the stride (`x` extended with zeros inside amp's op), a
/// padded one, the default; their kernel sizes.
fn configs_2d() -> [(ConvTranspose2dConfig, usize); 4] {
    [
        (ConvTranspose2dConfig { padding: 1, output_padding: 1, stride: 2, ..Default::default() }, 3),
        (ConvTranspose2dConfig { padding: 1, output_padding: 1, stride: 1, dilation: 2 }, 3),
        (ConvTranspose2dConfig { padding: 2, stride: 3, dilation: 2, ..Default::default() }, 2),
        (ConvTranspose2dConfig::default(), 3),
    ]
}

fn configs_1d() -> [(ConvTranspose1dConfig, usize); 4] {
    [
        (ConvTranspose1dConfig { padding: 1, output_padding: 1, stride: 2, ..Default::default() }, 4),
        (ConvTranspose1dConfig { padding: 2, stride: 3, dilation: 2, groups: 2, ..Default::default() }, 3),
        (
            ConvTranspose1dConfig {
                output_padding: 2,
                stride: 2,
                dilation: 3,
                groups: 2,
                ..Default::default()
            },
            3,
        ),
        // A 1-tap kernel at stride 1: the convolution it is the adjoint of reads its image as its columns.
        (ConvTranspose1dConfig { groups: 2, ..Default::default() }, 1),
    ]
}

fn inputs_2d(kernel: usize) -> Result<[Tensor; 3]> {
    Ok([
        common::randn_in(1, &[2, 4, 7, 6], 1.0, DType::F32)?,
        common::randn_in(2, &[4, 5, kernel, kernel], 0.3, DType::F32)?,
        common::randn_in(3, &[5], 0.5, DType::F32)?,
    ])
}

fn inputs_1d(config: ConvTranspose1dConfig, kernel: usize) -> Result<[Tensor; 3]> {
    Ok([
        common::randn_in(4, &[3, 6, 11], 1.0, DType::F32)?,
        common::randn_in(5, &[6, 8 / config.groups, kernel], 0.3, DType::F32)?,
        common::randn_in(6, &[8], 0.5, DType::F32)?,
    ])
}

fn reference_1d(inputs: &[Tensor; 3], config: ConvTranspose1dConfig) -> Result<(Tensor, [Tensor; 3])> {
    direct(&inputs[0].unsqueeze(2)?, &inputs[1].unsqueeze(2)?, &inputs[2], config.into())
}

#[test]
fn conv_transpose2d_matches_direct_sums_in_every_precision_forward_and_backward() -> Result<()> {
    for (config, kernel) in configs_2d() {
        let inputs = inputs_2d(kernel)?;
        let reference = direct(&inputs[0], &inputs[1], &inputs[2], config.into())?;
        for precision in Precision::ALL {
            let result = common::value_and_grads(layer_2d(config, precision), &inputs)?;
            assert_eq!(result.0.dtype(), DType::F32, "output returns in the input's dtype");
            let what = format!("conv_transpose2d {precision} {config:?} kernel {kernel}");
            common::conv::assert_matches_direct(&what, result, &reference, precision)?;
        }
    }
    Ok(())
}

#[test]
fn conv_transpose1d_matches_direct_sums_in_every_precision_forward_and_backward() -> Result<()> {
    for (config, kernel) in configs_1d() {
        let inputs = inputs_1d(config, kernel)?;
        let reference = reference_1d(&inputs, config)?;
        for precision in Precision::ALL {
            let result = common::value_and_grads(layer_1d(config, precision), &inputs)?;
            let what = format!("conv_transpose1d {precision} {config:?} kernel {kernel}");
            common::conv::assert_matches_direct(&what, result, &reference, precision)?;
        }
    }
    Ok(())
}

#[test]
fn with_candles_kernel_forced_transposed_convolutions_still_match_the_direct_sums() -> Result<()> {
    with_override(Override::Candle, || -> Result<()> {
        // candle has no CPU bf16 transposed convolution backward (the layer's exact f32 path), no
        // groups and no backward at all in 1-d (the layer's grouped 2-d route), and a backward that
        // breaks once the output padding reaches the stride (the layer crops and extends itself).
        for precision in [Precision::Fp32, Precision::Bf16] {
            for (config, kernel) in configs_2d() {
                let inputs = inputs_2d(kernel)?;
                let reference = direct(&inputs[0], &inputs[1], &inputs[2], config.into())?;
                let result = common::value_and_grads(layer_2d(config, precision), &inputs)?;
                let what = format!("candle conv_transpose2d {precision} {config:?}");
                common::conv::assert_matches_direct(&what, result, &reference, precision)?;
            }
            for (config, kernel) in configs_1d() {
                let inputs = inputs_1d(config, kernel)?;
                let reference = reference_1d(&inputs, config)?;
                let result = common::value_and_grads(layer_1d(config, precision), &inputs)?;
                let what = format!("candle conv_transpose1d {precision} {config:?}");
                common::conv::assert_matches_direct(&what, result, &reference, precision)?;
            }
        }
        Ok(())
    })
    .expect("candle can always be forced")
}

#[test]
fn candles_transposed_convolutions_cannot_train_where_amps_do() -> Result<()> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let x = common::randn_in(4, &[3, 6, 11], 1.0, DType::F32)?;
    let config = ConvTranspose1dConfig { stride: 2, padding: 1, output_padding: 1, ..Default::default() };
    let theirs = candle_nn::conv_transpose1d(6, 8, 4, config, vb.pp("theirs"))?;
    let err =
        theirs.forward(&x)?.sum_all()?.backward().expect_err("candle 0.11.1: no conv_transpose1d backward");
    assert!(err.to_string().contains("conv-transpose1d"), "{err}");
    let ours = conv_transpose1d(6, 8, 4, config, vb.pp("ours"))?;
    let grads = ours.forward(&x)?.sum_all()?.backward()?;
    assert!(grads.get(ours.weight().trainable().as_tensor()).is_some(), "amp's kernel has a gradient");

    // candle's conv_transpose2d backward: no bf16 on the CPU; a shape error once output padding >= stride.
    let x = common::randn_in(1, &[2, 4, 7, 6], 1.0, DType::F32)?;
    let w = candle_core::Var::from_tensor(&common::randn_in(2, &[4, 5, 3, 3], 0.3, DType::F32)?)?;
    let bf16 = w.as_tensor().to_dtype(DType::BF16)?;
    let y = x.to_dtype(DType::BF16)?.conv_transpose2d(&bf16, 1, 1, 2, 1)?;
    let err = y.sum_all()?.backward().expect_err("candle 0.11.1: no CPU bf16 conv2d in the backward");
    assert!(err.to_string().contains("unsupported dtype BF16"), "{err}");
    let y = x.conv_transpose2d(w.as_tensor(), 1, 1, 1, 2)?;
    assert!(
        y.sum_all()?.backward().is_err(),
        "candle 0.11.1: output padding 1 at stride 1 breaks its backward"
    );
    let layer = |t: &[Tensor]| {
        ConvTranspose2d::new(Param::from_tensor(&t[1])?, None, configs_2d()[1].0).forward(&t[0])
    };
    common::value_and_grads(layer, &[x, w.as_tensor().clone()])?;
    Ok(())
}

#[test]
fn transposed_convolutions_accumulate_in_f32_in_both_half_formats() -> Result<()> {
    // Every output element sums 2304 products of 1 x 1 (256 input channels x a 3 x 3 kernel over a
    // 3 x 3 image, the middle element): an accumulator in either half format would stall (at 2048 in
    // fp16, 256 in bf16).
    for half in [Precision::Fp16, Precision::Bf16] {
        let weight = Param::from_tensor(&Tensor::ones((256, 1, 3, 3), DType::F32, &Device::Cpu)?)?;
        let config = ConvTranspose2dConfig { padding: 2, ..Default::default() };
        let mut layer = ConvTranspose2d::new(weight, None, config);
        layer.set_precision(in_precision(half));
        let y = layer.forward(&Tensor::ones((1, 256, 3, 3), half.dtype(), &Device::Cpu)?)?;
        assert_eq!(y.dims(), [1, 1, 1, 1]);
        assert_eq!(y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, [2304.0], "2-d {half}");
        let weight = Param::from_tensor(&Tensor::ones((768, 1, 3), DType::F32, &Device::Cpu)?)?;
        let config = ConvTranspose1dConfig { padding: 2, ..Default::default() };
        let mut layer = ConvTranspose1d::new(weight, None, config);
        layer.set_precision(in_precision(half));
        let y = layer.forward(&Tensor::ones((1, 768, 3), half.dtype(), &Device::Cpu)?)?;
        assert_eq!(y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, [2304.0], "1-d {half}");
    }
    Ok(())
}

#[test]
fn transposed_convs_load_what_candle_nn_constructors_create_and_match_them_in_f32() -> Result<()> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let tolerance = common::tolerance(DType::F32, 2, 4.0);
    let x = common::randn_in(7, &[2, 4, 7, 6], 1.0, DType::F32)?;
    // The configurations candle's own backward-free forward computes (its output padding below the
    // stride: candle's forward is right at any, only its backward is not).
    for (i, (config, kernel)) in configs_2d().into_iter().enumerate() {
        let theirs = candle_nn::conv_transpose2d(4, 5, kernel, config, vb.pp(format!("t2_{i}")))?;
        let ours = conv_transpose2d(4, 5, kernel, config, vb.pp(format!("t2_{i}")))?;
        let expected = theirs.forward(&x)?;
        common::assert_close(&format!("conv_transpose2d {i}"), &ours.forward(&x)?, &expected, tolerance)?;
        let forced = with_override(Override::Candle, || ours.forward(&x)).expect("candle can be forced")?;
        common::assert_close(&format!("conv_transpose2d {i} forced"), &forced, &expected, tolerance)?;
        let theirs = candle_nn::conv_transpose2d_no_bias(4, 5, kernel, config, vb.pp(format!("n2_{i}")))?;
        let ours = amp::nn::conv_transpose2d_no_bias(4, 5, kernel, config, vb.pp(format!("n2_{i}")))?;
        let what = format!("conv_transpose2d {i} no bias");
        common::assert_close(&what, &ours.forward(&x)?, &theirs.forward(&x)?, tolerance)?;
    }
    let x = common::randn_in(8, &[3, 6, 11], 1.0, DType::F32)?;
    for (i, (config, kernel)) in configs_1d().into_iter().enumerate() {
        let theirs = candle_nn::conv_transpose1d(6, 8, kernel, config, vb.pp(format!("t1_{i}")))?;
        let ours = conv_transpose1d(6, 8, kernel, config, vb.pp(format!("t1_{i}")))?;
        common::assert_close(
            &format!("conv_transpose1d {i}"),
            &ours.forward(&x)?,
            &theirs.forward(&x)?,
            tolerance,
        )?;
    }
    let ours = conv_transpose1d(6, 8, 4, configs_1d()[0].0, vb.pp("t1_0"))?;
    let names: Vec<&str> = ours.params().iter().map(|(name, _)| *name).collect();
    assert_eq!(names, ["weight", "bias"]);
    let stored =
        varmap.data().lock().unwrap().get("t1_0.weight").cloned().expect("t1_0.weight in the VarMap");
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
    let (config, kernel) = configs_2d()[0];
    let mut layer = conv_transpose2d(4, 5, kernel, config, vb.pp("t"))?;
    amp::initialize(&mut layer, AmpConfig { opt_level: OptLevel::O2, half: Precision::Bf16 })?;
    let x = common::randn_in(1, &[2, 4, 7, 6], 1.0, DType::F32)?;
    let y = layer.forward(&x)?;
    let r = common::randn_in(99, y.dims(), 1.0, DType::F32)?;
    let grads = (y.to_dtype(DType::F32)? * &r)?.sum_all()?.backward()?;
    let weight = layer.weight();
    assert!(grads.get(weight.trainable().as_tensor()).is_none(), "nothing reaches the bf16 working copy");
    let grad = weight.grad("weight", &grads)?.expect("the master's gradient");
    assert_eq!(grad.dtype(), DType::F32);
    let through_bf16 = grad.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
    assert!(
        grad.ne(&through_bf16)?.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()? > 0.0,
        "never rounded to bf16"
    );
    let bias = layer.bias().expect("a bias").master().as_tensor().clone();
    let reference = direct(&x, weight.master().as_tensor(), &bias, config.into())?;
    let expected = reference.1[1].to_dtype(DType::F32)?;
    common::assert_close(
        "O2 conv_transpose2d grad weight",
        grad,
        &expected,
        common::tolerance(DType::BF16, 3, 4.0),
    )?;
    Ok(())
}

#[test]
fn inputs_and_shapes_a_transposed_convolution_cannot_take_are_refused_with_the_reason() -> Result<()> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let layer = conv_transpose1d(3, 4, 3, ConvTranspose1dConfig::default(), vb.pp("a"))?;
    let message = |x: Tensor| layer.forward(&x).expect_err("refused").to_string();
    let err = message(Tensor::zeros((3, 10), DType::F32, &Device::Cpu)?);
    assert!(
        err.contains("(batch, channels, length), got shape [3, 10]") && err.contains("`.unsqueeze(0)`"),
        "{err}"
    );
    let err = message(Tensor::zeros((2, 5, 10), DType::F32, &Device::Cpu)?);
    assert!(err.contains("has 5 channels (shape [2, 5, 10]); the layer takes 3"), "{err}");
    assert_eq!(layer.forward(&Tensor::zeros((1, 3, 10), DType::F32, &Device::Cpu)?)?.dims(), &[1, 4, 12]);

    let layer = conv_transpose2d(3, 4, 3, ConvTranspose2dConfig::default(), vb.pp("b"))?;
    let err =
        layer.forward(&Tensor::zeros((3, 8, 8), DType::F32, &Device::Cpu)?).expect_err("rank 3").to_string();
    assert!(err.contains("(batch, channels, height, width), got shape [3, 8, 8]"), "{err}");

    // A padding that crops every output element: refused on both kernels, with the reason.
    let config = ConvTranspose2dConfig { padding: 3, ..Default::default() };
    let cropped = conv_transpose2d(3, 4, 3, config, vb.pp("c"))?;
    let x = Tensor::zeros((1, 3, 2, 2), DType::F32, &Device::Cpu)?;
    for forced in [None, Some(Override::Candle)] {
        let run = || cropped.forward(&x);
        let result = match forced {
            Some(o) => with_override(o, run).expect("candle can be forced"),
            None => run(),
        };
        let err = result.expect_err("no output element").to_string();
        assert!(err.contains("crops"), "{forced:?}: {err}");
    }

    let groups = ConvTranspose1dConfig { groups: 2, ..Default::default() };
    let err = conv_transpose1d(3, 4, 3, groups, vb.pp("d")).expect_err("3 channels in 2 groups").to_string();
    assert!(err.contains("must divide by the groups"), "{err}");
    Ok(())
}
