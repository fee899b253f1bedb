//! Max and average pooling with padding and overlapping windows, differentiable.
//!
//! candle 0.11.1's `max_pool2d` and `avg_pool2d` take no padding, and their backward refuses any window
//! whose size differs from its stride ("backward not supported for maxpool2d if ksize != stride"): a
//! ResNet's stem pool (3 x 3, stride 2, padding 1) cannot train through them. These take PyTorch's
//! arguments and semantics (`torch.nn.functional.max_pool2d` / `avg_pool2d` with `ceil_mode` off, the
//! average counting the padding: `count_include_pad`, PyTorch's default).
//!
//! On the CPU one op each way ([`amp_kernels::pool`]): values widened to f32 a plane at a time, results
//! and gradients rounded once into the input's dtype, sums in f32 in a fixed order (so the same bits
//! whatever the threads). A max window routes its gradient to its first maximum, as PyTorch's does.
//! Elsewhere (CUDA, f64) the same windows are gathered with candle's `index_select`, then each window's
//! first maximum gathered at its `argmax` (so its gradient goes there alone, as on the CPU), or its
//! values summed in at least f32.

use amp_kernels::conv::ConvShape;
use amp_kernels::pool;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor, ToUsize2};

use super::elementwise::{elements, new_storage_in_planes, part};
use super::input::Input;

/// Max pooling of `x` `(batch, channels, height, width)` over `kernel` windows (one size, or
/// `(height, width)`) every `stride` positions, with `padding` on every side that no window takes
/// its maximum from. The result is `(batch, channels, oh, ow)`, `o = (i + 2 padding - kernel) / stride +
/// 1` per dimension, in `x`'s dtype; differentiable (each window's gradient to its first maximum).
///
/// # Errors
/// When `x` is not rank 4, a kernel size or stride is 0, a padding exceeds half its window (PyTorch's
/// rule: a window would lie wholly in the padding), or a window is larger than the padded input.
///
/// ```
/// use amp_runtime::ops;
/// use candle_core::{Device, Tensor};
///
/// // ResNet's stem pool on a 4 x 4 plane: 3 x 3 windows, stride 2, padding 1.
/// let x = Tensor::arange(0f32, 16.0, &Device::Cpu)?.reshape((1, 1, 4, 4))?;
/// let y = ops::max_pool2d(&x, 3, 2, 1)?;
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, [5.0, 7.0, 13.0, 15.0]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn max_pool2d(
    x: &Tensor,
    kernel: impl ToUsize2,
    stride: impl ToUsize2,
    padding: impl ToUsize2,
) -> Result<Tensor> {
    Window::new(Kind::Max, kernel, stride, padding).apply("max_pool2d", x)
}

/// Average pooling of `x` `(batch, channels, height, width)`: each window's sum divided by its size,
/// the padding counted as zeros (PyTorch's `count_include_pad`). Arguments, result and errors as
/// [`max_pool2d`]'s; the sums run in f32 whatever `x`'s dtype.
pub fn avg_pool2d(
    x: &Tensor,
    kernel: impl ToUsize2,
    stride: impl ToUsize2,
    padding: impl ToUsize2,
) -> Result<Tensor> {
    Window::new(Kind::Avg, kernel, stride, padding).apply("avg_pool2d", x)
}

/// [`max_pool2d`] over the last dimension of `x` `(batch, channels, length)`.
pub fn max_pool1d(x: &Tensor, kernel: usize, stride: usize, padding: usize) -> Result<Tensor> {
    Window::new(Kind::Max, (1, kernel), (1, stride), (0, padding)).apply_1d("max_pool1d", x)
}

/// [`avg_pool2d`] over the last dimension of `x` `(batch, channels, length)`.
pub fn avg_pool1d(x: &Tensor, kernel: usize, stride: usize, padding: usize) -> Result<Tensor> {
    Window::new(Kind::Avg, (1, kernel), (1, stride), (0, padding)).apply_1d("avg_pool1d", x)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Max,
    Avg,
}

