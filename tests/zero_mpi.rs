//! ZeRO stage 1 (`amp::distributed::Zero1`) over real MPI processes, against plain data parallelism:
//! the same training to the bit, a fraction of the optimizer state per rank, agreed skips, and one
//! checkpoint file that loads on any world size. Each test launches `mpirun -np N` on itself
//! (`mpi_launch`). Needs the `mpi` feature and Open MPI's `mpirun` (.ci/run installs it).

mod common;
mod mpi_launch;
mod mpi_training;
mod reliability;

use amp::checkpoint::TrainingState;
use amp::distributed::{Communicator, DataParallel, DataParallelConfig, Mpi, SingleProcess, Zero1};
use amp::nn::Linear;
use amp::optim::ParamGroups;
use amp::scaler::{GradAccumulator, SkipReason};
use amp::{AmpModuleExt, GradientRoute, ParamStorage, Precision};
use mpi_launch::{on_ranks, on_ranks_with_env, Outcome};
use mpi_training::{loss, masters, mlp, same_bits, scaler, Kind, Optimizer};

/// Every working copy of a model with sharded masters, and every master it still holds, bit-identical
/// to the data-parallel model's.
fn assert_same_weights(what: &str, zero_net: &Vec<Linear>, dp_net: &Vec<Linear>, half: Precision) {
    for ((name, z), (_, d)) in zero_net.named_params().iter().zip(&dp_net.named_params()) {
        let bits = |p: &amp::Param| reliability::bits(p.trainable().as_tensor());
        assert_eq!(bits(z), bits(d), "{what}: the working copy of {name} differs");
        if z.storage() != ParamStorage::Half(half) {
            let master = |p: &amp::Param| reliability::bits(p.master().as_tensor());
            assert_eq!(master(z), master(d), "{what}: the master of {name} differs");
        }
    }
}

/// Rows of the 16-row batch that rank `rank` of `world` trains on.
fn my_rows(rank: usize, world: usize) -> std::ops::Range<usize> {
    let per = 16 / world;
    rank * per..(rank + 1) * per
}

/// Every rank's `value`, in rank order (exact for values below 2^24).
fn gather(comm: &Mpi, value: usize) -> amp::Result<Vec<usize>> {
    assert!(value < 1 << 24, "{value} does not travel exactly as an f32");
    let mut all = vec![0.0; comm.world_size()];
    comm.all_gather(&[value as f32], &mut all)?;
    Ok(all.iter().map(|&v| v as usize).collect())
}

/// A saved state's settings (as JSON values: the gathered state's fields may come in another order)
/// and its tensors' dtypes and bits, by name.
type StateBits = (serde_json::Value, Vec<(String, String, Vec<u32>)>);

/// A saved state with its tensors sorted by name, as dtypes and bits, for comparisons.
fn state_bits(state: amp::checkpoint::SavedState) -> StateBits {
    let mut tensors: Vec<_> = state
        .tensors
        .iter()
        .map(|(n, t)| (n.clone(), format!("{:?}", t.dtype()), reliability::bits(t)))
        .collect();
    tensors.sort();
    let json = serde_json::from_str(&state.json)
        .unwrap_or_else(|e| serde_json::Value::String(format!("unreadable ({e}): {}", state.json)));
    (json, tensors)
}

/// The optimizers of the bit-identity test: AdamW, LAMB, and AdamW with bf16 moments (whose rounding
/// draws its random bits by parameter path, so the owner of a tensor draws what the unsharded
/// optimizer draws).
type MakeOptimizer = fn(ParamGroups) -> amp::Result<Optimizer>;
const OPTIMIZERS: [(&str, MakeOptimizer); 4] = [
    ("AdamW", |g| Optimizer::new(Kind::AdamW, g)),
    ("LAMB", |g| Optimizer::new(Kind::Lamb, g)),
    ("AdamW with bf16 moments", Optimizer::adamw_bf16_moments),
    ("LAMB with bf16 moments", Optimizer::lamb_bf16_moments),
];

