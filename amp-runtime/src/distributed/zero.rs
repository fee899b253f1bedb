//! ZeRO stage 1 ([`Zero1`]): the optimizer state sharded across the ranks of a data-parallel group.
//! The partition, the packed reduce-scatter and the all-gather of the masters; the checkpoint side is in
//! `zero_checkpoint.rs`.

use candle_core::backprop::GradStore;
use candle_core::Tensor;
use half::{bf16, f16};

use amp_kernels::{GradSlice, GradSliceMut};

use super::communicator::Communicator;
use super::data_parallel::{broadcast_masters, DataParallelConfig};
use super::step::agreed_verdict;
use super::wire::Wire;
use crate::error::{Error, Result};
use crate::optim::{FusedOptimizer, ParamGroups};
use crate::scaler::stages::{Findings, StepStages};
use crate::scaler::{GradScaler, SkipReason, StepReport};
use crate::storage;
use crate::AmpModule;

/// ZeRO stage 1 over a [`Communicator`]: each rank owns some parameter tensors, holds the optimizer
/// state of those only, receives their averaged gradients by a reduce-scatter, steps them, and
/// all-gathers the updated masters. docs/DISTRIBUTED.md in the repository gives the measurements.
///
/// Plain data parallelism ([`DataParallel`](super::DataParallel)) keeps the whole optimizer state on
/// every rank: Adam's two fp32 moments are 8 bytes per parameter, twice the fp32 masters. [`Zero1`]
/// gives each parameter tensor to one rank (its *owner*) and builds each rank's fused optimizer over
/// the tensors it owns only, so each rank holds about `1 / world_size` of the state. A step:
///
/// 1. backward on this rank's share of the batch, this rank's own gradients checked for inf/NaN;
/// 2. **reduce-scatter**: the gradients, packed rank by rank (each rank's tensors in model order,
///    padded to the longest rank's length), are summed over the ranks in buckets; each rank receives
///    the averaged gradient of the tensors it owns, written back into them in their dtype;
/// 3. each rank checks its own shard of the reduced gradients (and, when clipping, its part of the
///    squared global norm is summed over the ranks), then the one-word MAX agreement of
///    [`DataParallel`](super::DataParallel): every rank skips or applies together;
/// 4. each rank's fused optimizer (the same [`FusedAdam`](crate::optim::FusedAdam) or
///    [`FusedLamb`](crate::optim::FusedLamb), over its tensors) steps its masters and refreshes their
///    working copies;
/// 5. **all-gather**: every rank's updated parameters go to every rank, so that every rank ends the
///    step holding the whole updated model: the half working copies (2 bytes a value) of the tensors
///    whose masters are sharded ([`shard_masters`](Self::shard_masters)), else the fp32 masters, from
///    which the other ranks refresh their working copies (the same rounding the fused kernel does).
///
/// Sharding is by whole tensors: LAMB's trust ratio needs each tensor's norms, which its owner
/// computes alone, with no extra collective. The partition is the longest-processing-time rule: the
/// tensors, largest first, each to the rank holding the fewest elements so far; so the largest
/// rank's share is at most `total / world_size + largest tensor`.
///
/// The fp32 masters stay on every rank until [`shard_masters`](Self::shard_masters) releases, on each
/// rank, those of the half-precision parameters it does not own: then each rank holds about
/// `1 / world_size` of the masters as well as of the optimizer state (fp32 parameters, which forward
/// reads, stay whole; the half working copies are on every rank, as in DeepSpeed's ZeRO-1). Either
/// way the training is the same to the bit. With an fp32 wire and two ranks the averaged gradient is the
/// same sum as [`DataParallel`](super::DataParallel)'s all-reduce (one addition, commutative) and the
/// update is elementwise, so the two train bit-identically; with more ranks the transport may add the
/// ranks' values in another order (within `gamma(world - 1)` of each other per value). With clipping,
/// the global norm is the square root of the ranks' squared shard norms summed in f32, a few units in
/// the last place from one pass over every tensor.
///
/// Checkpoints: [`save_checkpoint`](Self::save_checkpoint) gathers the optimizer state into one file in
/// [`crate::checkpoint`]'s format, as an unsharded optimizer would save it, which
/// [`load_checkpoint`](Self::load_checkpoint) loads on any number of ranks (and `checkpoint::load_with`
/// into a plain optimizer on one process).
///
/// ```
/// use amp_runtime::distributed::{DataParallelConfig, SingleProcess, Zero1};
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
/// let mut zero = Zero1::new(&comm, ParamGroups::from_model(&model)?, DataParallelConfig::default())?;
/// zero.broadcast_masters(&model)?;
/// zero.shard_masters(&mut model)?; // each rank keeps the fp32 masters it owns, only
/// // This rank's optimizer: over the tensors it owns only.
/// let mut optimizer = FusedAdamW::new(zero.local_groups(), AdamConfig::default())?;
/// let mut scaler = GradScaler::for_model(&model, ScalerConfig::default())?;
/// let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?; // this rank's share of the batch
/// let loss = model[0].forward(&x)?.sqr()?.mean_all()?;
/// let report = zero.step_fused(&mut scaler, &loss, &mut optimizer, None)?;
/// assert!(report.applied());
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Zero1<'c> {
    pub(super) comm: &'c dyn Communicator,
    pub(super) config: DataParallelConfig,
    /// Every parameter of the model, with the groups' options.
    pub(super) groups: ParamGroups,
    pub(super) shards: Shards,
    /// Per parameter: its fp32 master lives on its owner only ([`shard_masters`](Self::shard_masters)),
    /// so the other ranks receive its half working copy after each step.
    pub(super) sharded_master: Vec<bool>,
}

