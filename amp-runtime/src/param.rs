//! A trainable parameter with an optional fp32 master copy.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};

use crate::error::Result;
use crate::Precision;

/// How a parameter is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ParamStorage {
    /// One fp32 tensor, trained directly (O0, O1, and fp32 layers at every level).
    Fp32,
    /// An fp32 master that the optimizer updates, and a half working copy that the forward pass reads
    /// and backward differentiates (O2).
    MasterAndWorking(Precision),
    /// One half tensor, trained directly (O3).
    Half(Precision),
}

impl ParamStorage {
    /// The dtype of the tensor that the forward pass reads and gradients are taken for.
    pub fn trainable_precision(self) -> Precision {
        match self {
            ParamStorage::Fp32 => Precision::Fp32,
            ParamStorage::MasterAndWorking(p) | ParamStorage::Half(p) => p,
        }
    }

    /// Bytes per element held in memory by this storage.
    pub fn bytes_per_element(self) -> usize {
        match self {
            ParamStorage::Fp32 => 4,
            ParamStorage::MasterAndWorking(p) => 4 + p.size_in_bytes(),
            ParamStorage::Half(p) => p.size_in_bytes(),
        }
    }
}

/// Which variable a matrix product on amp's CPU GEMM reads for a parameter, and so where backward
/// delivers the product's gradient.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum GradientRoute {
    /// The product's graph argument is the fp32 master, and it reads the half working copy's values
    /// (the master rounded to the working precision, so the forward is unchanged bit for bit); its
    /// gradient comes out of the GEMM in f32, keyed by the master: never rounded to half, and never
    /// added in half in candle's gradient store (candle adds every gradient into a fresh zero tensor,
    /// and its bf16 add runs at a tenth of its f32 add's speed). amp's CPU embedding reads its table
    /// the same way (its gradient a scatter-add in f32), and the layers whose products run there read
    /// their biases so (the gradient of a bias, a sum over the batch, stays f32). Ops
    /// that are not amp's (CUDA, candle's kernel) read the working copy as before. The default.
    #[default]
    Master,
    /// Every op reads the half working copy, whose gradient is half (Apex's O2). What
    /// `Zero1::shard_masters` sets: a rank holds the masters of its own shard only, and every rank must
    /// take gradients the same way.
    Working,
}

/// A layer parameter.
///
/// The *trainable* variable is what forward reads and what `backward` produces a gradient for (except
/// for products on amp's CPU GEMM under [`GradientRoute::Master`], whose gradient goes to the master:
/// read gradients with [`Param::grad`]). Under O2
/// it is a half working copy and [`Param::master`] is a separate fp32 variable, the source of truth that
/// optimizers update and checkpoints save; otherwise the trainable variable is its own master.
#[derive(Clone, Debug)]
pub struct Param {
    trainable: Var,
    master: Option<Var>,
    route: GradientRoute,
    link: ParamLink,
}

/// What an optimizer must know of the model that holds a parameter, shared by the parameter's clones
/// and by the optimizers that took its variables: how many times its storage was converted
/// ([`Param::set_storage`]), so that an optimizer built before `amp::initialize` converted it refuses
/// to step ([`crate::Error::StaleParams`]) rather than train variables forward never reads; and
/// whether a layer that reads it computes in fp16 now, so that a step that needs a loss scaler can
/// tell.
#[derive(Clone, Debug, Default)]
pub(crate) struct ParamLink(Arc<Shared>);

#[derive(Debug, Default)]
struct Shared {
    count: AtomicU64,
    fp16_compute: AtomicBool,
}

impl ParamLink {
    /// The conversions so far.
    pub(crate) fn conversions(&self) -> u64 {
        self.0.count.load(Ordering::Acquire)
    }

    /// Whether a layer that reads the parameter computes in fp16, as `amp::initialize` last set it.
    pub(crate) fn computes_in_fp16(&self) -> bool {
        self.0.fp16_compute.load(Ordering::Acquire)
    }