/// A pooling window: its kind, and per spatial dimension (`[height, width]`) its size, stride and
/// padding.
#[derive(Clone, Copy, Debug)]
struct Window {
    kind: Kind,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
}

impl Window {
    fn new(kind: Kind, kernel: impl ToUsize2, stride: impl ToUsize2, padding: impl ToUsize2) -> Self {
        let pair = |v: (usize, usize)| [v.0, v.1];
        Window {
            kind,
            kernel: pair(kernel.to_usize2()),
            stride: pair(stride.to_usize2()),
            padding: pair(padding.to_usize2()),
        }
    }

    fn apply_1d(self, name: &str, x: &Tensor) -> Result<Tensor> {
        Input::Sequence.check_rank(name, x.dims())?;
        self.apply(name, &x.unsqueeze(2)?)?.squeeze(2)
    }

    fn apply(self, name: &str, x: &Tensor) -> Result<Tensor> {
        let shape = self.shape(name, x.dims())?;
        if !x.dtype().is_float() {
            candle_core::bail!("{name}: pools floats, got {:?}", x.dtype());
        }
        let fused = x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16);
        if fused {
            x.contiguous()?.apply_op1(PoolOp { window: self, shape })
        } else {
            self.gathered(x, &shape)
        }
    }

    /// The kernels' geometry for input dims `(batch, channels, height, width)`: a plane per channel of
    /// each image. Refuses what PyTorch refuses, in `name`'s terms.
    fn shape(&self, name: &str, dims: &[usize]) -> Result<ConvShape> {
        let [batch, channels, height, width] = Input::image(name, dims)?;
        let (kernel, stride, padding) = (self.kernel, self.stride, self.padding);
        if kernel.contains(&0) || stride.contains(&0) {
            candle_core::bail!("{name}: kernel {kernel:?} and stride {stride:?} must be at least 1");
        }
        if (0..2).any(|d| padding[d] > kernel[d] / 2) {
            candle_core::bail!(
                "{name}: padding {padding:?} exceeds half the window {kernel:?}: a window would lie wholly \
                 in the padding (PyTorch refuses it too)"
            );
        }
        let shape = ConvShape { kernel, padding, stride, ..ConvShape::new(batch * channels, height, width) };
        if shape.output().is_none() || height == 0 || width == 0 {
            candle_core::bail!(
                "{name}: window {kernel:?} larger than the input {dims:?} padded by {padding:?} (or an empty \
                 input)"
            );
        }
        Ok(shape)
    }

    /// The pooling composed of candle ops: each window's values gathered from the padded planes with
    /// `index_select`, then their first maximum, or their sum in at least f32 divided by the window's
    /// size.
    fn gathered(&self, x: &Tensor, shape: &ConvShape) -> Result<Tensor> {
        let (batch, channels, height, width) = x.dims4()?;
        let [rows, cols] = shape.output().unwrap_or_default();
        let [pad_h, pad_w] = self.padding;
        let fill = if self.kind == Kind::Max { f64::NEG_INFINITY } else { 0.0 };
        let padded = pad(&pad(x, 2, pad_h, fill)?, 3, pad_w, fill)?;
        let padded_width = width + 2 * pad_w;
        let planes = padded.reshape((batch * channels, (height + 2 * pad_h) * padded_width))?;
        let taps = self.kernel[0] * self.kernel[1];
        let mut at = Vec::with_capacity(rows * cols * taps);
        for (oh, ow) in (0..rows).flat_map(|oh| (0..cols).map(move |ow| (oh, ow))) {
            for (i, j) in (0..self.kernel[0]).flat_map(|i| (0..self.kernel[1]).map(move |j| (i, j))) {
                let (h, w) = (oh * self.stride[0] + i, ow * self.stride[1] + j);
                at.push(u32::try_from(h * padded_width + w).map_err(candle_core::Error::wrap)?);
            }
        }
        let at = Tensor::from_vec(at, rows * cols * taps, x.device())?;
        let windows = planes.index_select(&at, 1)?.reshape((batch * channels, rows * cols, taps))?;
        let pooled = match self.kind {
            // The first maximum, gathered: its gradient goes to it alone (candle's `max` would share it
            // between tied maxima).
            Kind::Max => windows.gather(&windows.argmax_keepdim(2)?, 2)?.squeeze(2)?,
            Kind::Avg => {
                let wide = if x.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
                (windows.to_dtype(wide)?.sum(2)? / taps as f64)?.to_dtype(x.dtype())?
            }
        };
        pooled.reshape((batch, channels, rows, cols))
    }
}

