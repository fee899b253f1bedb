//! Embedding table: row lookup `y[.., :] = W[ids[..], :]`.
//!
//! Shapes: `ids` integer `(..)`, `W` is `(vocab, hidden)`, `y` is `(.., hidden)`. A lookup does no
//! arithmetic (the table is rounded to the compute precision, as a product's operand is, and the rows
//! converted to the output dtype); the gradient is a scatter-add into `W`. On the CPU both are one op
//! ([`crate::ops::embedding`]'s): the gradient summed in f32, onto the fp32 master under O2. Elsewhere
//! candle's ops look the rows up in the f32 table, so that their gradient is summed in f32 there too.

use candle_core::{Module, Result, Tensor};
use candle_nn::{init, VarBuilder};

use crate::{LayerPrecision, Param};

/// An embedding with candle-nn's parameter name (`weight`) and initialisation (standard normal).
#[derive(Clone, Debug)]
pub struct Embedding {
    weight: Param,
    hidden: usize,
    precision: LayerPrecision,
}

/// An embedding of `vocab` rows of `hidden` values, created or loaded through `vb` like
/// `candle_nn::embedding`.
pub fn embedding(vocab: usize, hidden: usize, vb: VarBuilder<'_>) -> Result<Embedding> {
    let weight = vb.get_with_hints((vocab, hidden), "weight", init::Init::Randn { mean: 0.0, stdev: 1.0 })?;
    Embedding::new(Param::from_tensor(&weight)?)
}

impl Embedding {
    /// An embedding from an existing `(vocab, hidden)` table.
    pub fn new(weight: Param) -> Result<Self> {
        let (_, hidden) = weight.trainable().dims2()?;
        Ok(Embedding { weight, hidden, precision: LayerPrecision::FP32 })
    }

    /// The table, `(vocab, hidden)`.
    pub fn weight(&self) -> &Param {
        &self.weight
    }
}

impl Module for Embedding {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let compute = self.precision.compute.dtype();
        // Ids are integers, so "the input's dtype" means the compute dtype here.
        let out = self.precision.output.map_or(compute, |p| p.dtype());
        // On the CPU one op each way, the table read as a product reads a weight (under O2 the
        // working copy's values, the gradient summed in f32 onto the master); elsewhere candle's ops.
        let table = self.weight.for_product(self.precision.compute, ids.device())?;
        if let Some(rows) = crate::ops::embedding(&table, ids, compute, out)? {
            return Ok(rows);
        }
        let rows = self.candle_lookup(ids)?.to_dtype(compute)?;
        super::cast_output(rows, self.precision, compute)
    }
}

impl Embedding {
    /// The rows of `ids` from the table in f32, through candle's ops (off the CPU). candle's gradient of
    /// a lookup is an `index_add` into a zero table of the table's dtype, summed in that dtype: from a
    /// half table, a token seen 10,000 times would get a gradient of 256 in bf16 (2048 in fp16). From
    /// the f32 table (the table itself under O1, the working copy widened exactly under O2) the sums
    /// are f32, rounded once by the cast back; the rows, rounded to the compute dtype by the caller,
    /// have the values a lookup in the half table gives.
    fn candle_lookup(&self, ids: &Tensor) -> Result<Tensor> {
        let mut dims = ids.dims().to_vec();
        dims.push(self.hidden);
        let table = self.weight.in_precision(crate::Precision::Fp32)?;
        table.index_select(&ids.flatten_all()?, 0)?.reshape(dims)
    }
}

leaf_layer!(Embedding, "Embedding", params[weight]);

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    #[test]
    fn candles_lookup_sums_a_frequent_tokens_gradient_in_f32_from_a_half_table() -> Result<()> {
        let dev = Device::Cpu;
        for (half, want) in [(DType::BF16, 9984.0), (DType::F16, 10_000.0)] {
            // A half table, as under O2 (the working copy) or O3.
            let table = Var::from_tensor(&Tensor::ones((4, 3), half, &dev)?)?;
            let layer = Embedding::new(Param::new(table.clone()))?;
            let ids = Tensor::zeros(10_000, DType::U32, &dev)?;
            let rows = layer.candle_lookup(&ids)?;
            assert_eq!(rows.dims(), &[10_000, 3]);
            let grads = rows.to_dtype(half)?.sum_all()?.backward()?;
            let grad = grads.get(table.as_tensor()).expect("a gradient").to_dtype(DType::F32)?;
            // 10,000 ones summed in f32, rounded once to the half type (bf16's step is 64 there).
            assert_eq!(grad.get(0)?.to_vec1::<f32>()?, [want; 3], "{half:?}");
            assert_eq!(grad.get(1)?.to_vec1::<f32>()?, [0.0; 3], "{half:?}");
        }
        Ok(())
    }
}
