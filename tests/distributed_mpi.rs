//! Data-parallel training over real MPI processes. Each test, run by cargo, launches
//! `mpirun -np N` on itself (`mpi_launch`), bounded by a timeout, and checks that every rank finished;
//! under mpirun each process does one rank's work and asserts on it. Needs the `mpi` feature and
//! Open MPI's `mpirun` (.ci/run installs it).

mod common;
mod mpi_launch;
mod mpi_training;
mod reliability;

use std::time::Duration;

use amp::distributed::{
    agree_non_finite, all_reduce_gradients, Communicator, DataParallel, DataParallelConfig, Mpi, Wire,
};
use amp::optim::{AdamConfig, FusedAdamW, ParamGroups};
use amp::scaler::{GradAccumulator, ScalerConfig, SkipReason};
use amp::{AmpModuleExt, GradScaler, Precision};
use candle_core::{DType, Device, Module, Tensor};
use half::{bf16, f16};
use mpi_launch::{on_ranks, Outcome};
use mpi_training::{lockstep, masters, mlp, Kind, Optimizer};
use reliability::fp16_net;

/// Unit roundoff of f32, bf16, fp16.
const U32: f64 = 1.0 / (1u64 << 24) as f64;
const U_BF16: f64 = 1.0 / 256.0;
const U_F16: f64 = 1.0 / 2048.0;

/// A gradient dtype's rounding: `round(x)`, its unit roundoff, and its absolute error below the normal
/// range. Half for the working copies' gradients; f32 for the weights amp's CPU GEMM differentiates
/// through their masters (`GradientRoute::Master`), which no half rounding touches.
fn rounding(dtype: DType) -> (fn(f32) -> f32, f64, f64) {
    match dtype {
        DType::F16 => (|x| f16::from_f32(x).to_f32(), U_F16, 2f64.powi(-25)),
        DType::BF16 => (|x| bf16::from_f32(x).to_f32(), U_BF16, 2f64.powi(-134)),
        _ => (|x| x, U32, 2f64.powi(-150)),
    }
}

/// Value `i` of rank `rank`: uniform mantissa in [-1, 1) times 2^k, k in -8..8, so sums mix magnitudes
/// and cancel. The same on every process (splitmix64).
fn value(rank: usize, i: usize) -> f32 {
    let mut z = ((rank as u64) << 32) ^ (i as u64) ^ 0x9e37_79b9_7f4a_7c15;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    let mantissa = (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
    mantissa * 2f32.powi((z % 16) as i32 - 8)
}

fn values(rank: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| value(rank, i)).collect()
}

/// `(1 + u)^k - 1`: the relative bound of k roundings with unit roundoff u.
fn gamma(k: usize, u: f64) -> f64 {
    (1.0 + u).powi(k as i32) - 1.0
}

#[test]
fn f32_collectives_on_an_odd_world_match_the_f64_reference() -> Outcome {
    on_ranks("f32_collectives_on_an_odd_world_match_the_f64_reference", 3, |comm| {
        let (rank, world, n) = (comm.rank(), comm.world_size(), 4099);
        assert_eq!(world, 3);
        let mut sum = values(rank, n);
        comm.all_reduce_sum(&mut sum, Wire::F32)?;
        // Any order of the world's f32 additions: world - 1 roundings, so
        // |computed - exact| <= gamma(world - 1, u32) * sum |x| (the f64 reference is exact here: three
        // f32 values within 2^16 of each other's scale fit in 53 bits).
        for (i, &got) in sum.iter().enumerate() {
            let terms: Vec<f64> = (0..world).map(|r| f64::from(value(r, i))).collect();
            let exact: f64 = terms.iter().sum();
            let bound = gamma(world - 1, U32) * terms.iter().map(|t| t.abs()).sum::<f64>();
            assert!((f64::from(got) - exact).abs() <= bound, "rank {rank}, value {i}: {got} vs {exact}");
        }
        // Every rank holds the same bits: gather everyone's result.
        let mut all = vec![0.0; world * n];
        comm.all_gather(&sum, &mut all)?;
        for block in all.chunks(n) {
            assert!(
                block.iter().zip(&sum).all(|(a, b)| a.to_bits() == b.to_bits()),
                "rank {rank}: sums differ"
            );
        }
        // Reduce-scatter: this rank's block of the world's sum of `world * n` values, within the same bound.
        let whole: Vec<f32> = (0..world * n).map(|i| value(rank, i)).collect();
        let mut block = vec![0.0; n];
        comm.reduce_scatter_sum(&whole, &mut block, Wire::F32)?;
        for (k, &got) in block.iter().enumerate() {
            let i = rank * n + k;
            let terms: Vec<f64> = (0..world).map(|r| f64::from(value(r, i))).collect();
            let bound = gamma(world - 1, U32) * terms.iter().map(|t| t.abs()).sum::<f64>();
            assert!((f64::from(got) - terms.iter().sum::<f64>()).abs() <= bound, "reduce-scatter, value {i}");
        }
        // All-gather and broadcast move values exactly.
        let mut gathered = vec![0.0; world * n];
        comm.all_gather(&values(rank, n), &mut gathered)?;
        for (r, block) in gathered.chunks(n).enumerate() {
            assert!(block.iter().zip(values(r, n)).all(|(a, b)| a.to_bits() == b.to_bits()), "block {r}");
        }
        let mut from_two = values(rank, n);
        comm.broadcast(&mut from_two, 2)?;
        assert!(from_two.iter().zip(values(2, n)).all(|(a, b)| a.to_bits() == b.to_bits()));
        let max = comm.all_reduce_max_f32(if rank == 1 { 7.5 } else { -1.0 })?;
        assert_eq!(max, 7.5);
        Ok(())
    })
}

