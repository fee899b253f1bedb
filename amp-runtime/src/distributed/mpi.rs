//! The MPI communicator (rsmpi): MPI's world group, launched by `mpirun -np N`, `srun`, or any MPI
//! launcher.
//!
//! MPI's default error handler aborts the whole job on a communication failure (a peer that died, a
//! network error): a collective never returns an error here, and no rank is left waiting for a dead
//! one. Errors returned are for calls that cannot be valid (lengths, roots, MPI initialized twice).
//!
//! A panic that unwinds through an [`Mpi`] aborts the job (MPI_Abort) instead of finalizing: finalizing
//! waits for every rank, and the others would wait in their next collective for this one, for ever. A
//! rank that returns an error its peers do not share should end the job the same way, with
//! [`Mpi::abort`].

use ::mpi::collective::{SystemOperation, UserOperation};
use ::mpi::environment::Universe;
use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::{Communicator as _, CommunicatorCollectives, Root};

use super::communicator::{check_blocks, check_root, Collective, Communicator, Traffic, TrafficReport};
use super::wire::{sum_half_words, HalfWire, Wire};
use crate::error::{Error, Result};

/// MPI's world: every process the launcher started. Create one per process, before any other MPI use,
/// and keep it until the end of training: dropping it finalizes MPI.
pub struct Mpi {
    // Fields drop in order: the reduction ops and the communicator before the universe finalizes MPI.
    bf16_sum: UserOperation<'static>,
    f16_sum: UserOperation<'static>,
    world: SimpleCommunicator,
    traffic: Traffic,
    _universe: Universe,
}

impl std::fmt::Debug for Mpi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mpi").field("rank", &self.rank()).field("world_size", &self.world_size()).finish()
    }
}

impl Mpi {
    /// Initializes MPI (single-threaded: call collectives from the thread that created it) and joins its
    /// world. Started without a launcher, the process is a world of one.
    ///
    /// # Errors
    /// [`Error::MpiInit`] when MPI is already initialized in this process.
    pub fn init() -> Result<Self> {
        let universe = ::mpi::initialize().ok_or_else(|| Error::MpiInit {
            reason: "MPI is already initialized in this process: create one `Mpi` per process and share it \
                     by reference"
                .into(),
        })?;
        Ok(Mpi {
            bf16_sum: half_sum(HalfWire::Bf16),
            f16_sum: half_sum(HalfWire::F16),
            world: universe.world(),
            traffic: Traffic::default(),
            _universe: universe,
        })
    }

    /// Ends every process of the job at once with `code` (MPI_Abort): for a rank that cannot go on,
    /// so that the others do not wait for it in their next collective.
    pub fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }

    fn sum_op(&self, half: HalfWire) -> &UserOperation<'static> {
        match half {
            HalfWire::Bf16 => &self.bf16_sum,
            HalfWire::F16 => &self.f16_sum,
        }
    }

    fn root(&self, root: usize) -> ::mpi::topology::Process<'_> {
        self.world.process_at_rank(root as i32)
    }
}

impl Drop for Mpi {
    fn drop(&mut self) {
        if std::thread::panicking() {
            tracing::error!(
                "rank {}: panicked; aborting the MPI job so that no rank waits for it",
                self.rank()
            );
            self.world.abort(101);
        }
    }
}

/// The reduction op of a 16-bit wire over `u16` words ([`sum_half_words`]).
fn half_sum(half: HalfWire) -> UserOperation<'static> {
    UserOperation::commutative(move |input, inout| {
        // Only this module hands these ops to MPI, always over u16 buffers; MPI aborts the job if a
        // user op panics, which is what a broken invariant here deserves.
        let input = input.downcast::<u16>().expect("amp's half-sum op runs on u16 words only");
        let inout = inout.downcast::<u16>().expect("amp's half-sum op runs on u16 words only");
        sum_half_words(half, input, inout);
    })
}

/// [`Error::CollectiveShape`] when MPI's `int` count cannot hold `len` values.
fn check_count(collective: &'static str, len: usize) -> Result<()> {
    if i32::try_from(len).is_ok() {
        return Ok(());
    }
    Err(Error::CollectiveShape {
        collective,
        reason: format!("{len} values exceed MPI's count limit (2^31 - 1): split the call into buckets"),
    })
}

impl Communicator for Mpi {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    fn world_size(&self) -> usize {
        self.world.size() as usize
    }

    fn traffic(&self) -> TrafficReport {
        self.traffic.report()
    }

    fn all_reduce_sum(&self, values: &mut [f32], wire: Wire) -> Result<()> {
        check_count("all_reduce_sum", values.len())?;
        self.traffic.record(Collective::AllReduce, values.len() * wire.bytes_per_value());
        match wire.half() {
            None => {
                let send = values.to_vec();
                self.world.all_reduce_into(&send[..], values, SystemOperation::sum());
            }
            Some(half) => {
                let send = half.encode_all(values);
                let mut sum = vec![0u16; send.len()];
                self.world.all_reduce_into(&send[..], &mut sum[..], self.sum_op(half));
                half.decode_into(&sum, values);
            }
        }
        Ok(())
    }

    fn all_reduce_max_u32(&self, word: u32) -> Result<u32> {
        self.traffic.record(Collective::AllReduce, 4);
        let mut max = 0u32;
        self.world.all_reduce_into(&word, &mut max, SystemOperation::max());
        Ok(max)
    }

    fn reduce_scatter_sum(&self, values: &[f32], out: &mut [f32], wire: Wire) -> Result<()> {
        check_blocks("reduce_scatter_sum", values.len(), out.len(), self.world_size())?;
        check_count("reduce_scatter_sum", values.len())?;
        self.traffic.record(Collective::ReduceScatter, values.len() * wire.bytes_per_value());
        match wire.half() {
            None => self.world.reduce_scatter_block_into(values, out, SystemOperation::sum()),
            Some(half) => {
                let send = half.encode_all(values);
                let mut block = vec![0u16; out.len()];
                self.world.reduce_scatter_block_into(&send[..], &mut block[..], self.sum_op(half));
                half.decode_into(&block, out);
            }
        }
        Ok(())
    }

    fn all_gather(&self, mine: &[f32], out: &mut [f32]) -> Result<()> {
        check_blocks("all_gather", out.len(), mine.len(), self.world_size())?;
        check_count("all_gather", out.len())?;
        self.traffic.record(Collective::AllGather, 4 * mine.len());
        self.world.all_gather_into(mine, out);
        Ok(())
    }

    fn broadcast(&self, values: &mut [f32], root: usize) -> Result<()> {
        check_root("broadcast", root, self.world_size())?;
        check_count("broadcast", values.len())?;
        self.traffic.record(Collective::Broadcast, 4 * values.len());
        self.root(root).broadcast_into(values);
        Ok(())
    }

    fn broadcast_bytes(&self, bytes: &mut [u8], root: usize) -> Result<()> {
        check_root("broadcast_bytes", root, self.world_size())?;
        check_count("broadcast_bytes", bytes.len())?;
        self.traffic.record(Collective::Broadcast, bytes.len());
        self.root(root).broadcast_into(bytes);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.traffic.record(Collective::AllReduce, 0);
        self.world.barrier();
        Ok(())
    }
}