/// ZeRO-1 and plain data parallelism compute the same averaged gradient (two ranks: one addition of the
/// two ranks' f32 values, commutative, whatever the bucket boundaries) and the same elementwise update of
/// each tensor (the owner runs the same fused kernel on the same master, moments and gradient; LAMB's
/// norms are per tensor and its owner has the whole tensor), and all-gathering masters moves them exactly:
/// so after 50 steps masters, working copies, the optimizer state (gathered) and the loss scale are
/// bit-identical, with no tolerance; an overflow injected on rank 1 (fp16) is skipped alike by both.
/// Each rank's optimizer state is measured and must be at most the
/// partition's guarantee, `unsharded / 2 + the largest tensor's state`, and sum to the unsharded state.
#[test]
fn zero1_trains_bit_identically_to_data_parallel_with_half_the_optimizer_state_per_rank() -> Outcome {
    let test = "zero1_trains_bit_identically_to_data_parallel_with_half_the_optimizer_state_per_rank";
    on_ranks(test, 2, |comm| {
        let (rank, world) = (comm.rank(), comm.world_size());
        for half in [Precision::Fp16, Precision::Bf16] {
            for (kind, make) in OPTIMIZERS {
                let what = format!("{half:?} {kind}, rank {rank}");
                let (dp_net, zero_net) = (mlp(half, 5 + rank as u64)?, mlp(half, 5)?); // rank 0 seeds both
                let mut dp = DataParallel::new(comm, DataParallelConfig::default())?;
                dp.broadcast_masters(&dp_net)?;
                // Buckets of 300 values per rank: the 1280-value blocks take five reduce-scatters.
                let buckets = DataParallelConfig { bucket_bytes: 4 * 2 * 300, ..Default::default() };
                let mut zero = Zero1::new(comm, ParamGroups::from_model(&zero_net)?, buckets)?;
                zero.broadcast_masters(&zero_net)?;
                let mut dp_opt = make(ParamGroups::from_model(&dp_net)?)?;
                let mut zero_opt = make(zero.local_groups())?;
                let (mut dp_scaler, mut zero_scaler) = (scaler(&dp_net)?, scaler(&zero_net)?);
                let mut skipped = 0;
                for step in 0..50 {
                    let rows = my_rows(rank, world);
                    // fp16, step 20: rank 1's gradients overflow, both runs skip and back the scale off.
                    let factor = if half == Precision::Fp16 && step == 20 && rank == 1 { 1e30 } else { 1.0 };
                    let dp_report = dp.step_fused(
                        &mut dp_scaler,
                        &(loss(&dp_net, step, rows.clone())? * factor)?,
                        dp_opt.fused(),
                        None,
                    )?;
                    let zero_report = zero.step_fused(
                        &mut zero_scaler,
                        &(loss(&zero_net, step, rows)? * factor)?,
                        zero_opt.fused(),
                        None,
                    )?;
                    assert_eq!(zero_report.skipped, dp_report.skipped, "{what}, step {step}");
                    skipped += usize::from(!dp_report.applied());
                }
                assert!(same_bits(&masters(&zero_net)?, &masters(&dp_net)?), "{what}: masters differ");
                assert_eq!(
                    reliability::snapshot(&zero_net, &[&zero_scaler])?,
                    reliability::snapshot(&dp_net, &[&dp_scaler])?,
                    "{what}: working copies or scaler differ"
                );
                assert_eq!(
                    state_bits(zero.gather_state(zero_opt.state())?),
                    state_bits(dp_opt.state().save_state()?),
                    "{what}: the gathered optimizer state differs from data parallelism's"
                );
                // Per-rank optimizer state.
                let (unsharded, per_rank) = (dp_opt.state_bytes(), gather(comm, zero_opt.state_bytes())?);
                let groups = ParamGroups::from_model(&zero_net)?;
                let largest = groups.params().iter().map(|p| p.elem_count()).max().unwrap_or(0);
                let largest = unsharded / groups.elem_count() * largest; // state bytes per element x elements
                assert_eq!(
                    per_rank.iter().sum::<usize>(),
                    unsharded,
                    "{what}: the shards cover the state once"
                );
                for &bytes in &per_rank {
                    assert!(bytes <= unsharded / world + largest, "{what}: {bytes} of {unsharded} bytes");
                }
                let injected = usize::from(half == Precision::Fp16);
                assert_eq!(skipped, injected, "{what}: {skipped} of 50 steps skipped");
                if rank == 0 {
                    let ratios: Vec<String> = per_rank
                        .iter()
                        .map(|&b| format!("{b} B ({:.3})", b as f64 / unsharded as f64))
                        .collect();
                    println!(
                        "{} {half:?} {kind}: optimizer state unsharded {unsharded} B per rank; ZeRO-1 on {world} \
                         ranks: {}; {skipped} of 50 steps skipped on both",
                        mpi_launch::REPORT,
                        ratios.join(", ")
                    );
                }
            }
        }
        Ok(())
    })
}

