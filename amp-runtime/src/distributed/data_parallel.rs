//! Data-parallel building blocks: the same start on every rank, averaged gradients, agreed verdicts.

use candle_core::Tensor;
use half::{bf16, f16};

use amp_kernels::GradSliceMut;

use super::communicator::Communicator;
use super::device::DeviceCollectives;
use super::wire::Wire;
use crate::error::{Error, Result};
use crate::{AmpModule, AmpModuleExt, Param};

/// How gradients travel between the ranks of a data-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DataParallelConfig {
    /// The dtype gradients travel in: fp32 (default, exact per value) or a 16-bit type (half the bytes).
    pub wire: Wire,
    /// The most gradient values one all-reduce carries, in bytes counted as f32 (the staging type):
    /// gradients are reduced in model order, in buckets of this size. Default 25 MiB (PyTorch DDP's
    /// `bucket_cap_mb`).
    pub bucket_bytes: usize,
    /// Apex's `gradient_predivide_factor` `f`: gradients are multiplied by `1/f` before the all-reduce
    /// and by `f / world_size` after it. 1 (default) divides only after; the world size divides
    /// wholly before, which keeps an fp16 wire's sums from overflowing 65504.
    pub predivide_factor: f32,
}

impl Default for DataParallelConfig {
    fn default() -> Self {
        DataParallelConfig { wire: Wire::F32, bucket_bytes: 25 << 20, predivide_factor: 1.0 }
    }
}

impl DataParallelConfig {
    /// [`Error::InvalidDataParallelConfig`] for a setting out of range.
    pub fn validate(&self) -> Result<()> {
        let reason = if self.bucket_bytes < 4 {
            format!("bucket_bytes {} holds no f32 value: give at least 4 (default 25 MiB)", self.bucket_bytes)
        } else if !(self.predivide_factor.is_finite() && self.predivide_factor > 0.0) {
            format!(
                "predivide_factor {} must be finite and positive (1 divides after the sum; the world size \
                 divides before it)",
                self.predivide_factor
            )
        } else {
            return Ok(());
        };
        Err(Error::InvalidDataParallelConfig { reason })
    }
}

/// Copies rank 0's parameters into every rank's (the fp32 masters, then each half working copy
/// refreshed from its master), so that every rank starts bit-identical. Checks first that every rank
/// holds the same parameters (names, shapes, order).
///
/// # Errors
/// [`Error::ReplicasDiffer`] on every rank when some rank's parameters differ from rank 0's (nothing
/// was changed); those of the communicator.
pub fn broadcast_masters<M: AmpModule + ?Sized>(comm: &dyn Communicator, model: &M) -> Result<()> {
    let params = model.unique_params();
    check_same_params(comm, &params)?;
    let masters: Vec<&Tensor> = params.iter().map(|(_, p)| p.master().as_tensor()).collect();
    if crate::cuda::on_cuda(&masters) {
        device_collectives(comm)?.broadcast_tensors(&masters, 0)?;
        return crate::refresh_working_copies(model);
    }
    crate::storage::for_each_batch_mut(&masters, |slices| {
        slices.iter_mut().try_for_each(|slice| broadcast_slice(comm, slice))
    })?
    .into_iter()
    .collect::<Result<()>>()?;
    crate::refresh_working_copies(model)
}

fn broadcast_slice(comm: &dyn Communicator, slice: &mut GradSliceMut<'_>) -> Result<()> {
    match slice {
        GradSliceMut::F32(values) => comm.broadcast(values, 0),
        // Parameters stored in half (O3): their bit patterns, exactly.
        GradSliceMut::F16(values) => broadcast_words(comm, values, f16::to_bits, f16::from_bits),
        GradSliceMut::Bf16(values) => broadcast_words(comm, values, bf16::to_bits, bf16::from_bits),
    }
}

fn broadcast_words<T: Copy>(
    comm: &dyn Communicator,
    values: &mut [T],
    to_bits: fn(T) -> u16,
    from_bits: fn(u16) -> T,
) -> Result<()> {
    let mut bytes: Vec<u8> = values.iter().flat_map(|&v| to_bits(v).to_le_bytes()).collect();
    comm.broadcast_bytes(&mut bytes, 0)?;
    for (value, pair) in values.iter_mut().zip(bytes.chunks_exact(2)) {
        *value = from_bits(u16::from_le_bytes([pair[0], pair[1]]));
    }
    Ok(())
}