#[test]
fn sixteen_bit_wires_stay_within_their_derived_bound_and_move_half_the_bytes() -> Outcome {
    let test = "sixteen_bit_wires_stay_within_their_derived_bound_and_move_half_the_bytes";
    on_ranks(test, 2, |comm| {
        let (rank, world, n) = (comm.rank(), comm.world_size(), 1000);
        let before = comm.traffic().all_reduce;
        let mut fp32 = values(rank, n);
        comm.all_reduce_sum(&mut fp32, Wire::F32)?;
        let fp32_bytes = comm.traffic().all_reduce - before;
        let mut wire16 = values(rank, n);
        comm.all_reduce_sum(&mut wire16, Wire::Bf16)?;
        let bf16_bytes = comm.traffic().all_reduce - before - fp32_bytes;
        assert_eq!((fp32_bytes, bf16_bytes), (4 * n as u64, 2 * n as u64), "payload bytes, fp32 then bf16");
        // bf16 wire: each of the `world` inputs rounded to bf16 once, each of the world - 1 combines adds in
        // f32 (one f32 rounding at most) and rounds to bf16 once, so
        //   |bf16 result - exact| <= ((1 + u_bf16)^world (1 + u32)^(world - 1) - 1) * sum |x|;
        // the fp32 wire is within gamma(world - 1, u32) * sum |x| of the exact sum: the two are within the
        // sum of both bounds of each other.
        let mut differ = 0;
        for i in 0..n {
            let abs_sum: f64 = (0..world).map(|r| f64::from(value(r, i)).abs()).sum();
            let bf16_bound = (1.0 + U_BF16).powi(world as i32) * (1.0 + U32).powi(world as i32 - 1) - 1.0;
            let bound = (bf16_bound + gamma(world - 1, U32)) * abs_sum;
            let (a, b) = (f64::from(wire16[i]), f64::from(fp32[i]));
            assert!((a - b).abs() <= bound, "value {i}: bf16 wire {a}, fp32 wire {b}, bound {bound}");
            assert_eq!(bf16::from_f32(wire16[i]).to_f32(), wire16[i], "value {i} did not travel as bf16");
            differ += usize::from(a != b);
        }
        assert!(differ > n / 2, "only {differ} of {n} values changed: the bf16 wire did not round");

        // fp16 wire: two gradients of 60000 sum past fp16's 65504 on the wire unless pre-divided.
        let grad = || Tensor::from_vec(vec![f16::from_f32(60000.0); 4], 4, &Device::Cpu);
        let (plain, predivided) = (grad()?, grad()?);
        let fp16 = DataParallelConfig { wire: Wire::F16, ..Default::default() };
        all_reduce_gradients(comm, &[&plain], &fp16)?;
        all_reduce_gradients(comm, &[&predivided], &DataParallelConfig { predivide_factor: 2.0, ..fp16 })?;
        let read = |t: &Tensor| t.to_dtype(DType::F32)?.to_vec1::<f32>();
        assert!(read(&plain)?.iter().all(|v| v.is_infinite()), "the fp16 sum overflowed on the wire");
        assert_eq!(read(&predivided)?, vec![60000.0; 4], "pre-divided by 2: 30000 + 30000, then times 2/2");
        Ok(())
    })
}

