//! Batch normalisation over channel dimension 1, statistics in fp32:
//! `y = (x - mean) / sqrt(var + eps) * weight + bias`, per channel.
//!
//! Shapes: `x` is `(batch, channels)` or `(batch, channels, ..)` (BatchNorm1d/2d/3d alike); `weight`,
//! `bias`, `running_mean` and `running_var` are `(channels)`.
//!
//! Training ([`candle_nn::ModuleT::forward_t`] with `train = true`) normalises with the batch's own
//! mean and biased variance over every dimension but 1, and updates the running statistics as PyTorch
//! does, with the unbiased variance: `running = (1 - momentum) * running + momentum * batch`.
//! Evaluation normalises with the running statistics. Everything, the running updates included, is f32
//! whatever the input dtype; the result returns in the input's dtype (or the policy's output).
//!
//! A batch whose statistics are not finite (a NaN or an infinity in the input, an overflow upstream) is
//! not folded into the running statistics: the loss scaler skips that step, and the buffers stay as they
//! were, where PyTorch's would hold NaN from then on. A step skipped for a gradient that overflowed
//! behind finite activations still moves them, as in PyTorch: the forward runs before the scaler knows.
//!
//! The running statistics are buffers, not parameters: [`Layer::params`] lists only `weight` and
//! `bias` (what optimizers train and `amp::initialize` converts), and [`BatchNorm::buffers`] lists the
//! two statistics. They are f32 `Var`s obtained through the `VarBuilder` under candle-nn's names, so a
//! `VarMap` holds them and `VarMap::save` / `load` checkpoint them with the weights, as with candle-nn.

use candle_core::{DType, Result, Tensor, Var};
use candle_nn::{init, BatchNormConfig, ModuleT, VarBuilder};

use crate::{Layer, LayerPrecision, Param, Precision};

/// Batch normalisation with candle-nn's names (`weight`, `bias`, `running_mean`, `running_var`).
/// Pinned to fp32.
#[derive(Clone, Debug)]
pub struct BatchNorm {
    weight_and_bias: Option<(Param, Param)>,
    running_mean: Var,
    running_var: Var,
    config: BatchNormConfig,
    precision: LayerPrecision,
}

/// A batch norm over `num_features` channels, created or loaded through `vb` like
/// `candle_nn::batch_norm`: running mean zeros, running variance ones, and with `config.affine` a
/// `weight` of ones and a `bias` of zeros.
///
/// The running statistics stay linked to a `VarMap` behind `vb` when it stores f32 (the usual case);
/// from a half `VarBuilder` they are widened into new f32 variables.
pub fn batch_norm<C: Into<BatchNormConfig>>(
    num_features: usize,
    config: C,
    vb: VarBuilder<'_>,
) -> Result<BatchNorm> {
    let config = config.into();
    let running_mean =
        f32_buffer(vb.get_with_hints(num_features, "running_mean", init::Init::Const(0.0))?)?;
    let running_var = f32_buffer(vb.get_with_hints(num_features, "running_var", init::Init::Const(1.0))?)?;
    let weight_and_bias = if config.affine {
        let weight = vb.get_with_hints(num_features, "weight", init::Init::Const(1.0))?;
        let bias = vb.get_with_hints(num_features, "bias", init::Init::Const(0.0))?;
        Some((Param::from_tensor(&weight)?, Param::from_tensor(&bias)?))
    } else {
        None
    };
    BatchNorm::new(running_mean, running_var, weight_and_bias, config)
}

/// The variable itself when `t` is an f32 variable (a `VarMap`'s), else a new f32 variable.
fn f32_buffer(t: Tensor) -> Result<Var> {
    Var::from_tensor(&t.to_dtype(DType::F32)?)
}

