//! The NCCL communicator on one GPU (a world of one; feature `nccl`). Every test passes with a note when
//! no device is usable, so the suite runs anywhere; scripts/gpu-check.sh runs it on a GPU.
//!
//! - Every collective of `Communicator` through NCCL gives what `SingleProcess` gives, with the same
//!   payload counts (a 16-bit wire rounds each value once through its type, as travelling does).
//! - The device collectives sum and broadcast CUDA tensors of every dtype in place, through every wire.
//! - The data-parallel step on a CUDA model over NCCL is bit-identical to the plain fused step (one
//!   rank, an fp32 wire, power-of-two factors: every value travels exactly), as on the CPU.
//! - Misuse is refused with a reason: a host-only communicator given CUDA gradients, a CPU tensor
//!   given to NCCL, a root that does not exist.
#![cfg(feature = "nccl")]

mod common;

use amp::distributed::{
    all_reduce_gradients, Communicator, DataParallel, DataParallelConfig, DeviceCollectives, Nccl,
    SingleProcess, Wire,
};
use amp::nn::Linear;
use amp::optim::{AdamConfig, FusedAdamW, ParamGroups};
use amp::scaler::ScalerConfig;
use amp::{AmpConfig, AmpModule, AmpModuleExt, GradScaler, OptLevel, Param, Precision};
use candle_core::{DType, Device, Module, Tensor, Var};
use rand::rngs::StdRng;
use rand::SeedableRng;

fn gpu() -> Option<Device> {
    if !amp::cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return None;
    }
    Device::new_cuda(0).ok()
}

#[derive(AmpModule)]
struct Two {
    fc1: Linear,
    fc2: Linear,
}

/// The same seeded model on `device`, O2 with `half` working copies.
fn model(device: &Device, half: Precision) -> amp::Result<Two> {
    let mut rng = StdRng::seed_from_u64(11);
    let mut param = |shape: &[usize]| -> amp::Result<Param> {
        Ok(Param::new(Var::from_tensor(&common::randn(&mut rng, shape, 0.5)?.to_device(device)?)?))
    };
    let fc1 = Linear::new(param(&[32, 48])?, Some(param(&[32])?));
    let fc2 = Linear::new(param(&[5, 32])?, None);
    let mut model = Two { fc1, fc2 };
    amp::initialize(&mut model, AmpConfig { opt_level: OptLevel::O2, half })?;
    Ok(model)
}

fn masters(model: &Two) -> amp::Result<Vec<Vec<u32>>> {
    model
        .named_params()
        .iter()
        .map(|(_, p)| {
            let values: Vec<f32> = p.master().as_tensor().flatten_all()?.to_vec1()?;
            Ok(values.iter().map(|v| v.to_bits()).collect())
        })
        .collect()
}

#[test]
fn every_collective_of_a_world_of_one_matches_single_process() -> amp::Result<()> {
    let Some(device) = gpu() else { return Ok(()) };
    let nccl = Nccl::single(&device)?;
    let (host, reference) = (SingleProcess::new(), SingleProcess::new());
    assert_eq!((nccl.rank(), nccl.world_size()), (0, 1));
    let values = vec![1.0f32, -2.5, 3.0e-3, 65504.0, 1.0e-8, f32::INFINITY];
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for wire in [Wire::F32, Wire::Bf16, Wire::F16] {
        let mut want = values.clone();
        reference.all_reduce_sum(&mut want, wire)?;
        for comm in [&nccl as &dyn Communicator, &host] {
            let mut got = values.clone();
            comm.all_reduce_sum(&mut got, wire)?;
            assert_eq!(bits(&got), bits(&want), "{comm:?} all-reduce over a {wire:?} wire");
            let mut block = vec![0.0; values.len()];
            comm.reduce_scatter_sum(&values, &mut block, wire)?;
            assert_eq!(bits(&block), bits(&want), "{comm:?} reduce-scatter over a {wire:?} wire");
        }
    }
    assert_eq!(nccl.all_reduce_max_u32(7)?, 7);
    assert_eq!(nccl.all_reduce_max_f32(-4.0)?, -4.0);
    let mut gathered = vec![0.0; values.len()];
    nccl.all_gather(&values, &mut gathered)?;
    assert_eq!(gathered[..5], values[..5]);
    let mut copy = values.clone();
    nccl.broadcast(&mut copy, 0)?;
    assert_eq!(copy[..5], values[..5]);
    let mut bytes = *b"amp over nccl";
    nccl.broadcast_bytes(&mut bytes, 0)?;
    assert_eq!(&bytes, b"amp over nccl");
    nccl.barrier()?;
    assert!(matches!(nccl.broadcast(&mut copy, 1), Err(amp::Error::CollectiveShape { .. })));
    // Payload counted as SingleProcess counts the same calls (and the two max words above).
    let (a, b) = (nccl.traffic(), host.traffic());
    assert_eq!((a.all_reduce, a.reduce_scatter), (b.all_reduce + 8, b.reduce_scatter), "{a:?} / {b:?}");
    Ok(())
}