    /// Records the precision a layer that reads the parameter computes in: the first such layer of an
    /// `amp::initialize` sets the flag, the others (tied weights) can only raise it.
    pub(crate) fn record_compute(&self, compute: Precision, first: bool) {
        let fp16 = compute == Precision::Fp16;
        if first {
            self.0.fp16_compute.store(fp16, Ordering::Release);
        } else {
            self.0.fp16_compute.fetch_or(fp16, Ordering::AcqRel);
        }
    }

    fn bump(&self) {
        self.0.count.fetch_add(1, Ordering::AcqRel);
    }
}

impl Param {
    /// A parameter trained directly, in the variable's own dtype.
    pub fn new(var: Var) -> Self {
        Param { trainable: var, master: None, route: GradientRoute::default(), link: ParamLink::default() }
    }

    /// A parameter from a tensor (shares storage when the tensor already is a variable, as the tensors a
    /// `VarBuilder` over a `VarMap` returns are).
    pub fn from_tensor(tensor: &Tensor) -> Result<Self> {
        Ok(Param::new(Var::from_tensor(tensor)?))
    }

    /// The variable forward reads and gradients are taken for.
    pub fn trainable(&self) -> &Var {
        &self.trainable
    }

    /// The source of truth: the fp32 master under O2, else the trainable variable itself.
    pub fn master(&self) -> &Var {
        self.master.as_ref().unwrap_or(&self.trainable)
    }

    /// The half working copy, when there is a separate master.
    pub fn working(&self) -> Option<&Var> {
        self.master.as_ref().map(|_| &self.trainable)
    }