#[test]
fn a_non_finite_value_on_rank_1_only_is_named_on_every_rank() -> Outcome {
    on_ranks("a_non_finite_value_on_rank_1_only_is_named_on_every_rank", 3, |comm| {
        let rank = comm.rank();
        assert_eq!(agree_non_finite(comm, rank == 1)?, Some(1), "rank {rank}");
        assert_eq!(agree_non_finite(comm, false)?, None, "rank {rank}");
        assert_eq!(agree_non_finite(comm, rank >= 1)?, Some(1), "the lowest of ranks 1 and 2");
        let max = comm.all_reduce_max_f32(if rank == 1 { f32::NAN } else { f32::INFINITY })?;
        assert!(max.is_nan(), "rank {rank}: a NaN on one rank wins the max on every rank");
        Ok(())
    })
}

/// Snapshot of a rank's model, optimizer and scaler, and its checksum as rank 0 holds it.
fn checksums(comm: &Mpi, state: &[(String, Vec<u32>)]) -> amp::Result<(u64, u64)> {
    let mine = reliability::checksum(state);
    let mut bytes = mine.to_le_bytes();
    comm.broadcast_bytes(&mut bytes, 0)?;
    Ok((mine, u64::from_le_bytes(bytes)))
}

#[test]
fn broadcast_masters_makes_every_rank_bit_identical() -> Outcome {
    on_ranks("broadcast_masters_makes_every_rank_bit_identical", 2, |comm| {
        let rank = comm.rank();
        let net = fp16_net(6, 24, 3, 10 + rank as u64)?;
        let (mine, root) = checksums(comm, &reliability::snapshot(&net, &[])?)?;
        assert_eq!(mine == root, rank == 0, "the ranks start from different weights");
        let dp = DataParallel::new(comm, DataParallelConfig::default())?;
        dp.broadcast_masters(&net)?;
        // Masters and working copies equal, bit for bit, to rank 0's seed-10 model built here.
        let expected = reliability::snapshot(&fp16_net(6, 24, 3, 10)?, &[])?;
        assert_eq!(reliability::snapshot(&net, &[])?, expected, "rank {rank}");
        // A rank with another model: every rank gets the error, naming rank 1.
        let other = fp16_net(6, if rank == 1 { 25 } else { 24 }, 3, 10)?;
        match dp.broadcast_masters(&other) {
            Err(amp::Error::ReplicasDiffer { rank: 1, .. }) => {}
            other => panic!("rank {rank}: expected ReplicasDiffer naming rank 1, got {other:?}"),
        }
        Ok(())
    })
}

/// The gradients of `net`'s trainable parameters for the mean squared error on rows `rows` of the
/// 16-row batch, in model order.
fn gradients(net: &reliability::Net, rows: std::ops::Range<usize>) -> amp::Result<Vec<Tensor>> {
    let (x, y) = reliability::batch(7, 16, 6, 3)?;
    let (x, y) = (x.narrow(0, rows.start, rows.len())?, y.narrow(0, rows.start, rows.len())?);
    let grads = reliability::mse(net, &x, &y)?.backward()?;
    net.named_params()
        .iter()
        .map(|(path, p)| {
            p.grad(path, &grads)?
                .cloned()
                .ok_or_else(|| amp::Error::Internal { what: format!("no gradient for {path}") })
        })
        .collect()
}

fn f32s(t: &Tensor) -> amp::Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

#[test]
fn two_ranks_with_batch_b_average_to_one_rank_with_batch_2b() -> Outcome {
    on_ranks("two_ranks_with_batch_b_average_to_one_rank_with_batch_2b", 2, |comm| {
        let rank = comm.rank();
        // fp16 O2: the working copies' gradients are fp16, the weights' f32 (`GradientRoute::Master`),
        // as they travel in training.
        let net = fp16_net(6, 24, 3, 3)?;
        let halves = [gradients(&net, 0..8)?, gradients(&net, 8..16)?];
        let full = gradients(&net, 0..16)?;
        let mine = gradients(&net, rank * 8..rank * 8 + 8)?;
        // A small bucket, so that tensors span buckets and buckets span tensors.
        let config = DataParallelConfig { bucket_bytes: 4 * 50, ..Default::default() };
        all_reduce_gradients(comm, &mine.iter().collect::<Vec<_>>(), &config)?;
        for (k, averaged) in mine.iter().enumerate() {
            let (avg, g0, g1, g) =
                (f32s(averaged)?, f32s(&halves[0][k])?, f32s(&halves[1][k])?, f32s(&full[k])?);
            let largest = g.iter().fold(0f32, |m, v| m.max(v.abs()));
            let (round, u, s) = rounding(averaged.dtype());
            for i in 0..avg.len() {
                // Exactly what averaging the two ranks' gradients in f32 and rounding once to their
                // dtype gives.
                let want = round((g0[i] + g1[i]) * 0.5);
                assert_eq!(avg[i].to_bits(), want.to_bits(), "rank {rank}, tensor {k}, value {i}");
                // Against one rank with the whole batch: the exact gradients satisfy e = (e0 + e1) / 2;
                // each gradient is its exact value rounded once to its dtype (u relative, s absolute in
                // the subnormals), the average is rounded once more, and the f32 sums of the forward and
                // backward passes differ in order (64 u32 of the tensor's largest gradient covers 16-row
                // and 24-wide sums with room).
                let (a, b) = (f64::from(avg[i]), f64::from(g[i]));
                let bound =
                    1.01 * u * (a.abs() + b.abs() + (f64::from(g0[i]).abs() + f64::from(g1[i]).abs()) / 2.0)
                        + 3.0 * s
                        + 64.0 * U32 * f64::from(largest);
                assert!((a - b).abs() <= bound, "tensor {k}, value {i}: 2 x 8 rows {a}, 16 rows {b}");
            }
        }
        Ok(())
    })
}

