//! ZeRO-1's gathers and its sharded masters: after each step every rank's updated parameters go to
//! every rank (the fp32 masters where every rank keeps them, the half working copies' bits where the
//! masters are sharded), and, for a checkpoint, the sharded fp32 masters to every rank.

use std::collections::HashMap;

use candle_core::{Tensor, TensorId, Var};
use half::{bf16, f16};

use amp_kernels::{GradSlice, GradSliceMut};

use super::data_parallel::agree_lowest;
use super::zero::{no_master, Layout, Zero1};
use crate::error::{Error, Result};
use crate::{storage, AmpModule, Cursor, GradientRoute, Layer, LayerSite};

impl Zero1<'_> {
    /// Shards the fp32 masters too: every rank drops the masters of the half-precision parameters it
    /// does not own (O2's master + working pairs; fp32 parameters, whose master is what forward
    /// reads, stay whole), keeping their working copies, which the owners' updated copies replace
    /// after each step (2 bytes a value on the wire instead of 4). Each rank then holds about
    /// `1 / world_size` of the fp32 masters, as of the optimizer state: ZeRO stage 1 as DeepSpeed
    /// defines it. Returns the bytes of fp32 masters this rank released.
    ///
    /// Call it on every rank (a collective), with the model this `Zero1` was built from, after
    /// [`broadcast_masters`](Self::broadcast_masters) and before the first step. Afterwards those
    /// parameters read as [`ParamStorage::Half`](crate::ParamStorage) on this rank and
    /// `ParamGroups::from_model` refuses the model (keep using [`local_groups`](Self::local_groups));
    /// [`save_checkpoint`](Self::save_checkpoint) gathers the fp32 masters from their owners, so the
    /// file is the same as without sharding, and [`load_checkpoint`](Self::load_checkpoint) rounds the
    /// released ones into their working copies. Every parameter's gradient is then taken against its
    /// working copy ([`GradientRoute::Working`], on every rank alike: most ranks hold no master to take
    /// it against). Memory held elsewhere (a `ParamGroups` or optimizer
    /// over the whole model, built before) keeps the masters alive: drop them.
    ///
    /// # Errors
    /// [`Error::ZeroShard`] on every rank when a rank's model is not the one its `Zero1` was built from
    /// (nothing is released then).
    pub fn shard_masters<M: AmpModule + ?Sized>(&mut self, model: &mut M) -> Result<usize> {
        let rank = self.comm.rank();
        // By working copy: a parameter that several layers share (tied weights) is one group entry.
        let index: HashMap<TensorId, usize> =
            self.groups.params.iter().enumerate().map(|(i, p)| (p.trainable.as_tensor().id(), i)).collect();
        let release: Vec<bool> = self
            .groups
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| self.shards.owner[i] != rank && p.working.is_some())
            .collect();
        // The model's parameters must be the very variables this Zero1 trains.
        let mut found = vec![false; release.len()];
        let mut stranger = None;
        model.visit(&mut Cursor::new(), &mut |site: LayerSite<'_>, layer: &dyn Layer| {
            for (name, param) in layer.params() {
                match index.get(&param.trainable().as_tensor().id()) {
                    Some(&i) => found[i] = true,
                    None => {
                        stranger.get_or_insert(site.param_path(name));
                    }
                }
            }
        });
        let missing = found.iter().position(|f| !f).map(|i| self.groups.params[i].path.clone());
        let problem = stranger
            .map(|p| format!("`{p}` is not a parameter of this Zero1's groups"))
            .or_else(|| missing.map(|p| format!("this Zero1's parameter `{p}` is not in the model")));
        if let Some((_, at)) = agree_lowest(self.comm, u32::from(problem.is_some()))? {
            return Err(Error::ZeroShard {
                reason: format!(
                    "shard_masters on rank {rank}: {}; pass the model whose `ParamGroups` built this Zero1, on \
                     every rank",
                    problem.unwrap_or_else(|| format!("rank {at}'s model does not match its Zero1"))
                ),
            });
        }
        let (mut released, mut counted) = (0, vec![false; release.len()]);
        model.visit_mut(&mut Cursor::new(), &mut |_: LayerSite<'_>, layer: &mut dyn Layer| {
            for (_, param) in layer.params_mut() {
                // Every parameter was found above.
                let Some(&i) = index.get(&param.trainable().as_tensor().id()) else { continue };
                // Every rank takes every gradient against the working copy, as the ranks without a
                // master must.
                param.set_gradient_route(GradientRoute::Working);
                // Each layer's handle on a shared parameter lets go of the master; it counts once.
                if release[i] && param.release_master() && !std::mem::replace(&mut counted[i], true) {
                    released += 4 * param.elem_count();
                }
            }
        });
        for (i, param) in self.groups.params.iter_mut().enumerate() {
            if let (true, Some(working)) = (release[i], &param.working) {
                // The groups' reference was the master's last one: the working copy stands in.
                param.master = working.clone();
            }
        }
        // Every rank marks the same parameters: those with a working copy, owned or not.
        self.sharded_master = self.groups.params.iter().map(|p| p.working.is_some()).collect();
        Ok(released)
    }

    /// Bytes of fp32 masters this rank holds for the parameters of this `Zero1`.
    pub fn master_bytes(&self) -> usize {
        let rank = self.comm.rank();
        (0..self.groups.params.len())
            .filter(|&i| !self.sharded_master[i] || self.shards.owner[i] == rank)
            .map(|i| 4 * self.shards.lens[i])
            .sum()
    }

    /// After a step: every rank's updated parameters to every rank. fp32 masters for the parameters
    /// every rank keeps a master of (their working copies refreshed from them), the half working
    /// copies' bits for those whose masters are sharded.
    pub(super) fn all_gather_updates(&self) -> Result<()> {
        self.gather_masters()?;
        self.gather_working_copies()?;
        crate::CastCache::clear();
        Ok(())
    }

    /// The layout of the parameters whose master is (`true`) or is not sharded.
    fn layout(&self, sharded: bool) -> Layout {
        let world = self.comm.world_size();
        Layout::of(&self.shards.owner, &self.shards.lens, world, |i| self.sharded_master[i] == sharded)
    }

    /// `world` blocks of `mine.len()` values: every rank's `mine`, in rank order, gathered in chunks of
    /// at most the bucket size.
    fn gather_blocks(&self, mine: &[f32]) -> Result<Vec<f32>> {
        let (world, block_len) = (self.comm.world_size(), mine.len());
        let mut gathered = vec![0f32; world * block_len];
        let (chunk, mut start) = (self.chunk(), 0);
        let mut round = vec![0f32; world * chunk.min(block_len)];
        while start < block_len {
            let len = chunk.min(block_len - start);
            self.comm.all_gather(&mine[start..start + len], &mut round[..world * len])?;
            for r in 0..world {
                let to = r * block_len + start;
                gathered[to..to + len].copy_from_slice(&round[r * len..(r + 1) * len]);
            }
            start += len;
        }
        Ok(gathered)
    }

    /// This rank's fp32 masters of the parameters in `layout`, packed in its block.
    fn own_masters(&self, layout: &Layout) -> Result<Vec<f32>> {
        let rank = self.comm.rank();
        let params = &self.groups.params;
        let own: Vec<&Tensor> =
            layout.blocks[rank].iter().map(|&(i, _)| params[i].master.as_tensor()).collect();
        let mut mine = vec![0f32; layout.block_len];
        storage::with_slices(&own, |slices| -> Result<()> {
            for (slice, &(i, offset)) in slices.iter().zip(&layout.blocks[rank]) {
                let GradSlice::F32(values) = slice else { return Err(no_master(&params[i].path)) };
                mine[offset..offset + values.len()].copy_from_slice(values);
            }
            Ok(())
        })??;
        Ok(mine)
    }

    /// The parameters of `layout` owned by other ranks: (index, offset in the gathered blocks).
    fn others(&self, layout: &Layout) -> Vec<(usize, usize)> {
        let rank = self.comm.rank();
        let block_len = layout.block_len;
        (0..self.comm.world_size())
            .filter(|&r| r != rank)
            .flat_map(|r| layout.blocks[r].iter().map(move |&(i, offset)| (i, r * block_len + offset)))
            .collect()
    }

    /// The fp32 masters every rank keeps: each owner's to every rank, the working copies refreshed.
    fn gather_masters(&self) -> Result<()> {
        let layout = self.layout(false);
        if layout.block_len == 0 {
            return Ok(());
        }
        let gathered = self.gather_blocks(&self.own_masters(&layout)?)?;
        let others = self.others(&layout);
        let params = &self.groups.params;
        let masters: Vec<&Tensor> = others.iter().map(|&(i, _)| params[i].master.as_tensor()).collect();
        let mut next = 0;
        storage::for_each_batch_mut(&masters, |slices| -> Result<()> {
            for slice in slices.iter_mut() {
                let (param, from) = others[next];
                next += 1;
                match slice {
                    GradSliceMut::F32(s) => s.copy_from_slice(&gathered[from..from + s.len()]),
                    _ => return Err(no_master(&params[param].path)),
                }
            }
            Ok(())
        })?
        .into_iter()
        .collect::<Result<()>>()?;
        for &(i, _) in &others {
            if let Some(working) = &params[i].working {
                working.set(&params[i].master.as_tensor().to_dtype(working.dtype())?)?;
            }
        }
        Ok(())
    }

    /// The working copies of the parameters whose masters are sharded: each owner's (just refreshed
    /// from its master) to every rank, as bit patterns, two 16-bit values in each 32-bit word (the
    /// collectives copy the words' bits exactly: no arithmetic touches them).
    fn gather_working_copies(&self) -> Result<()> {
        let layout = self.layout(true);
        if layout.block_len == 0 {
            return Ok(());
        }
        let (rank, params) = (self.comm.rank(), &self.groups.params);
        let working = |i: usize| {
            params[i].working.as_ref().map(Var::as_tensor).ok_or_else(|| no_master(&params[i].path))
        };
        let own = layout.blocks[rank].iter().map(|&(i, _)| working(i)).collect::<Result<Vec<_>>>()?;
        // Value k of the block goes to the low (k even) or high (k odd) half of word k / 2.
        let mut words = vec![0f32; layout.block_len.div_ceil(2)];
        let mut put = |k: usize, bits: u16| {
            let word = &mut words[k / 2];
            *word = f32::from_bits(word.to_bits() | u32::from(bits) << (16 * (k % 2)));
        };
        storage::with_slices(&own, |slices| -> Result<()> {
            for (slice, &(i, offset)) in slices.iter().zip(&layout.blocks[rank]) {
                match slice {
                    GradSlice::F16(s) => s.iter().enumerate().for_each(|(j, v)| put(offset + j, v.to_bits())),
                    GradSlice::Bf16(s) => {
                        s.iter().enumerate().for_each(|(j, v)| put(offset + j, v.to_bits()))
                    }
                    GradSlice::F32(_) => return Err(no_master(&params[i].path)),
                }
            }
            Ok(())
        })??;
        let gathered = self.gather_blocks(&words)?;
        let bit = |k: usize| (gathered[k / 2].to_bits() >> (16 * (k % 2))) as u16;
        let per_rank = 2 * words.len();
        let others: Vec<(usize, usize)> = self
            .others(&layout)
            .into_iter()
            .map(|(i, at)| {
                let (r, offset) = (at / layout.block_len, at % layout.block_len);
                (i, r * per_rank + offset)
            })
            .collect();
        let targets = others.iter().map(|&(i, _)| working(i)).collect::<Result<Vec<_>>>()?;
        let mut next = 0;
        storage::for_each_batch_mut(&targets, |slices| -> Result<()> {
            for slice in slices.iter_mut() {
                let (param, from) = others[next];
                next += 1;
                match slice {
                    GradSliceMut::F16(s) => {
                        s.iter_mut().enumerate().for_each(|(k, v)| *v = f16::from_bits(bit(from + k)))
                    }
                    GradSliceMut::Bf16(s) => {
                        s.iter_mut().enumerate().for_each(|(k, v)| *v = bf16::from_bits(bit(from + k)))
                    }
                    GradSliceMut::F32(_) => return Err(no_master(&params[param].path)),
                }
            }
            Ok(())
        })?
        .into_iter()
        .collect::<Result<()>>()
    }

    /// The fp32 masters of the parameters whose masters are sharded, gathered from their owners, by
    /// path (empty when none is): what a checkpoint saves for them. A collective.
    pub(super) fn gathered_masters(&self) -> Result<HashMap<String, Tensor>> {
        let layout = self.layout(true);
        if layout.block_len == 0 {
            return Ok(HashMap::new());
        }
        let gathered = self.gather_blocks(&self.own_masters(&layout)?)?;
        let params = &self.groups.params;
        let mut masters = HashMap::new();
        for (r, block) in layout.blocks.iter().enumerate() {
            for &(i, offset) in block {
                let from = r * layout.block_len + offset;
                let values = gathered[from..from + self.shards.lens[i]].to_vec();
                let like = params[i].trainable.as_tensor();
                masters
                    .insert(params[i].path.clone(), Tensor::from_vec(values, like.shape(), like.device())?);
            }
        }
        Ok(masters)
    }
}
