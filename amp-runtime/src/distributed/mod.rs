//! Data-parallel training: every rank (process) holds the whole model, trains on its own share of each
//! batch, and steps with gradients averaged over the ranks, so that all ranks stay bit-identical.
//!
//! - [`Communicator`]: the collectives (all-reduce, reduce-scatter, all-gather, broadcast, barrier),
//!   implemented by [`SingleProcess`] (one rank: the identity, for code and tests without a launcher)
//!   [`Mpi`] (MPI's world through rsmpi, feature `mpi`; launch with `mpirun -np N`) and [`Nccl`]
//!   (NVIDIA's NCCL through cudarc, feature `nccl`: one GPU per rank, its id handed out over MPI),
//!   which also sums and broadcasts CUDA tensors where they are ([`DeviceCollectives`]).
//! - [`Wire`]: the dtype gradients travel in (fp32 by default; bf16 or fp16 halve the bytes, sent as
//!   16-bit words and summed in f32 with one rounding per combine).
//! - [`broadcast_masters`], [`all_reduce_gradients`], [`agree_non_finite`]: the building blocks.
//! - [`DataParallel::step_fused`]: the fused training step with the all-reduce after backward and one
//!   agreed skip decision, the loss scale moving alike on every rank.
//! - [`Zero1`]: ZeRO stage 1, the optimizer state sharded across the ranks (reduce-scatter of the
//!   gradients, each rank steps the tensors it owns, all-gather of the updated masters), with
//!   checkpoints that load on any world size.
//!
//! docs/DISTRIBUTED.md in the repository says how to launch and why the rules are what they are.

mod communicator;
mod data_parallel;
mod device;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(not(feature = "mpi"))]
#[path = "mpi_disabled.rs"]
mod mpi;
#[cfg(feature = "nccl")]
mod nccl;
#[cfg(not(feature = "nccl"))]
#[path = "nccl_disabled.rs"]
mod nccl;
mod step;
#[cfg(any(not(feature = "mpi"), not(feature = "nccl")))]
mod uninhabited;
mod wire;
mod zero;
mod zero_checkpoint;
mod zero_gather;

pub use communicator::{Collective, Communicator, SingleProcess, Traffic, TrafficReport};
pub use data_parallel::{agree_non_finite, all_reduce_gradients, broadcast_masters, DataParallelConfig};
pub use device::DeviceCollectives;
pub use mpi::Mpi;
pub use nccl::Nccl;
pub use step::DataParallel;
pub use wire::{sum_half_words, HalfWire, Wire};
pub use zero::Zero1;

/// This rank's index among the ranks the launcher started on this machine (Open MPI's
/// `OMPI_COMM_WORLD_LOCAL_RANK`, MPICH's `MPI_LOCALRANKID`, Slurm's `SLURM_LOCALID`): the GPU ordinal to
/// give [`Nccl`] when each machine runs one rank per GPU. `None` when no launcher says so.
pub fn local_rank() -> Option<usize> {
    ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"]
        .iter()
        .find_map(|name| std::env::var(name).ok()?.parse::<usize>().ok())
}

/// The threads this rank should give its compute pool (rayon: amp's GEMM and optimizers) when the
/// launcher says how many ranks share this machine (Open MPI's `OMPI_COMM_WORLD_LOCAL_SIZE`, MPICH's
/// `MPI_LOCALNRANKS`): the machine's cores divided among them, at least 1. `None` when no launcher says
/// so. Ranks on one machine that each size their pool to all its cores oversubscribe it.
pub fn local_share_of_cores() -> Option<usize> {
    let local = ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"]
        .iter()
        .find_map(|name| std::env::var(name).ok()?.parse::<usize>().ok())
        .filter(|&n| n > 0)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Some((cores / local).max(1))
}