impl BatchNorm {
    /// A batch norm from existing statistics (f32, `(channels)`) and optional `(weight, bias)`.
    /// `config.affine` is set from whether `weight_and_bias` is given.
    pub fn new(
        running_mean: Var,
        running_var: Var,
        weight_and_bias: Option<(Param, Param)>,
        mut config: BatchNormConfig,
    ) -> Result<Self> {
        let channels = running_mean.dims1()?;
        if !(0.0..=f64::INFINITY).contains(&config.eps) || !(0.0..=1.0).contains(&config.momentum) {
            candle_core::bail!(
                "batch-norm: eps {} must be >= 0, momentum {} in [0, 1]",
                config.eps,
                config.momentum
            );
        }
        let mut shapes = vec![("running_var", running_var.dims().to_vec())];
        if let Some((w, b)) = &weight_and_bias {
            shapes.push(("weight", w.trainable().dims().to_vec()));
            shapes.push(("bias", b.trainable().dims().to_vec()));
        }
        for (name, dims) in shapes {
            if dims != [channels] {
                candle_core::bail!("batch-norm: {name} has shape {dims:?}, expected [{channels}]");
            }
        }
        if running_mean.dtype() != DType::F32 || running_var.dtype() != DType::F32 {
            candle_core::bail!("batch-norm: running statistics must be f32 variables");
        }
        config.affine = weight_and_bias.is_some();
        Ok(BatchNorm { weight_and_bias, running_mean, running_var, config, precision: LayerPrecision::FP32 })
    }

    /// The running mean, `(channels)`, f32.
    pub fn running_mean(&self) -> &Var {
        &self.running_mean
    }

    /// The running (unbiased) variance, `(channels)`, f32.
    pub fn running_var(&self) -> &Var {
        &self.running_var
    }

    /// The scale and shift, `(channels)` each, when affine.
    pub fn weight_and_bias(&self) -> Option<(&Param, &Param)> {
        self.weight_and_bias.as_ref().map(|(w, b)| (w, b))
    }

    /// eps, momentum, whether the mean is removed, whether affine.
    pub fn config(&self) -> &BatchNormConfig {
        &self.config
    }

    /// Normalises with the batch statistics and updates the running ones. Works on the `(channels,
    /// rest)` view, so each channel's statistics are contiguous reductions (candle-nn's layout, which
    /// makes the running statistics bit-identical to `candle_nn::BatchNorm`'s). On the CPU each channel
    /// is a row of the fused layer norm (an RMS norm without mean removal): one pass each way, f64 statistics,
    /// so channels beyond 1.8e19, whose f32 squares overflow, are normalised too (their running
    /// variance, an f32 past `f32::MAX`, is then not updated).
    fn forward_train(&self, x: &Tensor) -> Result<Tensor> {
        let channel_major = x.transpose(0, 1)?;
        let transposed_dims = channel_major.dims().to_vec();
        let x = channel_major.flatten_from(1)?.contiguous()?;
        let count = x.dim(1)?;
        if count < 2 {
            candle_core::bail!("batch-norm: training needs more than one value per channel, got {count}");
        }
        let eps = self.config.eps;
        let fused = crate::ops::normalise_rows(&x, x.dim(0)?, self.config.remove_mean, eps)?;
        // With the fused op the statistics feed the running ones only: no graph.
        let momentum = self.config.momentum;
        let source = if fused.is_some() { x.detach() } else { x };
        let (centred, batch_mean) = match self.config.remove_mean {
            true => {
                let mean = source.mean_keepdim(1)?;
                (source.broadcast_sub(&mean)?, Some(mean))
            }
            false => (source, None),
        };
        let var = centred.sqr()?.mean_keepdim(1)?;
        let batch_mean = batch_mean.map(|mean| mean.detach().flatten_all()? * momentum).transpose()?;
        // The unbiased variance, with Bessel's factor folded into the momentum weight.
        let unbiased = (var.detach().flatten_all()? * (momentum * count as f64 / (count - 1) as f64))?;
        self.update_running_statistics(batch_mean.as_ref(), &unbiased, momentum)?;
        let normed = match fused {
            Some(normed) => normed,
            None => centred.broadcast_div(&(var + eps)?.sqrt()?)?,
        };
        let y = self.affine(normed, 0)?;
        y.reshape(transposed_dims)?.transpose(0, 1)
    }

