//! Which public types cross threads, stated as compile-time assertions, and an optimizer step and a
//! scaler update driven from another thread than the one that built them, bit-identical to the same
//! steps on the building thread.
//!
//! `Send + Sync`: models and layers (parameters are candle `Var`s: shared, reference-counted tensors),
//! `Param`, the fused optimizers and their parameter groups, `GradScaler` and its settings, state and
//! reports, policies and configs, checkpoint types, `Error`. Not `Send`: `CastCache`, a guard of a
//! per-thread cache that must be dropped on the thread that entered it.

mod common;
mod reliability;

use amp::checkpoint::{CheckpointProblem, CheckpointProblems, LoadOptions, SavedState};
use amp::nn::{
    BatchNorm, Conv1d, Conv2d, ConvTranspose1d, ConvTranspose2d, Dropout, Embedding, GroupNorm, LayerNorm,
    Linear, MultiHeadAttention, RmsNorm,
};
use amp::optim::{
    AdamConfig, FusedAdam, FusedAdamW, FusedLamb, FusedSgd, GroupOptions, LambConfig, OptimParam,
    ParamGroups, SgdConfig,
};
use amp::scaler::{ScaleState, ScalerConfig, Settled, SkipReason, StepReport};
use amp::{AmpConfig, CastCache, Error, GradScaler, OptLevel, Param, Policy, Precision, PrecisionPlan};
use reliability::{fp16_net, snapshot, Net, Outcome};

const fn send_sync<T: Send + Sync + ?Sized>() {}

/// Resolves only when `T` is not `Send`: for a `Send` type both impls apply and the call is ambiguous.
trait AmbiguousIfSend<A> {
    fn not_send() {}
}
impl<T: ?Sized> AmbiguousIfSend<()> for T {}
impl<T: ?Sized + Send> AmbiguousIfSend<u8> for T {}

const _: () = {
    send_sync::<Net>();
    send_sync::<Linear>();
    send_sync::<LayerNorm>();
    send_sync::<RmsNorm>();
    send_sync::<GroupNorm>();
    send_sync::<BatchNorm>();
    send_sync::<Conv1d>();
    send_sync::<Conv2d>();
    send_sync::<ConvTranspose1d>();
    send_sync::<ConvTranspose2d>();
    send_sync::<Embedding>();
    send_sync::<Dropout>();
    send_sync::<MultiHeadAttention>();
    send_sync::<Param>();
    send_sync::<FusedAdam>();
    send_sync::<FusedAdamW>();
    send_sync::<FusedSgd>();
    send_sync::<FusedLamb>();
    send_sync::<ParamGroups>();
    send_sync::<OptimParam>();
    send_sync::<GroupOptions>();
    send_sync::<AdamConfig>();
    send_sync::<SgdConfig>();
    send_sync::<LambConfig>();
    send_sync::<GradScaler>();
    send_sync::<ScalerConfig>();
    send_sync::<ScaleState>();
    send_sync::<StepReport>();
    send_sync::<SkipReason>();
    send_sync::<Settled>();
    send_sync::<Policy>();
    send_sync::<OptLevel>();
    send_sync::<AmpConfig>();
    send_sync::<Precision>();
    send_sync::<PrecisionPlan>();
    send_sync::<SavedState>();
    send_sync::<LoadOptions>();
    send_sync::<CheckpointProblem>();
    send_sync::<CheckpointProblems>();
    send_sync::<Error>();
};

#[test]
fn cast_cache_guards_stay_on_their_thread() {
    // Compiles only while `CastCache` is not `Send`.
    <CastCache as AmbiguousIfSend<_>>::not_send();
}

const SIZES: (usize, usize, usize) = (4, 16, 2);

fn train(net: &Net, adam: &mut FusedAdamW, scaler: &mut GradScaler, steps: std::ops::Range<u64>) -> Outcome {
    for step in steps {
        let (x, y) = reliability::batch(step, 8, SIZES.0, SIZES.2)?;
        let mut loss = reliability::mse(net, &x, &y)?;
        if step % 7 == 3 {
            loss = (loss * 1e30)?; // a gradient overflow: a skipped step and a scale backoff
        }
        scaler.step_fused(&loss, adam, None)?;
    }
    Ok(())
}

fn built() -> amp::Result<(Net, FusedAdamW, GradScaler)> {
    let net = fp16_net(SIZES.0, SIZES.1, SIZES.2, 11)?;
    let adam = FusedAdamW::new(ParamGroups::from_model(&net)?, AdamConfig::default())?;
    let scaler =
        GradScaler::new(ScalerConfig { init_scale: 1024.0, growth_interval: 4, ..Default::default() })?;
    Ok((net, adam, scaler))
}

#[test]
fn steps_and_scaler_updates_driven_from_another_thread_match_the_building_thread() -> Outcome {
    let (net, mut adam, mut scaler) = built()?;
    train(&net, &mut adam, &mut scaler, 0..20)?;
    let here = snapshot(&net, &[&adam, &scaler])?;

    // Built here, moved to another thread, stepped there, moved back.
    let (net, adam, scaler) = built()?;
    let worker = std::thread::spawn(move || -> Result<_, String> {
        let (mut adam, mut scaler) = (adam, scaler);
        train(&net, &mut adam, &mut scaler, 0..20).map_err(|e| e.to_string())?;
        Ok((net, adam, scaler))
    });
    let (net, adam, mut scaler) = worker.join().expect("no panic")?;
    assert_eq!(snapshot(&net, &[&adam, &scaler])?, here, "bit-identical to the steps on this thread");
    assert_eq!(scaler.state().skipped, 3, "steps 3, 10 and 17 overflowed");

    // A scaler borrowed by a scoped thread: its update there is seen here.
    let before = scaler.state().steps;
    std::thread::scope(|s| s.spawn(|| scaler.update(Some(SkipReason::NonFiniteLoss))).join())
        .expect("no panic")?;
    assert_eq!(scaler.state().steps, before + 1);
    Ok(())
}