/// Sharded masters (`Zero1::shard_masters`): each rank keeps the fp32 masters of the tensors it owns
/// only and receives the others' half working copies after each step (2 bytes a value instead of 4).
/// It trains exactly as data parallelism does over 50 steps (AdamW and LAMB; fp16 with an overflow
/// injected on rank 1, and bf16; clipping on): every working copy, every master a rank still holds,
/// and the scaler bit-identical. Each
/// rank's fp32 masters (`master_bytes`) are within the partition's guarantee, `total / 2 + the largest
/// tensor's`, and sum to the unsharded total (printed); each step's all-gather hands over half the bytes
/// of the rank's fp32 shard (plus one padding word at most).
#[test]
fn sharded_masters_train_like_data_parallel_with_half_the_masters_per_rank() -> Outcome {
    let test = "sharded_masters_train_like_data_parallel_with_half_the_masters_per_rank";
    on_ranks(test, 2, |comm| {
        let (rank, world) = (comm.rank(), comm.world_size());
        for (half, kind) in
            [Precision::Fp16, Precision::Bf16].into_iter().flat_map(|h| [(h, Kind::AdamW), (h, Kind::Lamb)])
        {
            let what = format!("{half:?} {kind:?}, rank {rank}");
            let (mut dp_net, mut zero_net) = (mlp(half, 5 + rank as u64)?, mlp(half, 5)?); // rank 0 seeds both
                                                                                           // Sharded masters take gradients against the working copies; data parallelism does so too here.
            amp::set_gradient_route(&mut dp_net, GradientRoute::Working);
            let mut dp = DataParallel::new(comm, DataParallelConfig::default())?;
            dp.broadcast_masters(&dp_net)?;
            let groups = ParamGroups::from_model(&zero_net)?;
            let total = 4 * groups.elem_count();
            let largest = 4 * groups.params().iter().map(|p| p.elem_count()).max().unwrap_or(0);
            let mut zero = Zero1::new(comm, groups, DataParallelConfig::default())?;
            zero.broadcast_masters(&zero_net)?;
            assert_eq!(zero.master_bytes(), total, "{what}: before sharding every rank holds every master");
            let released = zero.shard_masters(&mut zero_net)?;
            let per_rank = gather(comm, zero.master_bytes())?;
            assert_eq!(zero.master_bytes() + released, total, "{what}");
            assert_eq!(per_rank.iter().sum::<usize>(), total, "{what}: the shards hold each master once");
            for &bytes in &per_rank {
                assert!(bytes <= total / world + largest, "{what}: {bytes} of {total} bytes of masters");
            }
            let mut dp_opt = Optimizer::new(kind, ParamGroups::from_model(&dp_net)?)?;
            let mut zero_opt = Optimizer::new(kind, zero.local_groups())?;
            let (mut dp_scaler, mut zero_scaler) = (scaler(&dp_net)?, scaler(&zero_net)?);
            let gathered_before = comm.traffic().all_gather;
            for step in 0..50 {
                let rows = my_rows(rank, world);
                let factor = if half == Precision::Fp16 && step == 10 && rank == 1 { 1e30 } else { 1.0 };
                let dp_loss = (loss(&dp_net, step, rows.clone())? * factor)?;
                let dp_report = dp.step_fused(&mut dp_scaler, &dp_loss, dp_opt.fused(), Some(1.0))?;
                let zero_loss = (loss(&zero_net, step, rows)? * factor)?;
                let zero_report =
                    zero.step_fused(&mut zero_scaler, &zero_loss, zero_opt.fused(), Some(1.0))?;
                assert_eq!(zero_report.skipped, dp_report.skipped, "{what}, step {step}");
            }
            let gathered = ((comm.traffic().all_gather - gathered_before) / 50) as usize;
            let shard = per_rank.iter().copied().max().unwrap_or(0);
            assert!(gathered <= shard / 2 + 4, "{what}: {gathered} B gathered a step for a {shard} B shard");
            assert_same_weights(&what, &zero_net, &dp_net, half);
            assert_eq!(zero_scaler.state(), dp_scaler.state(), "{what}: the scalers differ");
            if rank == 0 {
                println!(
                    "{} {half:?} {kind:?}: fp32 masters {total} B unsharded; with sharded masters on {world} ranks: \
                     {per_rank:?} B; all-gather {gathered} B a step per rank (the masters' would be {shard} B)",
                    mpi_launch::REPORT
                );
            }
        }
        Ok(())
    })
}

