//! Bilinear upsampling with a backward: candle 0.11.1's `upsample_bilinear2d` computes PyTorch's values
//! but cannot be differentiated ("backward not supported for upsample_bilinear2d"), so the layers before
//! a U-Net's, an FPN's or a segmentation head's resize never train through it.
//!
//! The same interpolation (PyTorch's `interpolate(mode="bilinear")`: source coordinate
//! `(o + 0.5) in / out - 0.5`, clamped at 0, or `o (in - 1) / (out - 1)` with `align_corners`), one
//! spatial dimension at a time: each output row blends its two neighbouring input rows,
//! `a (1 - t) + b t`, then each output column two columns of that. In f32 (f64 for f64 input), rounded
//! once into the input's dtype, so a bf16 image is not blended in bf16. On the CPU one op each way
//! ([`amp_kernels::resize`]; the backward spreads each output's gradient over its four sources with the
//! same weights); elsewhere (CUDA, f64) the same blend as differentiable candle ops (`index_select`, a
//! broadcast product and a sum), whose forward gives the same bits in f32.

use amp_kernels::resize::{self, Planes, Taps};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

use super::elementwise::{elements, kernel_dtype, new_storage_in_planes, part};
use super::input::Input;

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
    let [batch, channels, height, width] = Input::image("upsample_bilinear2d", x.dims())?;
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

    /// For each output element: its two neighbouring input elements and the second's weight (computed
    /// in f64, rounded once to f32).
    fn taps(&self) -> Taps {
        let step = self.step();
        let mut taps = Taps::default();
        for o in 0..self.output {
            let at = if self.align_corners { step * o as f64 } else { step * (o as f64 + 0.5) - 0.5 };
            let at = at.max(0.0);
            let first = (at.floor() as usize).min(self.input - 1);
            taps.first.push(first as u32);
            taps.second.push((first + 1).min(self.input - 1) as u32);
            taps.weight.push((at - first as f64).clamp(0.0, 1.0) as f32);
        }
        taps
    }

    /// `x` resized along dimension `dim` with candle ops: each output element blends its two sources.
    fn apply(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        if self.input == self.output && self.scale.is_none() {
            return Ok(x.clone());
        }
        let Taps { first, second, weight } = self.taps();
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
    if x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        let op = BilinearOp { rows: rows.taps(), cols: cols.taps() };
        return x.contiguous()?.apply_op1(op);
    }
    let work = if x.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
    let y = cols.apply(&rows.apply(&x.to_dtype(work)?, 2)?, 3)?;
    y.to_dtype(x.dtype())
}

/// The CPU op: `(batch, channels, height, width)` to `(batch, channels, rows, cols)`.
#[derive(Clone, Debug)]
struct BilinearOp {
    rows: Taps,
    cols: Taps,
}

impl BilinearOp {
    /// `count` planes of the input's `height x width`.
    fn planes(&self, count: usize, dims: &[usize]) -> Planes<'_> {
        Planes { count, height: dims[2], width: dims[3], rows: &self.rows, cols: &self.cols }
    }
}

impl CustomOp1 for BilinearOp {
    fn name(&self) -> &'static str {
        "amp-upsample-bilinear"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = elements(storage, layout)?;
        let dims = layout.dims();
        let (plane_in, plane_out) = (dims[2] * dims[3], self.rows.len() * self.cols.len());
        let y = new_storage_in_planes(x.dtype(), dims[0] * dims[1], plane_out, |first, y| {
            let planes = y.len() / plane_out;
            let x = part(x, first * plane_in, planes * plane_in);
            resize::bilinear_forward(&self.planes(planes, dims), x, y);
        });
        Ok((y, Shape::from((dims[0], dims[1], self.rows.len(), self.cols.len()))))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(dy.contiguous()?.apply_op1_no_bwd(&BilinearBackward { op: self.clone(), x: x.clone() })?))
    }
}

/// `dx` in `x`'s dtype and shape from `dy`.
struct BilinearBackward {
    op: BilinearOp,
    x: Tensor,
}

impl CustomOp1 for BilinearBackward {
    fn name(&self) -> &'static str {
        "amp-upsample-bilinear-backward"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let dy = elements(storage, layout)?;
        let dims = self.x.dims();
        let (plane_in, plane_out) = (dims[2] * dims[3], self.op.rows.len() * self.op.cols.len());
        let dtype = kernel_dtype(self.x.dtype())?;
        let dx = new_storage_in_planes(dtype, dims[0] * dims[1], plane_in, |first, dx| {
            let planes = dx.len() / plane_in;
            let dy = part(dy, first * plane_out, planes * plane_out);
            resize::bilinear_backward(&self.op.planes(planes, dims), dy, dx);
        });
        Ok((dx, self.x.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::Axis;
    use candle_core::{DType, Device, Result, Tensor};

    /// The CPU op and the candle ops other devices run compute the same f32 operations in the same
    /// order: the same bits, forward.
    #[test]
    fn the_cpu_op_and_the_composed_ops_give_the_same_bits() -> Result<()> {
        let x = Tensor::randn(0f32, 1.0, (2, 3, 7, 9), &Device::Cpu)?;
        for (rows, cols) in [((7, 14), (9, 18)), ((7, 5), (9, 23)), ((7, 1), (9, 9))] {
            for align_corners in [false, true] {
                let axis = |(input, output)| Axis { input, output, align_corners, scale: None };
                let (rows, cols) = (axis(rows), axis(cols));
                let fused = super::resize(&x, rows, cols)?;
                let composed = cols.apply(&rows.apply(&x, 2)?, 3)?;
                let bits = |t: &Tensor| -> Result<Vec<u32>> {
                    Ok(t.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
                };
                assert_eq!(bits(&fused)?, bits(&composed)?, "{rows:?} {cols:?}");
                assert_eq!(fused.dtype(), DType::F32);
            }
        }
        Ok(())
    }
}