/// Which rank owns each parameter, and where each tensor sits in its owner's packed block.
#[derive(Debug)]
pub(super) struct Shards {
    /// The owner of each parameter.
    pub owner: Vec<usize>,
    /// Per rank: (parameter index, offset in the rank's block), in model order.
    pub blocks: Vec<Vec<(usize, usize)>>,
    /// Elements of each parameter.
    pub lens: Vec<usize>,
    /// The longest block: every rank's block is padded to it for the collectives.
    pub block_len: usize,
}

impl Shards {
    /// The longest-processing-time partition of tensors of `lens` elements over `world` ranks.
    fn new(lens: Vec<usize>, world: usize) -> Self {
        let mut order: Vec<usize> = (0..lens.len()).collect();
        order.sort_by_key(|&i| (std::cmp::Reverse(lens[i]), i));
        let mut load = vec![0usize; world];
        let mut owner = vec![0; lens.len()];
        for i in order {
            let rank = (0..world).min_by_key(|&r| (load[r], r)).unwrap_or(0);
            owner[i] = rank;
            load[rank] += lens[i];
        }
        let Layout { blocks, block_len } = Layout::of(&owner, &lens, world, |_| true);
        Shards { owner, blocks, lens, block_len }
    }

    /// Calls `f(param, range in the parameter, range in the window)` for every piece of rank `rank`'s
    /// block that falls in the window `start..start + len` of block coordinates.
    fn pieces(
        &self,
        rank: usize,
        start: usize,
        len: usize,
        mut f: impl FnMut(usize, std::ops::Range<usize>, std::ops::Range<usize>),
    ) {
        for &(param, offset) in &self.blocks[rank] {
            let (lo, hi) = (start.max(offset), (start + len).min(offset + self.lens[param]));
            if lo < hi {
                f(param, lo - offset..hi - offset, lo - start..hi - start);
            }
        }
    }
}

/// Where each parameter of a subset sits in its owner's block, per rank, blocks padded to the longest.
#[derive(Debug)]
pub(super) struct Layout {
    /// Per rank: (parameter index, offset in the rank's block), in model order.
    pub blocks: Vec<Vec<(usize, usize)>>,
    /// The longest block.
    pub block_len: usize,
}

impl Layout {
    /// The parameters for which `include` holds, each in its owner's block.
    pub fn of(owner: &[usize], lens: &[usize], world: usize, include: impl Fn(usize) -> bool) -> Self {
        let mut blocks = vec![Vec::new(); world];
        let mut fill = vec![0usize; world];
        for (i, &rank) in owner.iter().enumerate().filter(|&(i, _)| include(i)) {
            blocks[rank].push((i, fill[rank]));
            fill[rank] += lens[i];
        }
        Layout { blocks, block_len: fill.iter().copied().max().unwrap_or(0) }
    }
}

