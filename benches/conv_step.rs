//! Convolution layers, forward and forward + backward, on amp's GEMM (im2col, `amp::nn::Conv2d` /
//! `Conv1d`, and the transposed `ConvTranspose2d` / `ConvTranspose1d`) against candle's convolution
//! (the same layers with candle's kernel forced), measured side by side in one run: fp32 on both, and
//! bf16 on amp (candle has no CPU bf16 conv2d; forced, the layer widens bf16 to f32 and convolves in
//! f32, which is the "candle bf16" row). candle's transposed 1-d convolution has no backward: forced,
//! the layer runs candle's 2-d one at height 1, whose backward candle has.
//!
//! The input is a variable, as in the middle of a network, so the backward computes both the input's
//! and the kernel's gradients. Every contender runs in turn per round on a 2-thread rayon pool; medians.
//!
//! Run: `cargo bench --bench conv_step` (about a minute; `-- --quick` for two shapes).

use std::time::Instant;

use amp::dispatch::{self, Override};
use amp::nn::{
    Conv1d, Conv1dConfig, Conv2d, Conv2dConfig, ConvTranspose1d, ConvTranspose1dConfig, ConvTranspose2d,
    ConvTranspose2dConfig,
};
use amp::{Layer, LayerPrecision, Param, Precision};
use candle_core::{Device, Module, Result, Tensor, Var};

const ROUNDS: usize = 7;

/// A convolution layer of the sweep.
struct Shape {
    name: &'static str,
    /// Input dims: `(batch, channels, length)` or `(batch, channels, height, width)`.
    input: Vec<usize>,
    /// Output channels, kernel size.
    outputs: usize,
    kernel: usize,
    padding: usize,
    stride: usize,
    groups: usize,
    /// A transposed convolution (upsampling by the stride; its `padding` crops the output), with
    /// no output padding.
    transposed: bool,
}

impl Shape {
    fn is_1d(&self) -> bool {
        self.input.len() == 3
    }

    fn layer(&self, precision: Precision) -> Result<Box<dyn Module>> {
        if self.transposed {
            return self.transposed_layer(precision);
        }
        let channels = self.input[1] / self.groups;
        let dev = &Device::Cpu;
        let (p, s, g) = (self.padding, self.stride, self.groups);
        let mut dims = vec![self.outputs, channels, self.kernel];
        let precision = LayerPrecision { compute: precision, output: None };
        let layer: Box<dyn Module> = if self.is_1d() {
            let w = Param::from_tensor(&Tensor::randn(0f32, 0.05, dims, dev)?)?;
            let config = Conv1dConfig { padding: p, stride: s, groups: g, ..Default::default() };
            let mut conv = Conv1d::new(w, None, config);
            conv.set_precision(precision);
            Box::new(conv)
        } else {
            dims.push(self.kernel);
            let w = Param::from_tensor(&Tensor::randn(0f32, 0.05, dims, dev)?)?;
            let config = Conv2dConfig { padding: p, stride: s, groups: g, ..Default::default() };
            let mut conv = Conv2d::new(w, None, config);
            conv.set_precision(precision);
            Box::new(conv)
        };
        Ok(layer)
    }

    /// A transposed layer: weight `(in, out / groups, k[, k])`.
    fn transposed_layer(&self, precision: Precision) -> Result<Box<dyn Module>> {
        let dev = &Device::Cpu;
        let (p, s, g) = (self.padding, self.stride, self.groups);
        let output_padding = 0;
        let mut dims = vec![self.input[1], self.outputs / g, self.kernel];
        let precision = LayerPrecision { compute: precision, output: None };
        let layer: Box<dyn Module> = if self.is_1d() {
            let w = Param::from_tensor(&Tensor::randn(0f32, 0.05, dims, dev)?)?;
            let config =
                ConvTranspose1dConfig { padding: p, output_padding, stride: s, dilation: 1, groups: g };
            let mut conv = ConvTranspose1d::new(w, None, config);
            conv.set_precision(precision);
            Box::new(conv)
        } else {
            assert_eq!(g, 1, "candle-nn's ConvTranspose2dConfig has no groups");
            dims.push(self.kernel);
            let w = Param::from_tensor(&Tensor::randn(0f32, 0.05, dims, dev)?)?;
            let config = ConvTranspose2dConfig { padding: p, output_padding, stride: s, dilation: 1 };
            let mut conv = ConvTranspose2d::new(w, None, config);
            conv.set_precision(precision);
            Box::new(conv)
        };
        Ok(layer)
    }

    /// Flops of the forward's products (the backward's two products are twice as many), from the
    /// output's positions per image: a convolution's output element sums `in / groups x taps`
    /// products; a transposed one's input element spreads over `out / groups x taps` (the taps that
    /// land in the padding included: the GEMM computes them).
    fn flops(&self, output_positions: usize) -> f64 {
        let taps = self.kernel.pow(if self.is_1d() { 1 } else { 2 });
        if self.transposed {
            let input_positions: usize = self.input[2..].iter().product();
            let per_input = 2.0 * (self.outputs / self.groups * taps) as f64;
            return per_input * (self.input[0] * self.input[1] * input_positions) as f64;
        }
        let per_output = 2.0 * (self.input[1] / self.groups * taps) as f64;
        per_output * (self.input[0] * self.outputs * output_positions) as f64
    }
}