#[test]
fn device_tensors_are_summed_and_broadcast_in_place() -> amp::Result<()> {
    let Some(device) = gpu() else { return Ok(()) };
    let nccl = Nccl::single(&device)?;
    let collectives: &dyn DeviceCollectives = nccl.device_collectives().expect("NCCL moves device memory");
    let host = vec![1.0f32, -2.5, 3.0e-3, 1.0 + 2f32.powi(-10), -7.0e4];
    for (dtype, scale) in [DType::F32, DType::F16, DType::BF16].into_iter().flat_map(|d| [(d, 1.0), (d, 0.5)])
    {
        for wire in [Wire::F32, Wire::Bf16, Wire::F16] {
            let tensor = Tensor::new(host.as_slice(), &device)?.to_dtype(dtype)?;
            let before: Vec<f32> = tensor.to_dtype(DType::F32)?.to_vec1()?;
            collectives.all_reduce_sum_tensors(&[&tensor], wire, scale)?;
            let after: Vec<f32> = tensor.to_dtype(DType::F32)?.to_vec1()?;
            // One rank: the sum is the value, rounded through the wire's type, scaled in f32 and
            // rounded back to the dtype.
            let mut want = before.clone();
            SingleProcess::new().all_reduce_sum(&mut want, wire)?;
            want.iter_mut().for_each(|v| *v *= scale);
            let want: Vec<f32> = Tensor::new(want.as_slice(), &Device::Cpu)?
                .to_dtype(dtype)?
                .to_dtype(DType::F32)?
                .to_vec1()?;
            assert_eq!(
                after.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{dtype:?} over a {wire:?} wire, scale {scale}"
            );
            collectives.broadcast_tensors(&[&tensor], 0)?;
            assert_eq!(tensor.to_dtype(DType::F32)?.to_vec1::<f32>()?, after);
        }
    }
    let on_cpu = Tensor::new(host.as_slice(), &Device::Cpu)?;
    assert!(matches!(
        collectives.all_reduce_sum_tensors(&[&on_cpu], Wire::F32, 1.0),
        Err(amp::Error::Nccl { .. })
    ));
    // A host-only communicator refuses CUDA gradients and says what to use instead.
    let on_gpu = Tensor::new(host.as_slice(), &device)?;
    let refused = all_reduce_gradients(&SingleProcess::new(), &[&on_gpu], &DataParallelConfig::default());
    assert!(matches!(refused, Err(amp::Error::HostCollectivesOnly { .. })), "{refused:?}");
    Ok(())
}

#[test]
fn the_data_parallel_step_on_a_gpu_over_nccl_is_the_fused_step() -> amp::Result<()> {
    let Some(device) = gpu() else { return Ok(()) };
    let nccl = Nccl::single(&device)?;
    for (half, predivide_factor) in [(Precision::Fp16, 1.0), (Precision::Bf16, 2.0)] {
        let (plain, replica) = (model(&device, half)?, model(&device, half)?);
        let scaler = || ScalerConfig { init_scale: 1024.0, growth_interval: 3, ..Default::default() };
        let (mut plain_adam, mut plain_scaler) = (
            FusedAdamW::new(ParamGroups::from_model(&plain)?, AdamConfig::default())?,
            GradScaler::for_model(&plain, scaler())?,
        );
        let (mut adam, mut replica_scaler) = (
            FusedAdamW::new(ParamGroups::from_model(&replica)?, AdamConfig::default())?,
            GradScaler::for_model(&replica, scaler())?,
        );
        let mut dp = DataParallel::new(&nccl, DataParallelConfig { predivide_factor, ..Default::default() })?;
        dp.broadcast_masters(&replica)?;
        let mut rng = StdRng::seed_from_u64(3);
        for step in 0..6 {
            let x = common::randn(&mut rng, &[8, 48], 1.0)?.to_device(&device)?;
            // Step 3 overflows fp16's gradients (and is a large but finite bf16 step).
            let factor = if step == 3 { 1e30 } else { 1.0 };
            let loss = |net: &Two| -> amp::Result<Tensor> {
                Ok((net.fc2.forward(&net.fc1.forward(&x)?.relu()?)?.sqr()?.mean_all()? * factor)?)
            };
            let a = plain_scaler.step_fused(&loss(&plain)?, &mut plain_adam, Some(1.0))?;
            let b = dp.step_fused(&mut replica_scaler, &loss(&replica)?, &mut adam, Some(1.0))?;
            assert_eq!(a.applied(), b.applied(), "{half:?} step {step}: {a} / {b}");
            assert!(masters(&plain)? == masters(&replica)?, "{half:?} step {step}: the masters parted");
        }
        assert_eq!(plain_scaler.state(), replica_scaler.state(), "{half:?}");
    }
    Ok(())
}
