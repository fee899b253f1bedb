//! The data-parallel training step: the fused step's protocol with the gradient all-reduce after
//! backward and one agreed verdict before the optimizer.

use candle_core::backprop::GradStore;
use candle_core::Tensor;

use super::communicator::Communicator;
use super::data_parallel::{
    agree_lowest, agree_same_parameters, all_reduce_gradients, broadcast_masters, DataParallelConfig,
};
use crate::error::Result;
use crate::optim::FusedOptimizer;
use crate::scaler::stages::{Findings, StepStages};
use crate::scaler::{GradScaler, SkipReason, StepReport};
use crate::AmpModule;

/// Kinds of finding in the agreement word, the most severe largest (the verdict reports that one).
const LOSS: u32 = 3;
const OWN_GRADIENT: u32 = 2;
const REDUCED_GRADIENT: u32 = 1;

/// Data-parallel training over a [`Communicator`]: every rank holds the whole model, trains on its own
/// share of each batch, and takes the same step with gradients averaged over the ranks.
///
/// A step ([`step_fused`](Self::step_fused)) is [`GradScaler::step_fused`]'s protocol with two stages
/// added: after backward, this rank's gradients are checked for inf/NaN and averaged over all ranks
/// ([`all_reduce_gradients`]); before the verdict, every rank's findings (its loss, its own gradients,
/// the reduced gradients) go through one MAX all-reduce of one word, so all ranks skip or apply
/// together and their loss scales move alike. A rank whose loss is not finite still runs backward: its
/// peers wait for its gradients.
///
/// ```
/// use amp_runtime::distributed::{DataParallel, DataParallelConfig, SingleProcess};
/// use amp_runtime::nn::{linear, Linear};
/// use amp_runtime::optim::{AdamConfig, FusedAdamW, ParamGroups};
/// use amp_runtime::scaler::ScalerConfig;
/// use amp_runtime::{AmpConfig, GradScaler, OptLevel};
/// use candle_core::{DType, Device, Module, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
///
/// # fn main() -> amp_runtime::Result<()> {
/// let comm = SingleProcess::new(); // `Mpi::init()?` under mpirun (feature `mpi`)
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// let mut model: Vec<Linear> = vec![linear(4, 2, vb.pp("fc"))?];
/// amp_runtime::initialize(&mut model, AmpConfig::new(OptLevel::O2, &Device::Cpu))?;
/// let mut dp = DataParallel::new(&comm, DataParallelConfig::default())?;
/// dp.broadcast_masters(&model)?; // every rank starts from rank 0's weights
/// let mut optimizer = FusedAdamW::new(ParamGroups::from_model(&model)?, AdamConfig::default())?;
/// let mut scaler = GradScaler::for_model(&model, ScalerConfig::default())?;
/// let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?; // this rank's share of the batch
/// let loss = model[0].forward(&x)?.sqr()?.mean_all()?;
/// let report = dp.step_fused(&mut scaler, &loss, &mut optimizer, None)?;
/// assert!(report.applied());
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct DataParallel<'c> {
    comm: &'c dyn Communicator,
    config: DataParallelConfig,
}

impl<'c> DataParallel<'c> {
    /// Data parallelism over `comm` with `config`.
    ///
    /// # Errors
    /// [`Error::InvalidDataParallelConfig`](crate::Error::InvalidDataParallelConfig).
    pub fn new(comm: &'c dyn Communicator, config: DataParallelConfig) -> Result<Self> {
        config.validate()?;
        Ok(DataParallel { comm, config })
    }