fn shapes(quick: bool) -> Vec<Shape> {
    let s = |name, input: &[usize], outputs, kernel, padding, stride, groups| Shape {
        name,
        input: input.to_vec(),
        outputs,
        kernel,
        padding,
        stride,
        groups,
        transposed: false,
    };
    let t = |name, input: &[usize], outputs, kernel, padding, stride, groups| Shape {
        transposed: true,
        ..s(name, input, outputs, kernel, padding, stride, groups)
    };
    let mut v = vec![
        s("ResNet 3x3, 56^2 x 64", &[8, 64, 56, 56], 64, 3, 1, 1, 1),
        s("conv1d k5, 2048 x 128", &[8, 128, 2048], 128, 5, 2, 1, 1),
    ];
    if !quick {
        v.extend([
            s("ResNet stem 7x7/2, 224^2 x 3", &[8, 3, 224, 224], 64, 7, 3, 2, 1),
            s("ResNet 3x3, 14^2 x 256", &[8, 256, 14, 14], 256, 3, 1, 1, 1),
            s("ResNet 1x1, 28^2 x 128 -> 512", &[8, 128, 28, 28], 512, 1, 0, 1, 1),
            s("grouped 3x3 (8 groups), 28^2 x 128", &[8, 128, 28, 28], 128, 3, 1, 1, 8),
            s("depthwise 3x3, 56^2 x 64", &[8, 64, 56, 56], 64, 3, 1, 1, 64),
            t("U-Net up 2x2/2, 28^2 x 256 -> 128", &[8, 256, 28, 28], 128, 2, 0, 2, 1),
            t("DCGAN up 4x4/2, 16^2 x 256 -> 128", &[8, 256, 16, 16], 128, 4, 1, 2, 1),
            t("vocoder up k16/8, 256 x 512 -> 256", &[8, 512, 256], 256, 16, 4, 8, 1),
        ]);
    }
    v
}

/// One contender on one shape.
struct Contender {
    name: &'static str,
    over: Override,
    layer: Box<dyn Module>,
    forward: Vec<f64>,
    step: Vec<f64>,
}

impl Contender {
    fn time(&mut self, x: &Var) -> Result<()> {
        let layer = &self.layer;
        let (forward, step) = dispatch::with_override(self.over, || -> Result<(f64, f64)> {
            let start = Instant::now();
            drop(layer.forward(x.as_tensor())?);
            let forward = start.elapsed().as_secs_f64();
            let start = Instant::now();
            let y = layer.forward(x.as_tensor())?;
            let grads = y.sum_all()?.backward()?;
            let step = start.elapsed().as_secs_f64();
            assert!(grads.get(x.as_tensor()).is_some(), "the input has a gradient");
            Ok((forward, step))
        })
        .expect("overrides are valid")?;
        self.forward.push(forward);
        self.step.push(step);
        Ok(())
    }
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

fn main() -> Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    amp::memory::retain_freed_memory();
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a 2-thread pool");
    pool.install(|| bench(quick))
}

fn bench(quick: bool) -> Result<()> {
    let dev = Device::Cpu;
    let bf16 = dispatch::explain(&dev, Precision::Bf16, dispatch::Dims::new(64, 64, 64));
    println!(
        "conv layers, forward and forward + backward (input and kernel gradients); 2 threads, {ROUNDS} rounds"
    );
    println!("bf16 products: {bf16}");
    for shape in shapes(quick) {
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, shape.input.clone(), &dev)?)?;
        let contender = |name, over, precision| -> Result<Contender> {
            Ok(Contender { name, over, layer: shape.layer(precision)?, forward: vec![], step: vec![] })
        };
        let mut contenders = vec![
            contender("candle f32", Override::Candle, Precision::Fp32)?,
            contender("amp f32", Override::Auto, Precision::Fp32)?,
            contender("candle bf16 (via f32)", Override::Candle, Precision::Bf16)?,
            contender("amp bf16", Override::Auto, Precision::Bf16)?,
        ];
        let positions =
            contenders[1].layer.forward(x.as_tensor())?.elem_count() / shape.input[0] / shape.outputs;
        for c in &mut contenders {
            c.time(&x)?; // warm-up
        }
        for _ in 0..ROUNDS {
            for c in &mut contenders {
                c.time(&x)?;
            }
        }
        let flops = shape.flops(positions);
        println!(
            "\n{}{} (input {:?}, {} outputs, kernel {}, padding {}, stride {}, groups {}): {:.2} GFLOP forward",
            if shape.transposed { "transposed: " } else { "" },
            shape.name,
            shape.input,
            shape.outputs,
            shape.kernel,
            shape.padding,
            shape.stride,
            shape.groups,
            flops / 1e9
        );
        println!(
            "  {:<24} {:>11} {:>9} {:>11} {:>9} {:>15}",
            "contender", "forward ms", "GFLOP/s", "step ms", "GFLOP/s", "step vs candle"
        );
        let candle_step = median(&contenders[0].step);
        for c in &contenders {
            let (f, s) = (median(&c.forward), median(&c.step));
            println!(
                "  {:<24} {:>11.2} {:>9.1} {:>11.2} {:>9.1} {:>14.2}x",
                c.name,
                f * 1e3,
                flops / f / 1e9,
                s * 1e3,
                3.0 * flops / s / 1e9,
                candle_step / s
            );
        }
    }
    Ok(())
}
