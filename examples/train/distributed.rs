//! `--data-parallel`: the main job as one rank of an MPI job (`mpirun -np 2 target/release/examples/train
//! --data-parallel`, built with `--features mpi`).
//!
//! Every rank draws the same data stream and the same initial weights, then rank 0's weights are
//! broadcast to all (`DataParallel::broadcast_masters`). Of each batch of `B` sequences, rank `r` of `W`
//! trains on rows `[r B / W, (r + 1) B / W)`; `DataParallel::step_fused` averages the gradients over
//! the ranks, so a step of `W` ranks is the step of one process on the whole batch (up to the order of
//! floating-point sums). The loss logged is the mean over the ranks, i.e. over the whole batch. Only
//! rank 0 prints and writes files; at the end, every rank's median step time and the bytes it handed
//! to collectives are gathered to rank 0 for a per-rank table.
//!
//! This module uses only `amp::distributed`'s `Communicator`, which exists in every build; `main`
//! refuses `--data-parallel` in a build without the `mpi` feature, where `Mpi::init` cannot work.

use amp::distributed::{Communicator, DataParallel, DataParallelConfig, Mpi, Wire};
use candle_core::Tensor;

use crate::{Error, Run};

/// This process's place in a data-parallel job: its group and how gradients travel.
#[derive(Clone, Copy, Debug)]
pub struct Group<'c> {
    comm: &'c dyn Communicator,
    config: DataParallelConfig,
}

impl<'c> Group<'c> {
    /// The group of `comm`, gradients travelling as `wire`.
    pub fn new(comm: &'c dyn Communicator, wire: Wire) -> Self {
        Group { comm, config: DataParallelConfig { wire, ..DataParallelConfig::default() } }
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.comm.world_size()
    }

    /// The gradient wire's name, as `--wire` takes it.
    pub fn wire(&self) -> &'static str {
        match self.config.wire {
            Wire::F32 => "f32",
            Wire::Bf16 => "bf16",
            Wire::F16 => "f16",
        }
    }

    /// The data-parallel step over this group.
    pub fn data_parallel(&self) -> amp::Result<DataParallel<'c>> {
        DataParallel::new(self.comm, self.config)
    }

    /// A refusal, the same on every rank, unless `batch` sequences split evenly over the ranks.
    pub fn check_batch(&self, batch: usize) -> Result<(), String> {
        let world = self.world();
        if batch.is_multiple_of(world) {
            return Ok(());
        }
        let fits: Vec<String> =
            (1..=batch).filter(|w| batch.is_multiple_of(*w)).map(|w| w.to_string()).collect();
        Err(format!(
            "a batch of {batch} sequences does not split evenly over {world} ranks: every rank must train on \
             the same number of rows for the averaged gradient to be the whole batch's; launch with -np {}",
            fits.join(", -np ")
        ))
    }

    /// This rank's rows of a batch: inputs `(B, seq)` and flattened targets `(B * seq,)` become rows
    /// `[rank B / W, (rank + 1) B / W)` of each.
    pub fn rows(&self, (ids, targets): &(Tensor, Tensor)) -> candle_core::Result<(Tensor, Tensor)> {
        let (batch, seq) = ids.dims2()?;
        let rows = batch / self.world();
        let first = self.rank() * rows;
        Ok((ids.narrow(0, first, rows)?, targets.narrow(0, first * seq, rows * seq)?))
    }

    /// The mean of every rank's `value` (each rank's loss is the mean over its rows; rows are split
    /// evenly, so this is the mean over the whole batch).
    pub fn mean(&self, value: f32) -> amp::Result<f32> {
        let mut sum = [value];
        self.comm.all_reduce_sum(&mut sum, Wire::F32)?;
        Ok(sum[0] / self.world() as f32)
    }

    /// Payload bytes this rank has handed to collectives of any kind so far.
    pub fn bytes_sent(&self) -> u64 {
        let t = self.comm.traffic();
        t.all_reduce + t.reduce_scatter + t.all_gather + t.broadcast
    }

    /// Every rank's median step time and bytes sent for each of `runs` (same runs, same order on every
    /// rank), gathered with one all-gather: `[rank][run]`.
    pub fn gather(&self, runs: &[Run]) -> amp::Result<Vec<Vec<RankRun>>> {
        // Per run: the median in ms, then the byte count in four 16-bit limbs (an f32 holds each exactly).
        const WORDS: usize = 5;
        let mine: Vec<f32> = runs
            .iter()
            .flat_map(|run| {
                let limbs = (0..4).map(|i| ((run.sent >> (16 * i)) & 0xffff) as f32);
                std::iter::once(run.median_ms() as f32).chain(limbs)
            })
            .collect();
        let mut all = vec![0.0; mine.len() * self.world()];
        self.comm.all_gather(&mine, &mut all)?;
        Ok(all
            .chunks_exact(mine.len().max(1))
            .map(|rank| {
                rank.chunks_exact(WORDS)
                    .map(|w| RankRun {
                        median_ms: f64::from(w[0]),
                        sent: (0..4).map(|i| (w[1 + i] as u64) << (16 * i)).sum(),
                    })
                    .collect()
            })
            .collect())
    }
}

