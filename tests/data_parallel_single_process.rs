//! The data-parallel step on a world of one (`SingleProcess`, no MPI needed) is the fused step: the same
//! protocol through its stages, with an fp32 wire that carries every value exactly and an average over
//! one rank. Masters, working copies, optimizer and scaler state must stay bit-identical to
//! `GradScaler::step_fused` over steps that apply, a gradient overflow and a non-finite loss.

mod common;
mod reliability;

use amp::distributed::{Communicator, DataParallel, DataParallelConfig, SingleProcess};
use amp::optim::{AdamConfig, FusedAdamW, ParamGroups};
use amp::scaler::{ScalerConfig, SkipReason};
use amp::GradScaler;
use reliability::{fp16_net, Outcome};

#[test]
fn the_data_parallel_step_on_one_process_is_bit_identical_to_step_fused() -> Outcome {
    let comm = SingleProcess::new();
    let plain = fp16_net(6, 24, 3, 5)?;
    let replica = fp16_net(6, 24, 3, 5)?;
    let config = || ScalerConfig { init_scale: 1024.0, growth_interval: 3, ..Default::default() };
    let (mut plain_adam, mut plain_scaler) = (
        FusedAdamW::new(ParamGroups::from_model(&plain)?, AdamConfig::default())?,
        GradScaler::new(config())?,
    );
    let (mut adam, mut scaler) = (
        FusedAdamW::new(ParamGroups::from_model(&replica)?, AdamConfig::default())?,
        GradScaler::new(config())?,
    );
    // Buckets of 40 values: the 243 parameters' gradients travel in several.
    let mut dp = DataParallel::new(&comm, DataParallelConfig { bucket_bytes: 160, ..Default::default() })?;
    dp.broadcast_masters(&replica)?;
    for step in 0..12u64 {
        let (x, y) = reliability::batch(step, 8, 6, 3)?;
        let factor = match step {
            4 => 1e30,     // finite loss, fp16 gradient overflow
            7 => f64::NAN, // non-finite loss
            _ => 1.0,
        };
        let plain_loss = (reliability::mse(&plain, &x, &y)? * factor)?;
        let loss = (reliability::mse(&replica, &x, &y)? * factor)?;
        let clip = (step % 2 == 0).then_some(1.0);
        let a = plain_scaler.step_fused(&plain_loss, &mut plain_adam, clip)?;
        let b = dp.step_fused(&mut scaler, &loss, &mut adam, clip)?;
        assert_eq!(a.applied(), b.applied(), "step {step}: {a} / {b}");
        match step {
            4 => assert!(
                matches!(
                    &b.skipped,
                    Some(SkipReason::GroupGradientOverflow { rank: Some(0), param: Some(_) })
                ),
                "{b}"
            ),
            7 => assert_eq!(b.skipped, Some(SkipReason::NonFiniteLossOnRank { rank: 0 }), "{b}"),
            _ => assert!(b.applied(), "step {step}: {b}"),
        }
        let left = reliability::snapshot(&plain, &[&plain_adam, &plain_scaler])?;
        let right = reliability::snapshot(&replica, &[&adam, &scaler])?;
        assert!(left == right, "step {step}: the data-parallel state parted from step_fused's");
    }
    // Every step reduces (a rank with a non-finite loss still runs backward: its peers would wait for
    // it): 7 buckets of 40 values and one agreement word. broadcast_masters: the model's fingerprint,
    // its agreement word, and the 4 masters.
    let traffic = comm.traffic();
    assert_eq!(traffic.all_reduce, 12 * (243 * 4 + 4) + 4, "{traffic:?}");
    assert_eq!(traffic.calls, 12 * (7 + 1) + 6, "{traffic:?}");
    Ok(())
}

#[test]
fn nccl_outside_its_build_or_off_a_gpu_says_what_to_do() {
    let refused = amp::distributed::Nccl::single(&candle_core::Device::Cpu);
    match refused {
        Err(amp::Error::NcclNotBuilt) if cfg!(not(feature = "nccl")) => {}
        Err(amp::Error::Nccl { ref reason }) if cfg!(feature = "nccl") => {
            assert!(reason.contains("not a CUDA device"), "{reason}")
        }
        other => panic!("expected an error that says how to get NCCL, got {other:?}"),
    }
    let message = amp::Error::NcclNotBuilt.to_string();
    assert!(message.contains("`nccl` feature") && message.contains("nvidia-nccl-cu13"), "{message}");
}

#[test]
fn shard_masters_keeps_everything_on_one_rank_and_refuses_another_model() -> Outcome {
    let comm = SingleProcess::new();
    let (mut net, mut stranger) = (fp16_net(6, 24, 3, 5)?, fp16_net(6, 24, 3, 5)?);
    let mut zero = amp::distributed::Zero1::new(&comm, ParamGroups::from_model(&net)?, Default::default())?;
    let total = zero.master_bytes();
    // Another model with the same names and shapes is still not the one these groups train.
    let refused = zero.shard_masters(&mut stranger);
    assert!(
        matches!(&refused, Err(amp::Error::ZeroShard { reason }) if reason.contains("not a parameter")),
        "{refused:?}"
    );
    // One rank owns every tensor: nothing is released.
    assert_eq!(zero.shard_masters(&mut net)?, 0);
    assert_eq!(zero.master_bytes(), total);
    assert!(ParamGroups::from_model(&net).is_ok(), "every master is still there");
    Ok(())
}