#[test]
fn data_parallel_steps_agree_on_every_skip_and_keep_replicas_identical() -> Outcome {
    let test = "data_parallel_steps_agree_on_every_skip_and_keep_replicas_identical";
    on_ranks(test, 3, |comm| {
        let rank = comm.rank();
        let net = fp16_net(6, 24, 3, 20 + rank as u64)?;
        let mut dp = DataParallel::new(comm, DataParallelConfig { wire: Wire::Bf16, ..Default::default() })?;
        dp.broadcast_masters(&net)?;
        let mut adam = FusedAdamW::new(ParamGroups::from_model(&net)?, AdamConfig::default())?;
        let mut scaler = GradScaler::new(ScalerConfig { init_scale: 1024.0, ..Default::default() })?;
        for step in 0..8u64 {
            // Each rank its own rows. Step 3: rank 1's loss times 1e30, finite in f32, its fp16 gradient
            // not. Step 5: rank 2's loss NaN.
            let (x, y) = reliability::batch(step * 3 + rank as u64, 8, 6, 3)?;
            let mut loss = reliability::mse(&net, &x, &y)?;
            if step == 3 && rank == 1 {
                loss = (loss * 1e30)?;
            }
            if step == 5 && rank == 2 {
                loss = (loss * f64::NAN)?;
            }
            let before = reliability::snapshot(&net, &[])?;
            let report = dp.step_fused(&mut scaler, &loss, &mut adam, Some(1.0))?;
            let expected = match step {
                3 => Some(SkipReason::GroupGradientOverflow {
                    rank: Some(1),
                    param: (rank == 1).then(|| "hidden.weight".to_string()),
                }),
                5 => Some(SkipReason::NonFiniteLossOnRank { rank: 2 }),
                _ => None,
            };
            assert_eq!(report.skipped, expected, "rank {rank}, step {step}: {report}");
            if expected.is_some() {
                assert_eq!(
                    reliability::snapshot(&net, &[])?,
                    before,
                    "rank {rank}: a skipped step changed weights"
                );
            }
        }
        assert_eq!((scaler.state().applied, scaler.state().skipped), (6, 2));
        let state = reliability::snapshot(&net, &[&adam, &scaler])?;
        let (mine, root) = checksums(comm, &state)?;
        assert_eq!(
            mine, root,
            "rank {rank}: masters, working copies, optimizer and scaler differ from rank 0's"
        );
        Ok(())
    })
}

