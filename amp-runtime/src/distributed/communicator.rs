//! The collectives data-parallel training needs, whatever moves the bytes, and the one-process group.

use std::sync::atomic::{AtomicU64, Ordering};

use super::device::DeviceCollectives;
use super::wire::{round_trip, Wire};
use crate::error::{Error, Result};

/// A group of ranks that run the same program and exchange values through collectives. Every rank must
/// call the same collectives in the same order with the same lengths, as with MPI itself.
///
/// Implementations: [`SingleProcess`] (one rank, every collective the identity),
/// [`Mpi`](super::Mpi) (feature `mpi`) and [`Nccl`](super::Nccl) (feature `nccl`, which also moves
/// device memory: [`device_collectives`](Self::device_collectives)).
pub trait Communicator: std::fmt::Debug {
    /// This process's rank, `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn world_size(&self) -> usize;

    /// Payload bytes this rank has handed to each kind of collective so far.
    fn traffic(&self) -> TrafficReport;

    /// Replaces `values` by their element-wise sum over all ranks, the values travelling as `wire`
    /// says (a 16-bit wire rounds each value once, and each combine of partial sums once).
    fn all_reduce_sum(&self, values: &mut [f32], wire: Wire) -> Result<()>;

    /// The largest `word` of all ranks.
    fn all_reduce_max_u32(&self, word: u32) -> Result<u32>;

    /// The largest `value` of all ranks, in IEEE total order: a NaN (positive sign) on any rank wins
    /// over everything, so every rank gets the same answer.
    fn all_reduce_max_f32(&self, value: f32) -> Result<f32> {
        Ok(from_ordered(self.all_reduce_max_u32(to_ordered(value))?))
    }

    /// Sums `values` (`world_size()` equal blocks) over all ranks and leaves block `rank()` of the sum
    /// in `out`.
    fn reduce_scatter_sum(&self, values: &[f32], out: &mut [f32], wire: Wire) -> Result<()>;

    /// Concatenates every rank's `mine` (equal lengths), in rank order, into `out`.
    fn all_gather(&self, mine: &[f32], out: &mut [f32]) -> Result<()>;

    /// Copies `root`'s `values` into every rank's `values` (same length everywhere), exactly.
    fn broadcast(&self, values: &mut [f32], root: usize) -> Result<()>;

    /// Copies `root`'s `bytes` into every rank's `bytes` (same length everywhere).
    fn broadcast_bytes(&self, bytes: &mut [u8], root: usize) -> Result<()>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;

    /// The collectives on device memory, when this group's engine moves GPU buffers itself (NCCL);
    /// `None` (the default) when it moves host memory only (MPI, one process).
    fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        None
    }
}

/// Which collective a byte count belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collective {
    /// [`Communicator::all_reduce_sum`] and the max reductions.
    AllReduce,
    /// [`Communicator::reduce_scatter_sum`].
    ReduceScatter,
    /// [`Communicator::all_gather`].
    AllGather,
    /// [`Communicator::broadcast`] and [`Communicator::broadcast_bytes`].
    Broadcast,
}

/// Payload bytes one rank handed to collectives: the size of what it contributes, in the wire's dtype,
/// not what the transport's algorithm ends up sending (a ring all-reduce moves about twice as much).
/// The ratio between two wires is what it measures exactly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrafficReport {
    /// Bytes given to all-reduces (sums and max words).
    pub all_reduce: u64,
    /// Bytes given to reduce-scatters.
    pub reduce_scatter: u64,
    /// Bytes given to all-gathers.
    pub all_gather: u64,
    /// Bytes broadcast (counted on every rank, root or not).
    pub broadcast: u64,
    /// Collective calls of any kind, barriers included.
    pub calls: u64,
}

/// Counters behind a [`TrafficReport`], for implementations of [`Communicator`].
#[derive(Debug, Default)]
pub struct Traffic {
    bytes: [AtomicU64; 4],
    calls: AtomicU64,
}

impl Traffic {
    /// Counts one call of `collective` carrying `bytes` (0 for a barrier).
    pub fn record(&self, collective: Collective, bytes: usize) {
        self.bytes[collective as usize].fetch_add(bytes as u64, Ordering::Relaxed);
        self.calls.fetch_add(1, Ordering::Relaxed);
    }

    /// The counts so far.
    pub fn report(&self) -> TrafficReport {
        let read = |c: Collective| self.bytes[c as usize].load(Ordering::Relaxed);
        TrafficReport {
            all_reduce: read(Collective::AllReduce),
            reduce_scatter: read(Collective::ReduceScatter),
            all_gather: read(Collective::AllGather),
            broadcast: read(Collective::Broadcast),
            calls: self.calls.load(Ordering::Relaxed),
        }
    }
}

/// Maps an f32 to a u32 whose unsigned order is IEEE total order.
fn to_ordered(value: f32) -> u32 {
    let bits = value.to_bits();
    if bits & 0x8000_0000 != 0 {
        !bits
    } else {
        bits | 0x8000_0000
    }
}

