//! Embedding table: row lookup `y[.., :] = W[ids[..], :]`.
//!
//! Shapes: `ids` integer `(..)`, `W` is `(vocab, hidden)`, `y` is `(.., hidden)`. A lookup does no
//! arithmetic (the table is rounded to the compute precision, as a product's operand is, and the rows
//! converted to the output dtype); the gradient is a scatter-add into `W`. On the CPU both are one op
//! ([`crate::ops::embedding`]'s): the gradient summed in f32, onto the fp32 master under O2.

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
        let mut dims = ids.dims().to_vec();
        dims.push(self.hidden);
        let table = self.weight.in_precision(self.precision.compute)?;
        let rows = table.index_select(&ids.flatten_all()?, 0)?.reshape(dims)?;
        super::cast_output(rows, self.precision, compute)
    }
}

leaf_layer!(Embedding, "Embedding", params[weight]);