/// Gradient accumulation under ZeRO-1 with sharded masters (the non-owned parameters' gradients half,
/// summed in f32 like the rest) trains bit-identically to data parallelism accumulating the same
/// micro-batches, a window with an fp16 overflow on rank 1 skipped alike.
#[test]
fn accumulated_windows_under_zero1_train_bit_identically_to_data_parallel() -> Outcome {
    let test = "accumulated_windows_under_zero1_train_bit_identically_to_data_parallel";
    on_ranks(test, 2, |comm| {
        let (rank, world) = (comm.rank(), comm.world_size());
        for half in [Precision::Fp16, Precision::Bf16] {
            let what = format!("{half:?}, rank {rank}");
            let (mut dp_net, mut zero_net) = (mlp(half, 5 + rank as u64)?, mlp(half, 5)?);
            amp::set_gradient_route(&mut dp_net, GradientRoute::Working);
            let mut dp = DataParallel::new(comm, DataParallelConfig::default())?;
            dp.broadcast_masters(&dp_net)?;
            let mut zero =
                Zero1::new(comm, ParamGroups::from_model(&zero_net)?, DataParallelConfig::default())?;
            zero.broadcast_masters(&zero_net)?;
            zero.shard_masters(&mut zero_net)?;
            let mut dp_opt = Optimizer::new(Kind::AdamW, ParamGroups::from_model(&dp_net)?)?;
            let mut zero_opt = Optimizer::new(Kind::AdamW, zero.local_groups())?;
            let (mut dp_scaler, mut zero_scaler) = (scaler(&dp_net)?, scaler(&zero_net)?);
            let (mut dp_acc, mut zero_acc) = (GradAccumulator::new(), GradAccumulator::new());
            for window in 0..10 {
                let rows = my_rows(rank, world);
                let middle = rows.start + rows.len() / 2;
                for (micro, part) in [rows.start..middle, middle..rows.end].into_iter().enumerate() {
                    let overflow = half == Precision::Fp16 && window == 4 && rank == 1 && micro == 1;
                    let factor = if overflow { 1e30 } else { 0.5 };
                    let dp_loss = (loss(&dp_net, window, part.clone())? * factor)?;
                    dp_scaler.accumulate(&dp_net, &dp_loss, &mut dp_acc)?;
                    let zero_loss = (loss(&zero_net, window, part)? * factor)?;
                    zero_scaler.accumulate(&zero_net, &zero_loss, &mut zero_acc)?;
                }
                let dp_report =
                    dp.step_fused_accumulated(&mut dp_scaler, &mut dp_acc, dp_opt.fused(), Some(1.0))?;
                let zero_report = zero.step_fused_accumulated(
                    &mut zero_scaler,
                    &mut zero_acc,
                    zero_opt.fused(),
                    Some(1.0),
                )?;
                assert_eq!(zero_report.skipped, dp_report.skipped, "{what}, window {window}");
                let overflowed = half == Precision::Fp16 && window == 4;
                assert_eq!(zero_report.applied(), !overflowed, "{what}, window {window}: {zero_report}");
            }
            assert_same_weights(&what, &zero_net, &dp_net, half);
            assert_eq!(zero_scaler.state(), dp_scaler.state(), "{what}: the scalers differ");
        }
        Ok(())
    })
}