    /// Folds a batch's (momentum-weighted) statistics into the running ones, unless one of them is not
    /// finite: a NaN in the input or an overflow upstream, whose step the loss scaler skips, then leaves
    /// the running statistics as they were (PyTorch's would hold NaN from then on). Decided on the
    /// device, all statistics or none, without reading them back.
    fn update_running_statistics(
        &self,
        batch_mean: Option<&Tensor>,
        unbiased: &Tensor,
        momentum: f64,
    ) -> Result<()> {
        // `0 * t` is 0 where `t` is finite and NaN elsewhere; its sum is 0 exactly when all are finite.
        let mut not_finite = (unbiased * 0.0)?.sum_all()?;
        if let Some(mean) = batch_mean {
            not_finite = (not_finite + (mean * 0.0)?.sum_all()?)?;
        }
        let finite = not_finite.eq(0f64)?.broadcast_as(unbiased.shape())?;
        let fold = |running: &Var, batch: &Tensor| -> Result<()> {
            let updated = ((running.as_tensor() * (1.0 - momentum))? + batch)?;
            running.set(&finite.where_cond(&updated, running.as_tensor())?)
        };
        if let Some(mean) = batch_mean {
            fold(&self.running_mean, mean)?;
        }
        fold(&self.running_var, unbiased)
    }

    /// Normalises with the running statistics.
    fn forward_eval(&self, x: &Tensor) -> Result<Tensor> {
        let mut stat_shape = vec![1; x.rank()];
        stat_shape[1] = self.running_mean.elem_count();
        let stat_shape = stat_shape.as_slice();
        let mean = self.running_mean.as_detached_tensor().reshape(stat_shape)?;
        let std = (self.running_var.as_detached_tensor().reshape(stat_shape)? + self.config.eps)?.sqrt()?;
        let centered = if self.config.remove_mean { x.broadcast_sub(&mean)? } else { x.clone() };
        self.affine(centered.broadcast_div(&std)?, 1)
    }

    /// `normed * weight[c] + bias[c]` when affine, with the channels `c` on dimension `channel_dim`.
    fn affine(&self, normed: Tensor, channel_dim: usize) -> Result<Tensor> {
        let Some((weight, bias)) = &self.weight_and_bias else { return Ok(normed) };
        let (weight, bias) = (weight.in_precision(Precision::Fp32)?, bias.in_precision(Precision::Fp32)?);
        if let Some(y) = crate::ops::channel_affine(&normed, channel_dim, &weight, &bias)? {
            return Ok(y);
        }
        let mut stat_shape = vec![1; normed.rank()];
        stat_shape[channel_dim] = weight.elem_count();
        let stat_shape = stat_shape.as_slice();
        normed.broadcast_mul(&weight.reshape(stat_shape)?)?.broadcast_add(&bias.reshape(stat_shape)?)
    }
}

impl ModuleT for BatchNorm {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        let channels = self.running_mean.elem_count();
        if xs.rank() < 2 || xs.dim(1)? != channels {
            candle_core::bail!("batch-norm: input {:?} needs dim 1 of size {channels}", xs.shape());
        }
        let x = xs.to_dtype(DType::F32)?;
        let y = if train { self.forward_train(&x)? } else { self.forward_eval(&x)? };
        super::cast_output(y, self.precision, xs.dtype())
    }
}

impl Layer for BatchNorm {
    fn kind(&self) -> &'static str {
        "BatchNorm"
    }
    fn pinned_fp32(&self) -> bool {
        true
    }
    fn params(&self) -> Vec<(&'static str, &Param)> {
        self.weight_and_bias.iter().flat_map(|(w, b)| [("weight", w), ("bias", b)]).collect()
    }
    fn params_mut(&mut self) -> Vec<(&'static str, &mut Param)> {
        self.weight_and_bias.iter_mut().flat_map(|(w, b)| [("weight", w), ("bias", b)]).collect()
    }
    fn precision(&self) -> LayerPrecision {
        self.precision
    }
    fn set_precision(&mut self, precision: LayerPrecision) {
        self.precision = LayerPrecision { compute: Precision::Fp32, ..precision };
    }
    /// The running statistics, checkpointed with the parameters.
    fn buffers(&self) -> Vec<(&'static str, &Var)> {
        vec![("running_mean", &self.running_mean), ("running_var", &self.running_var)]
    }
}

crate::layer_module!(BatchNorm, pinned_fp32);