impl<'c> Zero1<'c> {
    /// ZeRO-1 over `comm` for the parameters `groups` (every rank passes the same model's, e.g.
    /// `ParamGroups::from_model(&model)?` with the same groups), gradients travelling as `config` says
    /// (`bucket_bytes` bounds each collective's values, counted as f32).
    ///
    /// # Errors
    /// [`Error::InvalidDataParallelConfig`].
    pub fn new(comm: &'c dyn Communicator, groups: ParamGroups, config: DataParallelConfig) -> Result<Self> {
        config.validate()?;
        let lens = groups.params.iter().map(|p| p.elem_count()).collect();
        let shards = Shards::new(lens, comm.world_size());
        let sharded_master = vec![false; groups.params.len()];
        Ok(Zero1 { comm, config, groups, shards, sharded_master })
    }

    /// The group.
    pub fn communicator(&self) -> &'c dyn Communicator {
        self.comm
    }

    /// The parameter groups this rank's optimizer must be built from: the tensors this rank owns, in
    /// model order, with every group's options.
    pub fn local_groups(&self) -> ParamGroups {
        let params = self.shards.blocks[self.comm.rank()]
            .iter()
            .map(|&(i, _)| self.groups.params[i].clone())
            .collect();
        ParamGroups { params, groups: self.groups.groups.clone() }
    }

    /// The rank that owns each parameter (in model order).
    pub fn owners(&self) -> &[usize] {
        &self.shards.owner
    }

    /// Elements each rank owns, by rank: its optimizer's state is proportional to it.
    pub fn shard_elements(&self) -> Vec<usize> {
        let lens = &self.shards.lens;
        self.shards.blocks.iter().map(|b| b.iter().map(|&(i, _)| lens[i]).sum()).collect()
    }

    /// [`broadcast_masters`] over this group: call once after `amp::initialize` and before the first
    /// step.
    pub fn broadcast_masters<M: AmpModule + ?Sized>(&self, model: &M) -> Result<()> {
        broadcast_masters(self.comm, model)
    }

    /// One ZeRO-1 step (the steps are in [`Zero1`]'s docs): [`GradScaler::step_fused`]'s protocol with the gradients
    /// reduce-scattered, one agreed verdict, this rank's shard stepped by `optimizer` (built from
    /// [`local_groups`](Self::local_groups)) and the updated masters all-gathered. Every rank must call
    /// it with its own share of the batch; gradients live on the CPU (a CUDA transport is a later
    /// slice). Afterwards the gradients of the tensors this rank does not own hold this rank's own
    /// (unreduced) values.
    ///
    /// # Errors
    /// [`Error::ZeroShard`] when `optimizer` does not hold exactly this rank's tensors (checked before
    /// anything runs, on this rank: build it from `local_groups()` on every rank); those of
    /// [`GradScaler::step_fused`] and of the communicator.
    pub fn step_fused(
        &mut self,
        scaler: &mut GradScaler,
        loss: &Tensor,
        optimizer: &mut dyn FusedOptimizer,
        max_grad_norm: Option<f32>,
    ) -> Result<StepReport> {
        self.check_optimizer(optimizer)?;
        scaler.step_fused_staged(loss, optimizer, max_grad_norm, self)
    }

    /// One ZeRO-1 step from the gradients each rank accumulated over its micro-batches
    /// ([`GradScaler::accumulate`], given the whole model): the f32 sums are reduce-scattered once for
    /// the window, then as [`step_fused`](Self::step_fused). Every rank must call it.
    ///
    /// # Errors
    /// Those of [`step_fused`](Self::step_fused) and of
    /// [`GradScaler::step_fused_accumulated`]; a window that does not hold every parameter of the
    /// model, this rank's shard or not, is [`Error::NotAccumulated`]. A refused window is refused on
    /// this rank alone, before any collective, as in
    /// [`DataParallel::step_fused_accumulated`](super::DataParallel::step_fused_accumulated).
    pub fn step_fused_accumulated(
        &mut self,
        scaler: &mut GradScaler,
        accumulator: &mut crate::scaler::GradAccumulator,
        optimizer: &mut dyn FusedOptimizer,
        max_grad_norm: Option<f32>,
    ) -> Result<StepReport> {
        self.check_optimizer(optimizer)?;
        // Every parameter is reduce-scattered, not only this rank's shard: the window must hold them all.
        accumulator
            .check_covers(self.groups.params.iter().map(|p| (p.path.as_str(), p.master.as_tensor())))?;
        scaler.step_fused_accumulated_staged(accumulator, optimizer, max_grad_norm, self)
    }

    fn check_optimizer(&self, optimizer: &dyn FusedOptimizer) -> Result<()> {
        let theirs = optimizer.param_groups().params();
        let mine = &self.shards.blocks[self.comm.rank()];
        let same = theirs.len() == mine.len()
            && theirs.iter().zip(mine).all(|(p, &(i, _))| {
                p.master.as_tensor().id() == self.groups.params[i].master.as_tensor().id()
            });
        if same {
            return Ok(());
        }
        Err(Error::ZeroShard {
            reason: format!(
                "the optimizer on rank {} holds {} parameter(s), not exactly the {} this rank owns: build it from \
                 `Zero1::local_groups()` on every rank",
                self.comm.rank(),
                theirs.len(),
                mine.len()
            ),
        })
    }

    /// Values per rank and collective call.
    pub(super) fn chunk(&self) -> usize {
        (self.config.bucket_bytes / 4 / self.comm.world_size()).max(1)
    }

    /// This rank's block of the gradients averaged over the ranks (f32, `block_len` values).
    fn reduce_scatter(&self, grads: &[Option<&Tensor>]) -> Result<Vec<f32>> {
        let (world, wire) = (self.comm.world_size(), self.config.wire);
        let before = 1.0 / self.config.predivide_factor;
        let present: Vec<&Tensor> = grads.iter().flatten().copied().collect();
        let mut slot = Vec::with_capacity(grads.len());
        let mut next = 0;
        for grad in grads {
            slot.push(grad.map(|_| next));
            next += usize::from(grad.is_some());
        }
        let mut mine = vec![0f32; self.shards.block_len];
        let chunk = self.chunk();
        storage::with_slices(&present, |slices| -> Result<()> {
            let mut staged = vec![0f32; world * chunk.min(self.shards.block_len)];
            let mut start = 0;
            while start < self.shards.block_len {
                let len = chunk.min(self.shards.block_len - start);
                let staged = &mut staged[..world * len];
                staged.fill(0.0);
                for rank in 0..world {
                    let window = &mut staged[rank * len..(rank + 1) * len];
                    self.shards.pieces(rank, start, len, |param, from, to| {
                        if let Some(k) = slot[param] {
                            stage(&slices[k], from, &mut window[to], before);
                        }
                    });
                }
                self.comm.reduce_scatter_sum(staged, &mut mine[start..start + len], wire)?;
                start += len;
            }
            Ok(())
        })??;
        Ok(mine)
    }

    /// Writes this rank's reduced block into the gradients of the tensors it owns, times
    /// `predivide_factor / world_size`, in each gradient's dtype.
    fn write_back(&self, grads: &[Option<&Tensor>], mine: &[f32]) -> Result<()> {
        let after = self.config.predivide_factor / self.comm.world_size() as f32;
        let owned: Vec<(usize, &Tensor)> = self.shards.blocks[self.comm.rank()]
            .iter()
            .filter_map(|&(i, offset)| grads[i].map(|g| (offset, g)))
            .collect();
        let tensors: Vec<&Tensor> = owned.iter().map(|(_, g)| *g).collect();
        let mut next = 0;
        storage::for_each_batch_mut(&tensors, |slices| {
            for slice in slices.iter_mut() {
                let offset = owned[next].0;
                next += 1;
                let sums = |n: usize| mine[offset..offset + n].iter().map(|&v| v * after);
                match slice {
                    GradSliceMut::F32(s) => {
                        let n = s.len();
                        s.iter_mut().zip(sums(n)).for_each(|(g, v)| *g = v)
                    }
                    GradSliceMut::F16(s) => {
                        let n = s.len();
                        s.iter_mut().zip(sums(n)).for_each(|(g, v)| *g = f16::from_f32(v))
                    }
                    GradSliceMut::Bf16(s) => {
                        let n = s.len();
                        s.iter_mut().zip(sums(n)).for_each(|(g, v)| *g = bf16::from_f32(v))
                    }
                }
            }
        })?;
        Ok(())
    }
}