/// What identifies a model's parameters: count, total elements, and a hash of names and shapes.
fn fingerprint(params: &[(String, Param)]) -> [u64; 3] {
    // FNV-1a: stable across processes and builds (std's hasher is seeded per process).
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for &b in bytes {
            hash = (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    let mut elements = 0u64;
    for (path, param) in params {
        feed(path.as_bytes());
        let dims = param.master().as_tensor().dims();
        for &d in dims {
            feed(&(d as u64).to_le_bytes());
        }
        feed(&[0xff]);
        elements += dims.iter().product::<usize>() as u64;
    }
    [params.len() as u64, elements, hash]
}

/// [`Error::ReplicasDiffer`] on every rank unless every rank's parameters match rank 0's.
fn check_same_params(comm: &dyn Communicator, params: &[(String, Param)]) -> Result<()> {
    let mine = fingerprint(params);
    let mut bytes: Vec<u8> = mine.iter().flat_map(|w| w.to_le_bytes()).collect();
    comm.broadcast_bytes(&mut bytes, 0)?;
    let mut root = [0u64; 3];
    for (word, chunk) in root.iter_mut().zip(bytes.chunks_exact(8)) {
        let mut le = [0u8; 8];
        le.copy_from_slice(chunk);
        *word = u64::from_le_bytes(le);
    }
    let Some(rank) = agree_non_finite(comm, mine != root)? else { return Ok(()) };
    let reason = if mine == root {
        format!(
            "this rank ({}) holds rank 0's parameters; rank {rank}'s error says what differs",
            comm.rank()
        )
    } else {
        let what = if mine[..2] == root[..2] { "; their names or shapes differ" } else { "" };
        format!(
            "rank {} has {} parameter(s) of {} values, rank 0 has {} of {}{what}",
            comm.rank(),
            mine[0],
            mine[1],
            root[0],
            root[1]
        )
    };
    Err(Error::ReplicasDiffer { rank, reason })
}

/// Averages `grads` over the ranks, in place: each becomes the sum of every rank's gradient divided by
/// the world size (with the pre-divide factor applied before and after the sum, as configured). The
/// gradients are staged as f32 in model order, in buckets of `config.bucket_bytes`, travel as
/// `config.wire` says, and are written back in each tensor's dtype (one rounding for half gradients).
/// Every rank must pass tensors of the same lengths in the same order. CUDA gradients are summed where
/// they are, through the communicator's [`DeviceCollectives`] (NCCL).
///
/// # Errors
/// [`Error::InvalidDataParallelConfig`]; [`Error::NotContiguous`] and device errors for tensors the
/// kernels cannot read; [`Error::HostCollectivesOnly`] for CUDA gradients and a communicator that
/// moves host memory only; those of the communicator.
pub fn all_reduce_gradients(
    comm: &dyn Communicator,
    grads: &[&Tensor],
    config: &DataParallelConfig,
) -> Result<()> {
    config.validate()?;
    if crate::cuda::on_cuda(grads) {
        return all_reduce_device_gradients(device_collectives(comm)?, grads, config, comm.world_size());
    }
    let mut bucket = Bucket {
        comm,
        wire: config.wire,
        capacity: (config.bucket_bytes / 4).max(1),
        before: 1.0 / config.predivide_factor,
        after: config.predivide_factor / comm.world_size() as f32,
        staged: Vec::new(),
        pieces: Vec::new(),
    };
    crate::storage::for_each_batch_mut(grads, |slices| bucket.reduce_all(slices))?.into_iter().collect()
}

/// [`all_reduce_gradients`] on CUDA tensors: the pre-divide by amp's unscale kernel, in place, then
/// one grouped sum per wire dtype that applies the final scaling before a converted copy goes back into
/// its gradient (an fp16 gradient's average, not its sum, is what must fit fp16, as on the host path).
/// (A half gradient is rounded to its dtype after the pre-divide, which the host path's f32 staging
/// does not do; with the default factor 1 there is no pre-divide.)
fn all_reduce_device_gradients(
    device: &dyn DeviceCollectives,
    grads: &[&Tensor],
    config: &DataParallelConfig,
    world: usize,
) -> Result<()> {
    let (before, after) = (1.0 / config.predivide_factor, config.predivide_factor / world as f32);
    if before != 1.0 {
        crate::passes::unscale_and_check(grads, before)?;
    }
    device.all_reduce_sum_tensors(grads, config.wire, after)
}

/// The device collectives of `comm`, or the error that says which communicator has them.
fn device_collectives(comm: &dyn Communicator) -> Result<&dyn DeviceCollectives> {
    comm.device_collectives().ok_or_else(|| Error::HostCollectivesOnly { engine: format!("{comm:?}") })
}

/// One bucket of staged gradient values and where each piece came from.
struct Bucket<'c> {
    comm: &'c dyn Communicator,
    wire: Wire,
    capacity: usize,
    before: f32,
    after: f32,
    staged: Vec<f32>,
    /// (slice index, start, length) of each staged piece, in staging order.
    pieces: Vec<(usize, usize, usize)>,
}

impl Bucket<'_> {
    /// Reduces every value of `slices`, bucket by bucket (a tensor may span buckets).
    fn reduce_all(&mut self, slices: &mut [GradSliceMut<'_>]) -> Result<()> {
        for index in 0..slices.len() {
            let len = slice_len(&slices[index]);
            let mut start = 0;
            while start < len {
                let take = (self.capacity - self.staged.len()).min(len - start);
                self.stage(&slices[index], start, take);
                self.pieces.push((index, start, take));
                start += take;
                if self.staged.len() == self.capacity {
                    self.flush(slices)?;
                }
            }
        }
        self.flush(slices)
    }

    fn stage(&mut self, slice: &GradSliceMut<'_>, start: usize, len: usize) {
        let before = self.before;
        let range = start..start + len;
        match slice {
            GradSliceMut::F32(s) => self.staged.extend(s[range].iter().map(|&v| v * before)),
            GradSliceMut::F16(s) => self.staged.extend(s[range].iter().map(|v| v.to_f32() * before)),
            GradSliceMut::Bf16(s) => self.staged.extend(s[range].iter().map(|v| v.to_f32() * before)),
        }
    }

    /// All-reduces the staged values and writes them back, scaled, in each tensor's dtype.
    fn flush(&mut self, slices: &mut [GradSliceMut<'_>]) -> Result<()> {
        if self.staged.is_empty() {
            return Ok(());
        }
        self.comm.all_reduce_sum(&mut self.staged, self.wire)?;
        let mut offset = 0;
        for &(index, start, len) in &self.pieces {
            let sums = self.staged[offset..offset + len].iter().map(|&v| v * self.after);
            let range = start..start + len;
            match &mut slices[index] {
                GradSliceMut::F32(s) => s[range].iter_mut().zip(sums).for_each(|(g, v)| *g = v),
                GradSliceMut::F16(s) => {
                    s[range].iter_mut().zip(sums).for_each(|(g, v)| *g = f16::from_f32(v))
                }
                GradSliceMut::Bf16(s) => {
                    s[range].iter_mut().zip(sums).for_each(|(g, v)| *g = bf16::from_f32(v))
                }
            }
            offset += len;
        }
        self.staged.clear();
        self.pieces.clear();
        Ok(())
    }
}

fn slice_len(slice: &GradSliceMut<'_>) -> usize {
    match slice {
        GradSliceMut::F32(s) => s.len(),
        GradSliceMut::F16(s) => s.len(),
        GradSliceMut::Bf16(s) => s.len(),
    }
}

/// Errors on every rank unless every rank holds gradients for the same parameters (`paths`, in the
/// order they are reduced): two MAX all-reduces of one word, a hash of the names and its complement,
/// which give back this rank's own only when every rank's hash is the same.
pub(crate) fn agree_same_parameters<'p>(
    comm: &dyn Communicator,
    paths: impl Iterator<Item = &'p str>,
) -> Result<()> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    // FNV-1a over the names, each ended by a zero byte.
    let (mut hash, mut count) = (0x811c_9dc5u32, 0);
    for path in paths {
        count += 1;
        for byte in path.bytes().chain([0]) {
            hash = (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193);
        }
    }
    let (max, max_complement) = (comm.all_reduce_max_u32(hash)?, comm.all_reduce_max_u32(!hash)?);
    if (max, max_complement) != (hash, !hash) {
        return Err(Error::GradientsDiffer { rank: comm.rank(), count });
    }
    Ok(())
}