/// Gradient accumulation over two ranks, two micro-batches each: the windows agree on every skip (an
/// fp16 overflow in rank 1's second micro-batch, a NaN loss in rank 0's first), the replicas stay bit
/// identical, and each window's gradients travel once: as many all-reduce bytes as one plain step.
#[test]
fn accumulated_windows_agree_on_every_skip_and_reduce_once_per_window() -> Outcome {
    let test = "accumulated_windows_agree_on_every_skip_and_reduce_once_per_window";
    on_ranks(test, 2, |comm| {
        let rank = comm.rank();
        let net = fp16_net(6, 24, 3, 40 + rank as u64)?;
        let mut dp = DataParallel::new(comm, DataParallelConfig::default())?;
        dp.broadcast_masters(&net)?;
        let mut adam = FusedAdamW::new(ParamGroups::from_model(&net)?, AdamConfig::default())?;
        let mut scaler = GradScaler::new(ScalerConfig { init_scale: 1024.0, ..Default::default() })?;
        let mut accumulator = GradAccumulator::new();
        for window in 0..5u64 {
            for micro in 0..2u64 {
                let (x, y) = reliability::batch(window * 4 + rank as u64 * 2 + micro, 8, 6, 3)?;
                let mut loss = (reliability::mse(&net, &x, &y)? / 2.0)?;
                if window == 1 && rank == 1 && micro == 1 {
                    loss = (loss * 1e30)?;
                }
                if window == 3 && rank == 0 && micro == 0 {
                    loss = (loss * f64::NAN)?;
                }
                scaler.accumulate(&net, &loss, &mut accumulator)?;
            }
            let before = (reliability::snapshot(&net, &[])?, comm.traffic().all_reduce);
            let report = dp.step_fused_accumulated(&mut scaler, &mut accumulator, &mut adam, Some(1.0))?;
            let expected = match window {
                1 => Some(SkipReason::GroupGradientOverflow {
                    rank: Some(1),
                    param: (rank == 1).then(|| "hidden.weight".to_string()),
                }),
                3 => Some(SkipReason::NonFiniteLossOnRank { rank: 0 }),
                _ => None,
            };
            assert_eq!(report.skipped, expected, "rank {rank}, window {window}: {report}");
            if expected.is_some() {
                assert!(reliability::snapshot(&net, &[])? == before.0, "rank {rank}: a skip changed weights");
            }
            // One window: the 243 gradients once (in f32 on the default wire), and a few agreement words.
            let bytes = comm.traffic().all_reduce - before.1;
            assert!((4 * 243..4 * 243 + 64).contains(&bytes), "rank {rank}, window {window}: {bytes} bytes");
        }
        assert_eq!((scaler.state().applied, scaler.state().skipped), (3, 2));
        let state = reliability::snapshot(&net, &[&adam, &scaler])?;
        let (mine, root) = checksums(comm, &state)?;
        assert_eq!(mine, root, "rank {rank}: the replicas parted");
        Ok(())
    })
}

/// A step in which one rank's loss does not reach some parameters (a data-dependent branch) is refused
/// on every rank before any gradient is summed, with the weights and states unchanged, where the
/// buckets had summed one parameter's values into another's; the next full step trains on, in step.
#[test]
fn a_step_where_the_ranks_hold_different_gradients_is_refused_on_every_rank() -> Outcome {
    let test = "a_step_where_the_ranks_hold_different_gradients_is_refused_on_every_rank";
    on_ranks(test, 2, |comm| {
        let rank = comm.rank();
        let net = fp16_net(6, 24, 3, 40)?;
        let mut dp = DataParallel::new(comm, DataParallelConfig::default())?;
        dp.broadcast_masters(&net)?;
        let mut adam = FusedAdamW::new(ParamGroups::from_model(&net)?, AdamConfig::default())?;
        let mut scaler = GradScaler::new(ScalerConfig { init_scale: 1024.0, ..Default::default() })?;
        for step in 0..3u64 {
            let (x, y) = reliability::batch(step * 2 + rank as u64, 8, 6, 3)?;
            let before = reliability::snapshot(&net, &[&adam, &scaler])?;
            if step == 1 {
                // Rank 1's loss stops at the hidden layer: `out` gets no gradient there.
                let loss = match rank {
                    1 => net.hidden.forward(&x)?.sqr()?.mean_all()?,
                    _ => reliability::mse(&net, &x, &y)?,
                };
                let err = dp.step_fused(&mut scaler, &loss, &mut adam, Some(1.0)).expect_err("refused");
                let message = err.to_string();
                assert!(message.contains("different parameters") && message.contains("Zero1"), "{message}");
                assert_eq!(reliability::snapshot(&net, &[&adam, &scaler])?, before, "rank {rank}: changed");
                continue;
            }
            let report =
                dp.step_fused(&mut scaler, &reliability::mse(&net, &x, &y)?, &mut adam, Some(1.0))?;
            assert!(report.applied(), "rank {rank}, step {step}: {report}");
        }
        let (mine, root) = checksums(comm, &reliability::snapshot(&net, &[&adam, &scaler])?)?;
        assert_eq!(mine, root, "rank {rank}: the replicas differ");
        Ok(())
    })
}

#[test]
fn a_rank_that_exits_mid_collective_ends_the_job_within_a_bounded_time() -> Outcome {
    let test = "a_rank_that_exits_mid_collective_ends_the_job_within_a_bounded_time";
    if !mpi_launch::is_rank() {
        let job = mpi_launch::launch(test, 2)?;
        let status = job.status.unwrap_or_else(|| panic!("mpirun hung; killed:\n{}", job.output));
        assert!(!status.success(), "the job succeeded though a rank exited:\n{}", job.output);
        assert!(job.elapsed < Duration::from_secs(30), "the job took {:.1?} to end", job.elapsed);
        assert!(job.output.contains("rank 0 waits in an all-reduce"), "{}", job.output);
        assert!(!job.output.contains("all-reduce returned"), "{}", job.output);
        println!("`{test}`: mpirun ended the job in {:.2?} with {status}", job.elapsed);
        return Ok(());
    }
    let comm = Mpi::init()?;
    comm.barrier()?;
    if comm.rank() == 1 {
        std::process::exit(3);
    }
    println!("rank 0 waits in an all-reduce");
    let mut values = vec![1.0; 1024];
    comm.all_reduce_sum(&mut values, Wire::F32)?;
    println!("all-reduce returned without rank 1");
    Ok(())
}

