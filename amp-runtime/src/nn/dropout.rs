//! Dropout: in training, each element is zeroed with probability `p` and the survivors scaled by
//! `1 / (1 - p)`, so the expectation is unchanged; in evaluation it is the identity.
//!
//! The uniform draws, the keep mask and the scale are f32; the product `x * mask / (1 - p)` is formed in
//! f32 from the input as given and rounded once to the compute precision (the scale is not rounded to half first, as PyTorch's
//! half dropout also multiplies in its f32 "opmath" type). The gradient is the same mask and scale.
//! In evaluation the input passes through unrounded (cast only to the policy's output precision, if set).

use candle_core::{DType, Result, Tensor};
use candle_nn::ModuleT;

use crate::{HalfSafe, Layer, LayerPrecision, Param};

/// Dropout with drop probability `p`. No parameters; half-safe.
#[derive(Clone, Debug)]
pub struct Dropout {
    p: f32,
    precision: LayerPrecision,
}

impl Dropout {
    /// Dropout that zeroes elements with probability `p`, `0 <= p < 1`.
    pub fn new(p: f32) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            candle_core::bail!("dropout: p must be in [0, 1), got {p}");
        }
        Ok(Dropout { p, precision: LayerPrecision::FP32 })
    }

    /// The drop probability.
    pub fn p(&self) -> f32 {
        self.p
    }
}

impl ModuleT for Dropout {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        if !train || self.p == 0.0 {
            // The identity: no rounding to the compute precision, which would only lose bits.
            return super::cast_output(xs.clone(), self.precision, xs.dtype());
        }
        let draws = Tensor::rand(0f32, 1f32, xs.shape(), xs.device())?;
        let keep = draws.ge(self.p)?.to_dtype(DType::F32)?;
        let multiplier = (keep * (1.0 / (1.0 - self.p as f64)))?;
        let x = crate::ops::widen(xs)?;
        let y = x.mul(&multiplier.to_dtype(x.dtype())?)?.to_dtype(self.precision.compute.dtype())?;
        super::cast_output(y, self.precision, xs.dtype())
    }
}

impl Layer for Dropout {
    fn kind(&self) -> &'static str {
        "Dropout"
    }
    fn pinned_fp32(&self) -> bool {
        false
    }
    fn params(&self) -> Vec<(&'static str, &Param)> {
        Vec::new()
    }
    fn params_mut(&mut self) -> Vec<(&'static str, &mut Param)> {
        Vec::new()
    }
    fn precision(&self) -> LayerPrecision {
        self.precision
    }
    fn set_precision(&mut self, precision: LayerPrecision) {
        self.precision = precision;
    }
}

#[diagnostic::do_not_recommend]
impl HalfSafe for Dropout {}
crate::layer_module!(Dropout);