/// An overflow in rank 1's gradients and a NaN loss on rank 2 skip the step on every rank (each rank
/// checks its own gradients before the reduce-scatter and its shard after it; one MAX word decides),
/// naming the rank; the masters stay, the scale moves alike, and the ranks end bit-identical. An
/// optimizer over the whole model, not the rank's shard, is refused before anything runs.
#[test]
fn an_overflow_on_one_rank_skips_every_rank_under_zero1() -> Outcome {
    on_ranks("an_overflow_on_one_rank_skips_every_rank_under_zero1", 3, |comm| {
        let rank = comm.rank();
        let net = mlp(Precision::Fp16, 11)?;
        let mut zero = Zero1::new(comm, ParamGroups::from_model(&net)?, DataParallelConfig::default())?;
        let mut scaler = scaler(&net)?;
        let mut whole = Optimizer::new(Kind::AdamW, ParamGroups::from_model(&net)?)?;
        match zero.step_fused(&mut scaler, &loss(&net, 0, 0..4)?, whole.fused(), None) {
            Err(amp::Error::ZeroShard { .. }) => {}
            other => panic!("rank {rank}: an optimizer over the whole model was not refused: {other:?}"),
        }
        let mut optimizer = Optimizer::new(Kind::AdamW, zero.local_groups())?;
        for step in 0..8 {
            let mut loss = loss(&net, step, my_rows(rank, 4))?;
            if step == 3 && rank == 1 {
                loss = (loss * 1e30)?; // finite in f32; its fp16 gradients are not
            }
            if step == 5 && rank == 2 {
                loss = (loss * f64::NAN)?;
            }
            let before = reliability::snapshot(&net, &[])?;
            let report = zero.step_fused(&mut scaler, &loss, optimizer.fused(), Some(1.0))?;
            match (step, &report.skipped) {
                (3, Some(SkipReason::GroupGradientOverflow { rank: Some(1), param })) => {
                    assert_eq!(param.is_some(), rank == 1, "rank {rank}: only rank 1 knows the parameter")
                }
                (5, Some(SkipReason::NonFiniteLossOnRank { rank: 2 })) => {}
                (3 | 5, other) => panic!("rank {rank}, step {step}: {other:?}"),
                (_, skipped) => assert_eq!(skipped, &None, "rank {rank}, step {step}"),
            }
            if !report.applied() {
                assert_eq!(
                    reliability::snapshot(&net, &[])?,
                    before,
                    "rank {rank}: a skipped step changed weights"
                );
            }
        }
        assert_eq!((scaler.state().applied, scaler.state().skipped), (6, 2));
        let mine = reliability::checksum(&reliability::snapshot(&net, &[&scaler])?);
        let mut root = mine.to_le_bytes();
        comm.broadcast_bytes(&mut root, 0)?;
        assert_eq!(mine, u64::from_le_bytes(root), "rank {rank}: model or scaler differ from rank 0's");
        Ok(())
    })
}

/// An overflow that no rank's own gradients hold and only one rank's shard shows: both ranks' fp16
/// gradients of the last bias are 40000 (finite), their sum on an fp16 wire is not. Only the rank
/// that owns that bias receives the infinity; the agreement word makes every rank skip, naming no rank
/// (the sum overflowed, not a rank's gradient). Without the agreement the other ranks would apply
/// their shards and the replicas would part.
#[test]
fn an_overflow_only_the_owning_rank_sees_skips_every_rank() -> Outcome {
    on_ranks("an_overflow_only_the_owning_rank_sees_skips_every_rank", 3, |comm| {
        let rank = comm.rank();
        let net = mlp(Precision::Fp16, 13)?;
        let groups = ParamGroups::from_model(&net)?;
        let last_bias =
            groups.params().iter().position(|p| p.path == "3.bias").ok_or("no parameter 3.bias")?;
        let config = DataParallelConfig { wire: amp::distributed::Wire::F16, ..Default::default() };
        let mut zero = Zero1::new(comm, groups, config)?;
        let owner = zero.owners()[last_bias];
        let mut optimizer = Optimizer::new(Kind::AdamW, zero.local_groups())?;
        let mut scaler = amp::GradScaler::new(amp::scaler::ScalerConfig::fixed(1.0))?;
        for step in 0..4 {
            let mut loss = loss(&net, step, my_rows(rank, 4))?;
            if step == 2 {
                let bias = net[3].bias().ok_or("the last layer has a bias")?.trainable().as_tensor();
                loss = (loss + (bias.to_dtype(candle_core::DType::F32)?.sum_all()? * 40000.0)?)?;
            }
            let before = reliability::snapshot(&net, &[])?;
            let report = zero.step_fused(&mut scaler, &loss, optimizer.fused(), None)?;
            if step == 2 {
                let param = (rank == owner).then(|| "3.bias".to_string());
                let expected = SkipReason::GroupGradientOverflow { rank: None, param };
                assert_eq!(report.skipped, Some(expected), "rank {rank} (owner {owner})");
                assert_eq!(
                    reliability::snapshot(&net, &[])?,
                    before,
                    "rank {rank}: the skipped step changed weights"
                );
            } else {
                assert!(report.applied(), "rank {rank}, step {step}: {report}");
            }
        }
        let mine = reliability::checksum(&reliability::snapshot(&net, &[&scaler])?);
        let mut root = mine.to_le_bytes();
        comm.broadcast_bytes(&mut root, 0)?;
        assert_eq!(mine, u64::from_le_bytes(root), "rank {rank}: model or scaler differ from rank 0's");
        Ok(())
    })
}