/// The gradients of `loss` for the model's trainable parameters, as tensors, in model order.
fn grad_tensors(model: &Vec<amp::nn::Linear>, loss: &Tensor) -> amp::Result<Vec<Tensor>> {
    let grads = loss.backward()?;
    model
        .named_params()
        .iter()
        .map(|(path, p)| {
            p.grad(path, &grads)?
                .cloned()
                .ok_or_else(|| amp::Error::Internal { what: format!("no gradient for {path}") })
        })
        .collect()
}

/// Adam's `sqrt(S_t)`: for any gradients, `|m_hat_t| <= sqrt(S_t) * sqrt(v_hat_t)` after `t` steps from
/// zero moments (Cauchy-Schwarz on `m_hat = sum a_k g_k`, `v_hat = sum b_k g_k^2` with
/// `a_k = (1 - b1) b1^(t-k) / (1 - b1^t)`, `b_k = (1 - b2) b2^(t-k) / (1 - b2^t)`:
/// `S_t = sum a_k^2 / b_k`), so one update `m_hat / (sqrt(v_hat) + eps)` is at most `sqrt(S_t)` in size.
fn adam_update_bound(t: u64) -> f64 {
    let (b1, b2) = (0.9f64, 0.999f64);
    let sum: f64 = (0..t).map(|j| (b1 * b1 / b2).powi(j as i32)).sum();
    ((1.0 - b1).powi(2) * (1.0 - b2.powi(t as i32)) / ((1.0 - b1.powi(t as i32)).powi(2) * (1.0 - b2)) * sum)
        .sqrt()
}

/// Training parity over 50 steps: 2 ranks with 8 rows each (data parallel) against one model trained on
/// all 16 rows (the reference, trained on every rank in the same process), for AdamW and LAMB, fp16 O2
/// with the dynamic loss scaler and bf16 O2.
///
/// **Per step** (the tight check), at the data-parallel weights and the current loss scale: the averaged
/// gradient is exactly `round_h((g0 + g1) / 2)` of the two ranks' gradients, and within
/// `1.01 u_h (|avg| + |g| + (|g0| + |g1|) / 2) + 3 s_h + 64 u32 max|g|` of the whole batch's gradient `g`,
/// `h` the gradient's dtype (half for the working copies, f32 for the weights, which amp's CPU GEMM
/// differentiates through their masters).
/// Derivation: the exact gradients satisfy `e = (e0 + e1) / 2` (the 1/8 and 1/16 of the means are powers
/// of two); each computed gradient is its f32 value rounded once to its dtype (relative `u_h`:
/// 2^-11 fp16, 2^-8 bf16; absolute `s_h` below the normal range: 2^-25 fp16, 2^-134 bf16), the average
/// is rounded once more; the f32 sums inside backward differ only in order (16 rows against 2 x 8, and the
/// 32-wide layer sums), which `64 u32` of the tensor's largest gradient covers. Not averaging (the sum
/// instead of the mean) is off by `|g|`, far outside it.
///
/// **Lockstep, per step**: a shadow copies the data-parallel masters and optimizer state before the step
/// and takes the whole batch's step; the two masters after it are within the bound of
/// `tests/mpi_training/lockstep.rs`, derived from the measured difference of the two gradients by the
/// mean value theorem on Adam's normalised moment (large exactly where `v` is tiny), LAMB's trust ratio
/// bounded through the norms, plus the f32 roundings. This is where Adam's amplification is accounted
/// for, step by step; a step that used each rank's own gradient instead of the average fails it.
///
/// **Over 50 steps**: both runs skip the same steps (fp16: an overflow injected at step 20) and hold the
/// same loss scale at every step, and the final masters differ by at most the sum, over applied steps,
/// of what two updates can differ by whatever the gradients: AdamW `2 lr sqrt(S_t)` per step
/// ([`adam_update_bound`]; decoupled decay only shrinks a difference), LAMB `lr (||w_dp|| + ||w_ref||)`
/// of the tensor (its trust ratio makes `|update_i| <= lr ||w||`), plus one f32 rounding of each master
/// per step. That bound holds for diverging trajectories, whose gradients differ by more than rounding
/// once the weights differ (a bound through them would need the network's gradient Lipschitz
/// constant), so it is loose: the test prints the observed difference beside it. The per-step and
/// lockstep checks are the tight ones.
#[test]
fn two_ranks_with_batch_b_train_to_the_masters_of_one_rank_with_batch_2b_over_50_steps() -> Outcome {
    let test = "two_ranks_with_batch_b_train_to_the_masters_of_one_rank_with_batch_2b_over_50_steps";
    on_ranks(test, 2, |comm| {
        for half in [Precision::Fp16, Precision::Bf16] {
            for kind in [Kind::AdamW, Kind::Lamb] {
                train_both_ways(comm, half, kind)?;
            }
        }
        Ok(())
    })
}