/// `x` with `n` elements of value `fill` before and after its dimension `dim`.
fn pad(x: &Tensor, dim: usize, n: usize, fill: f64) -> Result<Tensor> {
    if n == 0 {
        return Ok(x.clone());
    }
    let mut dims = x.dims().to_vec();
    dims[dim] = n;
    let side = Tensor::full(fill, dims, x.device())?.to_dtype(x.dtype())?;
    Tensor::cat(&[&side, x, &side], dim)
}

/// The candle op of a pooling on the CPU: forward, and a backward that is one more op.
#[derive(Clone, Copy, Debug)]
struct PoolOp {
    window: Window,
    shape: ConvShape,
}

impl PoolOp {
    fn output_dims(&self, dims: &[usize]) -> Shape {
        let [rows, cols] = self.shape.output().unwrap_or_default();
        (dims[0], dims[1], rows, cols).into()
    }

    /// Output elements per plane.
    fn plane_out(&self) -> usize {
        self.shape.output().map_or(0, |[rows, cols]| rows * cols)
    }

    /// The geometry of `count` of the planes.
    fn planes(&self, count: usize) -> ConvShape {
        ConvShape { channels: count, ..self.shape }
    }
}

impl CustomOp1 for PoolOp {
    fn name(&self) -> &'static str {
        match self.window.kind {
            Kind::Max => "amp-max-pool",
            Kind::Avg => "amp-avg-pool",
        }
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = elements(storage, layout)?;
        let (plane_in, plane_out) = (self.shape.height * self.shape.width, self.plane_out());
        let y = new_storage_in_planes(x.dtype(), self.shape.channels, plane_out, |first, y| {
            let planes = y.len() / plane_out;
            let (shape, x) = (self.planes(planes), part(x, first * plane_in, planes * plane_in));
            match self.window.kind {
                Kind::Max => pool::max_forward(&shape, x, y),
                Kind::Avg => pool::avg_forward(&shape, x, y),
            }
        });
        Ok((y, self.output_dims(layout.dims())))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(&dy.contiguous()?, &PoolBackward(*self))?))
    }
}

/// `dx` in `x`'s dtype from `(x, dy)`.
struct PoolBackward(PoolOp);

impl CustomOp2 for PoolBackward {
    fn name(&self) -> &'static str {
        match self.0.window.kind {
            Kind::Max => "amp-max-pool-backward",
            Kind::Avg => "amp-avg-pool-backward",
        }
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, dy) = (elements(xs, xl)?, elements(gs, gl)?);
        let op = &self.0;
        let (plane_in, plane_out) = (op.shape.height * op.shape.width, op.plane_out());
        let dx = new_storage_in_planes(x.dtype(), op.shape.channels, plane_in, |first, dx| {
            let planes = dx.len() / plane_in.max(1);
            let shape = op.planes(planes);
            let dy = part(dy, first * plane_out, planes * plane_out);
            match op.window.kind {
                Kind::Max => pool::max_backward(&shape, part(x, first * plane_in, dx.len()), dy, dx),
                Kind::Avg => pool::avg_backward(&shape, dy, dx),
            }
        });
        Ok((dx, xl.shape().clone()))
    }
}