const DIR: &str = "AMP_ZERO_CHECKPOINT_DIR";
const PHASE: &str = "AMP_ZERO_CHECKPOINT_PHASE";

/// Two ranks train ZeRO-1 (masters sharded) and plain data parallelism side by side and save: ZeRO-1's
/// gathered file (`zero2`) and data parallelism's (`dp`, rank 0's unsharded optimizer). Three ranks
/// with sharded masters load `zero2` into ZeRO-1 (each rank its third of the state and of the masters)
/// and save it again (`zero3`). One process loads each file
/// into a plain optimizer: all three hold the same bits, and training resumes from them.
#[test]
fn a_zero1_checkpoint_saved_on_two_ranks_loads_on_one_rank_and_on_three() -> Outcome {
    let test = "a_zero1_checkpoint_saved_on_two_ranks_loads_on_one_rank_and_on_three";
    if mpi_launch::is_rank() {
        let dir = std::path::PathBuf::from(std::env::var(DIR)?);
        return on_ranks(test, 0, |comm| match std::env::var(PHASE)?.as_str() {
            "save" => save_on_two_ranks(comm, &dir),
            _ => load_on_three_ranks(comm, &dir),
        });
    }
    let dir = reliability::fresh_dir("zero1-checkpoint")?;
    let dir_text = dir.to_string_lossy().to_string();
    on_ranks_with_env(test, 2, &[(DIR, &dir_text), (PHASE, "save")], |_| Ok(()))?;
    on_ranks_with_env(test, 3, &[(DIR, &dir_text), (PHASE, "load")], |_| Ok(()))?;
    let mut snapshots = Vec::new();
    for file in ["zero2", "dp", "zero3"] {
        let mut net = mlp(Precision::Fp16, 99)?;
        let mut optimizer = Optimizer::new(Kind::Lamb, ParamGroups::from_model(&net)?)?;
        let mut scaler = scaler(&net)?;
        let path = dir.join(format!("{file}.safetensors"));
        amp::checkpoint::load_with(&mut net, &mut [optimizer.state_mut(), &mut scaler], &path)?;
        snapshots.push((file, reliability::snapshot(&net, &[optimizer.state(), &scaler])?));
        // Training resumes on one process from the loaded state.
        let one = SingleProcess::new();
        let mut dp = DataParallel::new(&one, DataParallelConfig::default())?;
        let report = dp.step_fused(&mut scaler, &loss(&net, 6, 0..16)?, optimizer.fused(), None)?;
        assert!(report.applied(), "{file}: {report}");
    }
    assert_eq!(snapshots[0].1, snapshots[1].1, "ZeRO-1's file differs from data parallelism's");
    assert_eq!(snapshots[0].1, snapshots[2].1, "saved again on 3 ranks, the state changed");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

fn save_on_two_ranks(comm: &Mpi, dir: &std::path::Path) -> Outcome {
    let rank = comm.rank();
    let (mut dp_net, mut zero_net) = (mlp(Precision::Fp16, 21)?, mlp(Precision::Fp16, 21)?);
    // Sharded masters take gradients against the working copies; data parallelism does so too here.
    amp::set_gradient_route(&mut dp_net, GradientRoute::Working);
    let mut dp = DataParallel::new(comm, DataParallelConfig::default())?;
    let mut zero = Zero1::new(comm, ParamGroups::from_model(&zero_net)?, DataParallelConfig::default())?;
    // The file holds every fp32 master: the sharded ones are gathered from their owners.
    zero.shard_masters(&mut zero_net)?;
    let mut dp_opt = Optimizer::new(Kind::Lamb, ParamGroups::from_model(&dp_net)?)?;
    let mut zero_opt = Optimizer::new(Kind::Lamb, zero.local_groups())?;
    let (mut dp_scaler, mut zero_scaler) = (scaler(&dp_net)?, scaler(&zero_net)?);
    for step in 0..6 {
        dp.step_fused(&mut dp_scaler, &loss(&dp_net, step, my_rows(rank, 2))?, dp_opt.fused(), None)?;
        zero.step_fused(&mut zero_scaler, &loss(&zero_net, step, my_rows(rank, 2))?, zero_opt.fused(), None)?;
    }
    zero.save_checkpoint(&zero_net, zero_opt.state(), &[&zero_scaler], dir.join("zero2.safetensors"))?;
    if rank == 0 {
        let states: [&dyn TrainingState; 2] = [dp_opt.state(), &dp_scaler];
        amp::checkpoint::save_with(&dp_net, &states, dir.join("dp.safetensors"))?;
    }
    comm.barrier()?;
    Ok(())
}

fn load_on_three_ranks(comm: &Mpi, dir: &std::path::Path) -> Outcome {
    let mut net = mlp(Precision::Fp16, 50 + comm.rank() as u64)?;
    let mut zero = Zero1::new(comm, ParamGroups::from_model(&net)?, DataParallelConfig::default())?;
    // Sharded before loading: each rank loads its own masters, and rounds the others into their working
    // copies; saving gathers the masters back.
    zero.shard_masters(&mut net)?;
    let mut optimizer = Optimizer::new(Kind::Lamb, zero.local_groups())?;
    let mut scaler = scaler(&net)?;
    // A file whose last optimizer tensor is damaged (labelled i32) fails on the rank that owns that
    // tensor only; every rank refuses it then, and none changes (the others had loaded it).
    let damaged = dir.join("damaged.safetensors");
    if comm.rank() == 0 {
        std::fs::write(
            &damaged,
            with_last_state_tensor_as_i32(&std::fs::read(dir.join("zero2.safetensors"))?)?,
        )?;
    }
    comm.barrier()?;
    let before = reliability::snapshot(&net, &[optimizer.state(), &scaler])?;
    let refused = zero.load_checkpoint(&mut net, &mut [optimizer.state_mut(), &mut scaler], &damaged);
    assert!(refused.is_err(), "rank {}: a damaged file loaded", comm.rank());
    assert_eq!(reliability::snapshot(&net, &[optimizer.state(), &scaler])?, before, "rank {}", comm.rank());
    zero.load_checkpoint(&mut net, &mut [optimizer.state_mut(), &mut scaler], dir.join("zero2.safetensors"))?;
    let per_rank = gather(comm, optimizer.state_bytes())?;
    let unsharded = 2 * 4 * net.named_params().iter().map(|(_, p)| p.elem_count()).sum::<usize>();
    assert_eq!(per_rank.iter().sum::<usize>(), unsharded, "the three shards hold the state once");
    if comm.rank() == 0 {
        println!("{} LAMB state loaded on 3 ranks: {per_rank:?} B of {unsharded} B", mpi_launch::REPORT);
    }
    zero.save_checkpoint(&net, optimizer.state(), &[&scaler], dir.join("zero3.safetensors"))?;
    Ok(())
}

/// A safetensors file with its last (by name) `amp_state/` tensor relabelled from f32 to i32: the same
/// bytes, a dtype its owner refuses (and no float for the non-finite scan of every rank to trip on).
fn with_last_state_tensor_as_i32(bytes: &[u8]) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
    let n = u64::from_le_bytes(bytes[..8].try_into()?) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n])?;
    let table = header.as_object_mut().ok_or("a header object")?;
    let name =
        table.keys().filter(|name| name.starts_with("amp_state/")).max().ok_or("a state tensor")?.clone();
    assert_eq!(table[&name]["dtype"], "F32", "{name}");
    table[&name]["dtype"] = "I32".into();
    let text = header.to_string();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    Ok(out)
}