/// A master that is not f32: `ParamGroups` refuses such parameters, so this is a broken invariant.
pub(super) fn no_master(path: &str) -> Error {
    Error::Internal { what: format!("the master of `{path}` is not an f32 tensor") }
}

/// `out = slice[from] * before`, widened to f32.
fn stage(slice: &GradSlice<'_>, from: std::ops::Range<usize>, out: &mut [f32], before: f32) {
    match slice {
        GradSlice::F32(s) => out.iter_mut().zip(&s[from]).for_each(|(o, &v)| *o = v * before),
        GradSlice::F16(s) => out.iter_mut().zip(&s[from]).for_each(|(o, v)| *o = v.to_f32() * before),
        GradSlice::Bf16(s) => out.iter_mut().zip(&s[from]).for_each(|(o, v)| *o = v.to_f32() * before),
    }
}

impl StepStages for Zero1<'_> {
    fn collective(&self) -> bool {
        true
    }

    fn fold_split_gradients(&self, grads: &mut GradStore) -> Result<()> {
        crate::optim::fold_split_gradients(&self.groups.params, grads)
    }

    fn reduce<'p>(
        &mut self,
        grads: &GradStore,
        _present: &[&Tensor],
        _path: &dyn Fn(usize) -> &'p str,
    ) -> Result<Option<String>> {
        let params = &self.groups.params;
        let all: Vec<Option<&Tensor>> = params.iter().map(|p| p.grad(grads)).collect::<Result<_>>()?;
        // This rank's own gradients, all of them, before the reduction (to name the rank at fault).
        let (indices, present): (Vec<usize>, Vec<&Tensor>) =
            all.iter().enumerate().filter_map(|(i, g)| g.map(|g| (i, g))).unzip();
        let own = crate::passes::find_non_finite(&present)?.map(|k| params[indices[k]].path.clone());
        let mine = self.reduce_scatter(&all)?;
        self.write_back(&all, &mine)?;
        Ok(own)
    }

    fn global_norm(&mut self, local: f32) -> Result<f32> {
        let mut squares = [local * local];
        self.comm.all_reduce_sum(&mut squares, Wire::F32)?;
        Ok(squares[0].sqrt())
    }

    fn verdict(&mut self, findings: Findings) -> Result<Option<SkipReason>> {
        agreed_verdict(self.comm, findings)
    }

    fn after_step(&mut self) -> Result<()> {
        self.all_gather_updates()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_partition_balances_whole_tensors_largest_first() {
        let shards = Shards::new(vec![144, 24, 72, 3, 72], 2);
        // Largest first, each to the lighter rank: 144 -> 0, 72 -> 1, 72 -> 1, 24 -> 0 (144 = 144: the
        // lower rank), 3 -> 1.
        assert_eq!(shards.owner, vec![0, 0, 1, 1, 1]);
        let loads: Vec<usize> =
            shards.blocks.iter().map(|b| b.iter().map(|&(i, _)| shards.lens[i]).sum()).collect();
        assert_eq!((loads, shards.block_len), (vec![168, 147], 168));
        assert_eq!(shards.blocks[1], vec![(2, 0), (3, 72), (4, 75)]);
        let mut seen = Vec::new();
        shards.pieces(1, 70, 10, |param, from, to| seen.push((param, from, to)));
        assert_eq!(seen, vec![(2, 70..72, 0..2), (3, 0..3, 2..5), (4, 0..5, 5..10)]);
        // More ranks than tensors: the extra ranks own nothing.
        let shards = Shards::new(vec![5, 5], 3);
        assert_eq!((shards.owner.clone(), shards.block_len), (vec![0, 1], 5));
        assert!(shards.blocks[2].is_empty());
    }
}