    /// The group.
    pub fn communicator(&self) -> &'c dyn Communicator {
        self.comm
    }

    /// The settings.
    pub fn config(&self) -> &DataParallelConfig {
        &self.config
    }

    /// [`broadcast_masters`] over this group: call once after `amp::initialize` and before the first
    /// step. To resume, load the checkpoint (model, optimizer and scaler) on every rank: the masters
    /// alone from rank 0 would leave the other ranks' optimizer and scaler states fresh, and the ranks
    /// would diverge at the first step.
    pub fn broadcast_masters<M: AmpModule + ?Sized>(&self, model: &M) -> Result<()> {
        broadcast_masters(self.comm, model)
    }

    /// One data-parallel step with a fused optimizer: [`GradScaler::step_fused`] on every rank, with the
    /// gradients averaged over the ranks after backward and the skip decision agreed by all of them
    /// (the report names the lowest rank that found a non-finite value). Every rank must call it, with
    /// its own share of the batch. A model on a CUDA device needs a communicator that moves device
    /// memory ([`Nccl`](super::Nccl)).
    ///
    /// # Errors
    /// Those of [`GradScaler::step_fused`] and of the communicator.
    pub fn step_fused(
        &mut self,
        scaler: &mut GradScaler,
        loss: &Tensor,
        optimizer: &mut dyn FusedOptimizer,
        max_grad_norm: Option<f32>,
    ) -> Result<StepReport> {
        scaler.step_fused_staged(loss, optimizer, max_grad_norm, self)
    }

    /// One data-parallel step from the gradients each rank accumulated over its micro-batches
    /// ([`GradScaler::accumulate`]): [`GradScaler::step_fused_accumulated`] on every rank, with the f32
    /// sums averaged over the ranks once for the whole window (no traffic per micro-batch, as DDP's
    /// `no_sync`) and the skip decision agreed by all. Every rank must call it, each after the same
    /// number of steps.
    ///
    /// # Errors
    /// Those of [`GradScaler::step_fused_accumulated`] and of the communicator. A window refused
    /// before it starts (empty, interrupted, not holding a parameter) is refused on this rank alone,
    /// before any collective: its peers wait, so end the job with `comm.abort` (docs/DISTRIBUTED.md,
    /// "Failure behaviour").
    pub fn step_fused_accumulated(
        &mut self,
        scaler: &mut GradScaler,
        accumulator: &mut crate::scaler::GradAccumulator,
        optimizer: &mut dyn FusedOptimizer,
        max_grad_norm: Option<f32>,
    ) -> Result<StepReport> {
        scaler.step_fused_accumulated_staged(accumulator, optimizer, max_grad_norm, self)
    }
}

impl StepStages for DataParallel<'_> {
    fn collective(&self) -> bool {
        true
    }

    fn reduce<'p>(
        &mut self,
        _: &GradStore,
        present: &[&Tensor],
        path: &dyn Fn(usize) -> &'p str,
    ) -> Result<Option<String>> {
        agree_same_parameters(self.comm, (0..present.len()).map(path))?;
        // This rank's own check first, so that the report can name the rank that produced a non-finite
        // value: after the sum every rank holds it.
        let own = crate::passes::find_non_finite(present)?.map(|i| path(i).to_string());
        all_reduce_gradients(self.comm, present, &self.config)?;
        Ok(own)
    }

    fn verdict(&mut self, findings: Findings) -> Result<Option<SkipReason>> {
        agreed_verdict(self.comm, findings)
    }
}

/// The skip reason every rank of `comm` takes from every rank's [`Findings`], in one MAX all-reduce
/// of one word: the most severe finding (a non-finite loss, then a rank's own gradient, then only the
/// reduced gradient) and the lowest rank that had it.
pub(crate) fn agreed_verdict(comm: &dyn Communicator, findings: Findings) -> Result<Option<SkipReason>> {
    let kind = if !findings.loss_finite {
        LOSS
    } else if findings.own.is_some() {
        OWN_GRADIENT
    } else if findings.reduced.is_some() {
        REDUCED_GRADIENT
    } else {
        0
    };
    let Some((kind, rank)) = agree_lowest(comm, kind)? else { return Ok(None) };
    let me = rank == comm.rank();
    Ok(Some(match kind {
        LOSS => SkipReason::NonFiniteLossOnRank { rank },
        OWN_GRADIENT => {
            SkipReason::GroupGradientOverflow { rank: Some(rank), param: findings.own.filter(|_| me) }
        }
        _ => SkipReason::GroupGradientOverflow { rank: None, param: findings.reduced },
    }))
}