/// One f32 vector per parameter tensor, in model order.
type PerTensor = Vec<Vec<f32>>;

/// The per-step gradient check (see the test): returns the averaged and the whole batch's gradients,
/// scaled, per tensor, and the largest fraction of its bound any value used.
fn check_gradients(
    comm: &Mpi,
    net: &Vec<amp::nn::Linear>,
    half: Precision,
    step: u64,
    scale: f64,
) -> amp::Result<(PerTensor, PerTensor, f64)> {
    let rank = comm.rank();
    let scaled = |rows: std::ops::Range<usize>| -> amp::Result<Tensor> {
        Ok((mpi_training::loss(net, step, rows)? * scale)?)
    };
    let halves = [grad_tensors(net, &scaled(0..8)?)?, grad_tensors(net, &scaled(8..16)?)?];
    let whole = grad_tensors(net, &scaled(0..16)?)?;
    let mine = grad_tensors(net, &scaled(rank * 8..rank * 8 + 8)?)?;
    all_reduce_gradients(comm, &mine.iter().collect::<Vec<_>>(), &DataParallelConfig::default())?;
    let (mut avgs, mut wholes, mut worst) = (Vec::new(), Vec::new(), 0f64);
    for (k, averaged) in mine.iter().enumerate() {
        let (avg, g0, g1, g) =
            (f32s(averaged)?, f32s(&halves[0][k])?, f32s(&halves[1][k])?, f32s(&whole[k])?);
        let largest = g.iter().fold(0f32, |m, v| m.max(v.abs()));
        let (round, u_h, s_h) = rounding(averaged.dtype());
        for i in 0..avg.len() {
            let want = round((g0[i] + g1[i]) * 0.5);
            assert_eq!(
                avg[i].to_bits(),
                want.to_bits(),
                "{half:?}, rank {rank}, step {step}, tensor {k}, value {i}"
            );
            let (a, b) = (f64::from(avg[i]), f64::from(g[i]));
            let bound =
                1.01 * u_h * (a.abs() + b.abs() + (f64::from(g0[i]).abs() + f64::from(g1[i]).abs()) / 2.0)
                    + 3.0 * s_h
                    + 64.0 * U32 * f64::from(largest);
            assert!(
                (a - b).abs() <= bound,
                "{half:?}, step {step}, tensor {k}, value {i}: 2 x 8 rows {a}, 16 rows {b}, bound {bound}"
            );
            worst = worst.max((a - b).abs() / bound);
        }
        avgs.push(avg);
        wholes.push(g);
    }
    Ok((avgs, wholes, worst))
}

/// Largest fractions of their bounds seen by each check of a parity run.
#[derive(Debug, Default)]
struct Worst {
    gradient: f64,
    lockstep: f64,
    trajectory: f64,
}