    /// How the parameter is stored now.
    pub fn storage(&self) -> ParamStorage {
        let trainable = Precision::from_dtype(self.trainable.dtype()).unwrap_or(Precision::Fp32);
        match (&self.master, trainable) {
            (Some(_), p) => ParamStorage::MasterAndWorking(p),
            (None, Precision::Fp32) => ParamStorage::Fp32,
            (None, p) => ParamStorage::Half(p),
        }
    }

    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.trainable.elem_count()
    }

    /// The parameter as a tensor of `precision` for use in forward: a no-op when it is stored so, else a
    /// differentiable cast (O1: the gradient flows back to the fp32 variable in fp32), served from the
    /// [`crate::CastCache`] when one is active.
    pub fn in_precision(&self, precision: Precision) -> candle_core::Result<Tensor> {
        crate::cast_cache::cast(self.trainable.as_tensor(), precision.dtype())
    }

    /// The parameter as an operand of a product computed in `compute` on `device`. On amp's CPU GEMM
    /// no cast runs (the GEMM rounds an operand to `compute` while packing it): backward differentiates
    /// the master ([`GradientRoute::Master`]), whose values the product reads from the working copy
    /// (the master rounded to the working precision: half the bytes), or, under
    /// [`GradientRoute::Working`], the trainable variable. Elsewhere it is [`Param::in_precision`].
    pub(crate) fn for_product(
        &self,
        compute: Precision,
        device: &Device,
    ) -> candle_core::Result<crate::ops::Operand> {
        if !crate::dispatch::runs_on_amp_gemm(device, compute) {
            return Ok(crate::ops::Operand::of(&self.in_precision(compute)?));
        }
        Ok(match (self.route, &self.master) {
            (GradientRoute::Master, Some(master)) => crate::ops::Operand {
                differentiated: master.as_tensor().clone(),
                values: (self.trainable.dtype() == compute.dtype())
                    .then(|| self.trainable.as_tensor().clone()),
            },
            _ => crate::ops::Operand::of(self.trainable.as_tensor()),
        })
    }

    /// The parameter in f32 as an addend of the f32 sums of a product computed in `compute` on
    /// `device` (a bias). Where the product runs on amp's CPU GEMM under [`GradientRoute::Master`],
    /// and there is a master: the working copy's values widened (the master rounded to the working
    /// precision, so the forward is unchanged bit for bit), differentiated as the master, so that the
    /// gradient (a sum over the batch, formed in f32) reaches it in f32 as the weight's does, not
    /// rounded to half by a cast's backward. Elsewhere [`Param::in_precision`] to fp32.
    pub(crate) fn as_f32_addend(&self, compute: Precision, device: &Device) -> candle_core::Result<Tensor> {
        match (self.route, &self.master) {
            (GradientRoute::Master, Some(master)) if crate::dispatch::runs_on_amp_gemm(device, compute) => {
                crate::ops::read_through_master(master.as_tensor(), self.trainable.as_tensor())
            }
            _ => self.in_precision(Precision::Fp32),
        }
    }

    /// Where products on amp's CPU GEMM take this parameter's gradient.
    pub fn gradient_route(&self) -> GradientRoute {
        self.route
    }

    /// Sets where products on amp's CPU GEMM take this parameter's gradient (for a whole model:
    /// [`crate::set_gradient_route`]).
    pub fn set_gradient_route(&mut self, route: GradientRoute) {
        self.route = route;
    }

    /// This parameter's gradient in `grads`: keyed by the working copy, or by the master when a product
    /// on amp's CPU GEMM read the master ([`GradientRoute::Master`]; then it is f32).
    ///
    /// # Errors
    /// [`crate::Error::SplitGradient`] when both hold one (the parameter was read both ways);
    /// [`crate::grads_to_masters`] adds them.
    pub fn grad<'g>(&self, path: &str, grads: &'g GradStore) -> Result<Option<&'g Tensor>> {
        crate::master::gradient(grads, path, &self.trainable, self.master())
    }

    /// Converts the storage. Keeps the master's values exactly where one exists: going from O2 back to
    /// fp32 makes the master the trainable variable; going to O2 makes the current fp32 values the master.
    pub fn set_storage(&mut self, storage: ParamStorage) -> Result<()> {
        if storage == self.storage() {
            return Ok(());
        }
        let master = self.master().clone();
        let (trainable, master) = match storage {
            ParamStorage::Fp32 => (to_var(&master, Precision::Fp32)?, None),
            ParamStorage::Half(p) => (to_var(&master, p)?, None),
            ParamStorage::MasterAndWorking(p) => {
                let master = to_var(&master, Precision::Fp32)?;
                let working = Var::from_tensor(&master.as_tensor().to_dtype(p.dtype())?.detach())?;
                (working, Some(master))
            }
        };
        (self.trainable, self.master) = (trainable, master);
        self.link.bump();
        Ok(())
    }

    /// What an optimizer that takes this parameter's variables follows of it.
    pub(crate) fn link(&self) -> &ParamLink {
        &self.link
    }

    /// Drops the fp32 master and keeps the working copy, the same variable, as the parameter's only
    /// storage (which then reads as [`ParamStorage::Half`]): ZeRO-1 with sharded masters, on the ranks
    /// that do not own this parameter. Whether there was a master.
    pub(crate) fn release_master(&mut self) -> bool {
        self.master.take().is_some()
    }

    /// Copies the master into the working copy (after an optimizer updated the master). No-op without one.
    pub fn refresh_working(&self) -> Result<()> {
        crate::CastCache::clear();
        if let Some(master) = &self.master {
            let half = master.as_tensor().to_dtype(self.trainable.dtype())?;
            self.trainable.set(&half)?;
        }
        Ok(())
    }
}

/// The variable itself when it already has `precision`, else a new variable with the converted values.
fn to_var(var: &Var, precision: Precision) -> Result<Var> {
    if var.dtype() == precision.dtype() {
        return Ok(var.clone());
    }
    Ok(Var::from_tensor(&var.as_tensor().to_dtype(precision.dtype())?.detach())?)
}
