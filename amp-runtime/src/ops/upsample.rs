//! Bilinear upsampling with a backward: candle 0.11.1's `upsample_bilinear2d` computes PyTorch's values
//! but cannot be differentiated ("backward not supported for upsample_bilinear2d"), so the layers before
//! a U-Net's, an FPN's or a segmentation head's resize never train through it.
//!
//! The same interpolation (PyTorch's `interpolate(mode="bilinear")`: source coordinate
//! `(o + 0.5) in / out - 0.5`, clamped at 0, or `o (in - 1) / (out - 1)` with `align_corners`), written
//! as differentiable candle ops, one spatial dimension at a time: the two neighbouring rows gathered
//! with `index_select` and blended, `a (1 - t) + b t`, then the columns. It runs on any device; the
//! blend is computed in f32 (f64 for f64 input) and rounded once into the input's dtype, so a bf16
//! image is not blended in bf16. The backward is candle's for those ops: each output's gradient
//! spread over its four sources with the same weights.

use candle_core::{DType, Result, Tensor};

/// `x` `(batch, channels, height, width)` resized to `(target_h, target_w)` by bilinear
/// interpolation, as candle's `Tensor::upsample_bilinear2d` (the same arguments and values, to f32
/// rounding), differentiable.
///
/// # Errors
/// When `x` is not rank 4, or a size (given or target) is 0.
///
/// ```
/// use amp_runtime::ops;
/// use candle_core::{Device, Tensor};
///
/// let x = Tensor::new(&[[[[0f32, 4.0]]]], &Device::Cpu)?; // 1 x 2
/// let y = ops::upsample_bilinear2d(&x, 1, 4, false)?;
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, [0.0, 1.0, 3.0, 4.0]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn upsample_bilinear2d(
    x: &Tensor,
    target_h: usize,
    target_w: usize,
    align_corners: bool,
) -> Result<Tensor> {
    let (_, _, height, width) = dims(x)?;
    let rows = Axis { input: height, output: target_h, align_corners, scale: None };
    let cols = Axis { input: width, output: target_w, align_corners, scale: None };
    resize(x, rows, cols)
}

/// [`upsample_bilinear2d`] by scale factors, as candle's `Tensor::upsample_bilinear2d_with_scale`: the
/// output `floor(size * scale)`, source coordinates from the factor (PyTorch's `scale_factor`); an
/// unchanged size returns `x` as it is (candle's rule).
///
/// # Errors
/// As [`upsample_bilinear2d`], and for a factor that is not finite and positive.
pub fn upsample_bilinear2d_with_scale(
    x: &Tensor,
    scale_h: f64,
    scale_w: f64,
    align_corners: bool,
) -> Result<Tensor> {
    let (_, _, height, width) = dims(x)?;
    for scale in [scale_h, scale_w] {
        if !(scale.is_finite() && scale > 0.0) {
            candle_core::bail!(
                "upsample_bilinear2d_with_scale: a scale factor of {scale} (finite and positive)"
            );
        }
    }
    let (target_h, target_w) =
        ((height as f64 * scale_h).floor() as usize, (width as f64 * scale_w).floor() as usize);
    if (target_h, target_w) == (height, width) {
        return Ok(x.clone());
    }
    let rows = Axis { input: height, output: target_h, align_corners, scale: Some(scale_h) };
    let cols = Axis { input: width, output: target_w, align_corners, scale: Some(scale_w) };
    resize(x, rows, cols)
}

fn dims(x: &Tensor) -> Result<(usize, usize, usize, usize)> {
    let &[batch, channels, height, width] = x.dims() else {
        candle_core::bail!(
            "upsample_bilinear2d: the input must be (batch, channels, height, width), got shape {:?}; a \
             single image is a batch of one: `.unsqueeze(0)`",
            x.dims()
        );
    };
    if height == 0 || width == 0 {
        candle_core::bail!("upsample_bilinear2d: an empty image, shape {:?}", x.dims());
    }
    Ok((batch, channels, height, width))
}

/// One spatial dimension's resize.
#[derive(Clone, Copy, Debug)]
struct Axis {
    input: usize,
    output: usize,
    align_corners: bool,
    /// The scale factor the size came from, when it came from one.
    scale: Option<f64>,
}

impl Axis {
    /// Input elements per output element, as PyTorch's `area_pixel_compute_scale`.
    fn step(&self) -> f64 {
        match (self.align_corners, self.scale) {
            (true, _) if self.output > 1 => (self.input - 1) as f64 / (self.output - 1) as f64,
            (true, _) => 0.0,
            (false, Some(scale)) => 1.0 / scale,
            (false, None) => self.input as f64 / self.output as f64,
        }
    }

    /// For each output element: its two neighbouring input elements and the second's weight.
    fn sources(&self) -> (Vec<u32>, Vec<u32>, Vec<f64>) {
        let step = self.step();
        let mut sources = (Vec::new(), Vec::new(), Vec::new());
        for o in 0..self.output {
            let at = if self.align_corners { step * o as f64 } else { step * (o as f64 + 0.5) - 0.5 };
            let at = at.max(0.0);
            let first = (at.floor() as usize).min(self.input - 1);
            let second = (first + 1).min(self.input - 1);
            sources.0.push(first as u32);
            sources.1.push(second as u32);
            sources.2.push((at - first as f64).clamp(0.0, 1.0));
        }
        sources
    }

    /// `x` resized along dimension `dim`: each output element blends its two sources.
    fn apply(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        if self.input == self.output && self.scale.is_none() {
            return Ok(x.clone());
        }
        let (first, second, weight) = self.sources();
        let device = x.device();
        let index = |v: Vec<u32>| Tensor::from_vec(v, self.output, device);
        let mut shape = vec![1; x.rank()];
        shape[dim] = self.output;
        let weight = Tensor::from_vec(weight, shape, device)?.to_dtype(x.dtype())?;
        let (a, b) = (x.index_select(&index(first)?, dim)?, x.index_select(&index(second)?, dim)?);
        a.broadcast_mul(&weight.affine(-1.0, 1.0)?)?.add(&b.broadcast_mul(&weight)?)
    }
}

/// Rows, then columns, blended in at least f32 and rounded once into `x`'s dtype.
fn resize(x: &Tensor, rows: Axis, cols: Axis) -> Result<Tensor> {
    if rows.output == 0 || cols.output == 0 {
        candle_core::bail!("upsample_bilinear2d: a target size of {} x {}", rows.output, cols.output);
    }
    let work = if x.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
    let y = cols.apply(&rows.apply(&x.to_dtype(work)?, 2)?, 3)?;
    y.to_dtype(x.dtype())
}