/// One rank's numbers for one run.
#[derive(Clone, Copy, Debug)]
pub struct RankRun {
    pub median_ms: f64,
    /// Payload bytes this rank handed to collectives during the run's steps.
    pub sent: u64,
}

/// The per-rank table (print it on rank 0): each run's median step time and bytes sent on every rank.
pub fn rank_table(group: &Group<'_>, runs: &[Run], ranks: &[Vec<RankRun>], steps: usize) {
    println!(
        "per rank: {} ranks, gradients on the {} wire; sent = payload bytes this rank handed to collectives \
         during the steps (gradients, the loss and the agreement words)",
        group.world(),
        group.wire()
    );
    println!("{:<5} {:<9} {:>8} {:>10} {:>12}", "rank", "run", "step ms", "sent MB", "sent/step KB");
    for (rank, rank_runs) in ranks.iter().enumerate() {
        for (run, numbers) in runs.iter().zip(rank_runs) {
            println!(
                "{rank:<5} {:<9} {:>8.2} {:>10.2} {:>12.1}",
                run.name,
                numbers.median_ms,
                numbers.sent as f64 / 1e6,
                numbers.sent as f64 / 1e3 / steps as f64
            );
        }
    }
    println!();
}

/// The per-rank numbers for results.json.
pub fn ranks_json(runs: &[Run], ranks: &[Vec<RankRun>]) -> serde_json::Value {
    let rows: Vec<_> = ranks
        .iter()
        .enumerate()
        .flat_map(|(rank, rank_runs)| {
            runs.iter().zip(rank_runs).map(move |(run, n)| {
                serde_json::json!({
                    "rank": rank, "run": run.name, "median_step_ms": n.median_ms, "bytes_sent": n.sent,
                })
            })
        })
        .collect();
    serde_json::Value::Array(rows)
}

/// Runs `job` as one rank of an MPI job and ends the whole job if this rank fails (returning would
/// finalize MPI, which waits for peers that may be waiting in a collective for this rank).
pub fn launch(
    wire: Wire,
    batch: usize,
    job: impl FnOnce(Group<'_>) -> Result<(), Error>,
) -> Result<(), Error> {
    use_local_share_of_cores();
    let refused = {
        let comm = Mpi::init()?;
        let group = Group::new(&comm, wire);
        match group.check_batch(batch) {
            // The same refusal on every rank: rank 0 says it; every rank finalizes MPI, then exits.
            Err(refusal) => {
                if group.rank() == 0 {
                    eprintln!("error: {refusal}");
                }
                true
            }
            Ok(()) => {
                if let Err(e) = job(group) {
                    eprintln!("rank {}: {e}", comm.rank());
                    comm.abort(1);
                }
                false
            }
        }
    }; // MPI finalized
    if refused {
        std::process::exit(2);
    }
    Ok(())
}

/// Sizes rayon's pool (amp's GEMM and optimizer) to this rank's share of the machine's cores when the
/// launcher says how many ranks share it (Open MPI: `OMPI_COMM_WORLD_LOCAL_SIZE`, MPICH:
/// `MPI_LOCALNRANKS`), so that ranks on one machine do not oversubscribe it. An explicit
/// `RAYON_NUM_THREADS` wins. Called before rayon's first use.
fn use_local_share_of_cores() {
    if std::env::var_os("RAYON_NUM_THREADS").is_some() {
        return;
    }
    if let Some(threads) = amp::distributed::local_share_of_cores() {
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    }
}