fn train_both_ways(comm: &Mpi, half: Precision, kind: Kind) -> Outcome {
    let (rank, what) = (comm.rank(), format!("{half:?} {kind:?}"));
    let (net, reference) = (mlp(half, 3)?, mlp(half, 3)?);
    let mut dp = DataParallel::new(comm, DataParallelConfig::default())?;
    dp.broadcast_masters(&net)?;
    let mut optimizer = Optimizer::new(kind, ParamGroups::from_model(&net)?)?;
    let mut ref_optimizer = Optimizer::new(kind, ParamGroups::from_model(&reference)?)?;
    let (mut scaler, mut ref_scaler) = (mpi_training::scaler(&net)?, mpi_training::scaler(&reference)?);
    let mut shadow = lockstep::Shadow::new(half, kind)?;
    let (mut bounds, mut applied, mut worst) = (vec![0f64; masters(&net)?.len()], 0u64, Worst::default());
    for step in 0..50 {
        let scale = scaler.scale();
        let (avgs, wholes, gradient) = check_gradients(comm, &net, half, step, f64::from(scale))?;
        worst.gradient = worst.gradient.max(gradient);
        // Lockstep: the whole batch's step from this very state, on a shadow.
        let (before, ref_before) = (masters(&net)?, masters(&reference)?);
        let [m0, v0] = lockstep::moments(&net, &optimizer)?;
        let shadow_scale = (half == Precision::Fp16).then_some(scale);
        let shadow_applied = shadow.step_from(&net, &optimizer, shadow_scale, step)?;
        // The steps: data parallel on this rank's rows, the reference on all of them. fp16, step 20:
        // rank 1's loss and the reference's times 1e30, their fp16 gradients overflow: both skip.
        let overflow = half == Precision::Fp16 && step == 20;
        let factor = |on: bool| if on { 1e30 } else { 1.0 };
        let my_loss = mpi_training::loss(&net, step, rank * 8..rank * 8 + 8)?;
        let report =
            dp.step_fused(&mut scaler, &(my_loss * factor(overflow && rank == 1))?, optimizer.fused(), None)?;
        let ref_loss = mpi_training::loss(&reference, step, 0..16)?;
        let ref_report =
            ref_scaler.step_fused(&(ref_loss * factor(overflow))?, ref_optimizer.fused(), None)?;
        assert_eq!(report.applied(), !overflow, "{what}, step {step}: {report}");
        assert_eq!(report.applied(), ref_report.applied(), "{what}, step {step}: {report} vs {ref_report}");
        assert_eq!(scaler.scale(), ref_scaler.scale(), "{what}, step {step}: loss scales differ");
        if !report.applied() {
            continue;
        }
        applied += 1;
        assert!(shadow_applied, "{what}, step {step}: the shadow skipped");
        let [m1, v1] = lockstep::moments(&net, &optimizer)?;
        let (got, shadowed) = (masters(&net)?, shadow.masters()?);
        let inv = 1.0 / f64::from(scale);
        for k in 0..got.len() {
            let unscale = |g: &[f32]| -> Vec<f64> { g.iter().map(|&x| f64::from(x) * inv).collect() };
            let (g, g2) = (unscale(&avgs[k]), unscale(&wholes[k]));
            let around = lockstep::StepAround {
                w: &before[k],
                m0: &m0[k],
                v0: &v0[k],
                m1: &m1[k],
                v1: &v1[k],
                g: &g,
                g2: &g2,
            };
            let lr = mpi_training::LR;
            let step_bounds = lockstep::master_bounds(kind, applied, lr, mpi_training::WEIGHT_DECAY, &around);
            for (i, bound) in step_bounds.iter().enumerate() {
                let diff = (f64::from(got[k][i]) - f64::from(shadowed[k][i])).abs();
                assert!(
                    diff <= *bound,
                    "{what}, step {step}, tensor {k}, value {i}: lockstep {diff:e}, bound {bound:e}"
                );
                worst.lockstep = worst.lockstep.max(diff / bound);
            }
        }
        for (k, bound) in bounds.iter_mut().enumerate() {
            let largest =
                before[k].iter().chain(&ref_before[k]).fold(0f64, |m, w| m.max(f64::from(*w).abs()));
            let norm = |w: &[f32]| w.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
            *bound += match kind {
                Kind::AdamW => 2.0 * mpi_training::LR * adam_update_bound(applied) * 1.001,
                Kind::Lamb => mpi_training::LR * (norm(&before[k]) + norm(&ref_before[k])) * 1.001,
            } + 2.0 * U32 * (largest + 1.0);
        }
    }
    let (got, want) = (masters(&net)?, masters(&reference)?);
    for (k, bound) in bounds.iter().enumerate() {
        for (i, (a, b)) in got[k].iter().zip(&want[k]).enumerate() {
            let diff = (f64::from(*a) - f64::from(*b)).abs();
            assert!(diff <= *bound, "{what}, tensor {k}, value {i}: 2 ranks {a}, 1 rank {b}, bound {bound}");
            worst.trajectory = worst.trajectory.max(diff / bound);
        }
    }
    let moved = mpi_training::max_abs_diff(&got, &masters(&mlp(half, 3)?)?);
    if rank == 0 {
        println!(
            "{} {what}: {applied} of 50 steps applied on both; at most {:.3} of the per-step gradient bound, {:.3} of \
             the lockstep bound; final masters differ by at most {:.2e} (moved {moved:.3} from the start), {:.2e} \
             of the 50-step bound",
            mpi_launch::REPORT,
            worst.gradient,
            worst.lockstep,
            mpi_training::max_abs_diff(&got, &want),
            worst.trajectory
        );
    }
    Ok(())
}