/// Whether any rank found a non-finite value (`local` on this rank), and the lowest rank that did: one
/// MAX all-reduce of one word, so every rank takes the same decision. The word carries
/// `world_size - rank` for a rank that found one, 0 otherwise: the largest names the lowest rank.
pub fn agree_non_finite(comm: &dyn Communicator, local: bool) -> Result<Option<usize>> {
    Ok(agree_lowest(comm, u32::from(local))?.map(|(_, rank)| rank))
}

/// The most severe `kind` (0: nothing found, up to 255) found on any rank and the lowest rank that
/// found it, in one MAX all-reduce of `kind << 24 | (world_size - rank)`.
pub(crate) fn agree_lowest(comm: &dyn Communicator, kind: u32) -> Result<Option<(u32, usize)>> {
    const RANK_BITS: u32 = 24;
    let world = comm.world_size();
    if world >= 1 << RANK_BITS || kind >= 1 << (32 - RANK_BITS) {
        return Err(Error::CollectiveShape {
            collective: "agreement",
            reason: format!("{world} ranks or finding kind {kind} do not fit the one-word agreement"),
        });
    }
    let word = if kind == 0 { 0 } else { kind << RANK_BITS | (world - comm.rank()) as u32 };
    let max = comm.all_reduce_max_u32(word)?;
    if max == 0 {
        return Ok(None);
    }
    let low = (max & ((1 << RANK_BITS) - 1)) as usize;
    Ok(Some((max >> RANK_BITS, world - low)))
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;
    use crate::distributed::SingleProcess;

    fn read(t: &Tensor) -> Vec<f32> {
        t.to_dtype(DType::F32).and_then(|t| t.to_vec1()).expect("a float vector")
    }

    #[test]
    fn buckets_span_tensors_of_every_dtype_and_carry_each_value_once() -> Result<()> {
        let comm = SingleProcess::new();
        let f32s = Tensor::new(&[1.0f32, -2.0, 3.0e-3, 4.0, 5.0], &Device::Cpu)?;
        let halves = Tensor::new(&[0.5f32, 1.0e-3, -7.0], &Device::Cpu)?.to_dtype(DType::F16)?;
        let bf16s = Tensor::new(&[3.0f32, 1.0 + 1.0 / 64.0], &Device::Cpu)?.to_dtype(DType::BF16)?;
        let (want_f32, want_f16, want_bf16) = (read(&f32s), read(&halves), read(&bf16s));
        // Buckets of 3 values: [f32 0..3], [f32 3..5, f16 0], [f16 1..3], [bf16 0..2].
        let config = DataParallelConfig { bucket_bytes: 12, predivide_factor: 4.0, ..Default::default() };
        all_reduce_gradients(&comm, &[&f32s, &halves, &bf16s], &config)?;
        let traffic = comm.traffic();
        assert_eq!((traffic.calls, traffic.all_reduce), (4, 4 * 10));
        // One rank, a power-of-two factor: every value comes back exactly, in its dtype.
        assert_eq!((read(&f32s), read(&halves), read(&bf16s)), (want_f32, want_f16, want_bf16));
        // A bf16 wire rounds the f32 values to 8 significant bits on the way.
        let config = DataParallelConfig { wire: Wire::Bf16, ..Default::default() };
        all_reduce_gradients(&comm, &[&f32s], &config)?;
        assert_eq!(read(&f32s)[2], half::bf16::from_f32(3.0e-3).to_f32());
        Ok(())
    }

    #[test]
    fn agreement_names_the_rank_and_settings_are_checked() -> Result<()> {
        let comm = SingleProcess::new();
        assert_eq!(agree_non_finite(&comm, true)?, Some(0));
        assert_eq!(agree_non_finite(&comm, false)?, None);
        assert_eq!(agree_lowest(&comm, 3)?, Some((3, 0)));
        assert!(agree_lowest(&comm, 256).is_err());
        for bad in [
            DataParallelConfig { bucket_bytes: 3, ..Default::default() },
            DataParallelConfig { predivide_factor: 0.0, ..Default::default() },
            DataParallelConfig { predivide_factor: f32::NAN, ..Default::default() },
        ] {
            assert!(matches!(bad.validate(), Err(Error::InvalidDataParallelConfig { .. })), "{bad:?}");
        }
        Ok(())
    }
}