fn from_ordered(word: u32) -> f32 {
    f32::from_bits(if word & 0x8000_0000 != 0 { word & 0x7fff_ffff } else { !word })
}

/// [`Error::CollectiveShape`] unless `values` is `world` blocks of `out.len()` values.
pub(crate) fn check_blocks(collective: &'static str, whole: usize, block: usize, world: usize) -> Result<()> {
    if whole == block * world {
        return Ok(());
    }
    Err(Error::CollectiveShape {
        collective,
        reason: format!(
            "{whole} values in the whole buffer, {block} in one rank's block, {world} ranks: the whole must \
             be exactly world_size x block (pad the buffer to a multiple of the world size)"
        ),
    })
}

/// [`Error::CollectiveShape`] unless `root` is a rank.
pub(crate) fn check_root(collective: &'static str, root: usize, world: usize) -> Result<()> {
    if root < world {
        return Ok(());
    }
    Err(Error::CollectiveShape {
        collective,
        reason: format!("root rank {root} does not exist in a world of {world} rank(s)"),
    })
}

/// A group of one: this process alone. Every collective is the identity (a 16-bit wire still rounds
/// each value through its type, as it would travelling), so code written for data parallelism runs
/// and is tested unchanged on one process. It moves nothing: no thread, no socket.
#[derive(Debug, Default)]
pub struct SingleProcess {
    traffic: Traffic,
}

impl SingleProcess {
    /// The group of this process alone.
    pub fn new() -> Self {
        SingleProcess::default()
    }
}

impl Communicator for SingleProcess {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn traffic(&self) -> TrafficReport {
        self.traffic.report()
    }

    fn all_reduce_sum(&self, values: &mut [f32], wire: Wire) -> Result<()> {
        self.traffic.record(Collective::AllReduce, values.len() * wire.bytes_per_value());
        round_trip(wire, values);
        Ok(())
    }

    fn all_reduce_max_u32(&self, word: u32) -> Result<u32> {
        self.traffic.record(Collective::AllReduce, 4);
        Ok(word)
    }

    fn reduce_scatter_sum(&self, values: &[f32], out: &mut [f32], wire: Wire) -> Result<()> {
        check_blocks("reduce_scatter_sum", values.len(), out.len(), 1)?;
        self.traffic.record(Collective::ReduceScatter, values.len() * wire.bytes_per_value());
        out.copy_from_slice(values);
        round_trip(wire, out);
        Ok(())
    }

    fn all_gather(&self, mine: &[f32], out: &mut [f32]) -> Result<()> {
        check_blocks("all_gather", out.len(), mine.len(), 1)?;
        self.traffic.record(Collective::AllGather, 4 * mine.len());
        out.copy_from_slice(mine);
        Ok(())
    }

    fn broadcast(&self, values: &mut [f32], root: usize) -> Result<()> {
        check_root("broadcast", root, 1)?;
        self.traffic.record(Collective::Broadcast, 4 * values.len());
        Ok(())
    }

    fn broadcast_bytes(&self, bytes: &mut [u8], root: usize) -> Result<()> {
        check_root("broadcast_bytes", root, 1)?;
        self.traffic.record(Collective::Broadcast, bytes.len());
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.traffic.record(Collective::AllReduce, 0);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordered_words_sort_as_ieee_total_order() {
        let values = [f32::NEG_INFINITY, -1.0, -0.0, 0.0, 1e-45, 1.0, f32::MAX, f32::INFINITY, f32::NAN];
        let words: Vec<u32> = values.iter().map(|&v| to_ordered(v)).collect();
        assert!(words.windows(2).all(|w| w[0] < w[1]), "{words:x?}");
        for v in values {
            assert_eq!(from_ordered(to_ordered(v)).to_bits(), v.to_bits());
        }
    }

    #[test]
    fn single_process_is_the_identity_and_counts_payload() -> Result<()> {
        let comm = SingleProcess::new();
        let mut values = vec![1.0, -2.5, 3.0e-3];
        comm.all_reduce_sum(&mut values, Wire::F32)?;
        assert_eq!(values, vec![1.0, -2.5, 3.0e-3]);
        comm.all_reduce_sum(&mut values, Wire::Bf16)?;
        assert_eq!(values[2], half::bf16::from_f32(3.0e-3).to_f32());
        assert_eq!(comm.all_reduce_max_f32(-4.0)?, -4.0);
        let mut out = vec![0.0; 3];
        comm.all_gather(&values, &mut out)?;
        assert_eq!(out, values);
        assert!(matches!(comm.broadcast(&mut out, 1), Err(Error::CollectiveShape { .. })));
        assert!(matches!(comm.all_gather(&values, &mut [0.0; 2]), Err(Error::CollectiveShape { .. })));
        let traffic = comm.traffic();
        assert_eq!(traffic.all_reduce, 12 + 6 + 4);
        assert_eq!(traffic.all_gather, 12);
        Ok(())
    }
}
