//! Exact resume across processes: N steps in this process against N/2 steps in a child process that
//! saves and exits, then N/2 more in a second child that loads the checkpoint. fp16 O2 with the dynamic
//! scaler, a gradient overflow skipped before the save and one after; for AdamW, SGD with momentum and
//! LAMB. Masters, working copies, optimizer state (with its step count) and scaler state must be
//! bit-identical.

mod common;
mod reliability;

use std::path::Path;

use amp::checkpoint::TrainingState;
use amp::optim::{
    AdamConfig, FusedAdamW, FusedLamb, FusedOptimizer, FusedSgd, LambConfig, ParamGroups, SgdConfig,
};
use amp::scaler::{ScalerConfig, SkipReason};
use amp::GradScaler;
use reliability::{fp16_net, snapshot, Net, Outcome};

/// Set in the children: `first` or `second`, the optimizer, and the directory shared with the parent.
const ROLE: &str = "AMP_RESUME_ROLE";
const OPTIMIZER: &str = "AMP_RESUME_OPTIMIZER";
const DIR: &str = "AMP_RESUME_DIR";
const STEPS: u64 = 40;
/// Steps whose loss is multiplied by 1e30: finite in f32, its gradient overflows fp16 in the half layers.
const OVERFLOWS: [u64; 2] = [STEPS / 2 - 3, STEPS / 2 + 2];
const SIZES: (usize, usize, usize) = (6, 24, 3);

type Snapshot = Vec<(String, Vec<u32>)>;

trait Optimizer: FusedOptimizer + TrainingState {}
impl<T: FusedOptimizer + TrainingState> Optimizer for T {}

fn optimizer(name: &str, net: &Net) -> amp::Result<Box<dyn Optimizer>> {
    let groups = ParamGroups::from_model(net)?;
    Ok(match name {
        "adamw" => Box::new(FusedAdamW::new(groups, AdamConfig::default())?),
        "sgd" => {
            Box::new(FusedSgd::new(groups, SgdConfig { lr: 0.05, momentum: 0.9, ..Default::default() })?)
        }
        "lamb" => Box::new(FusedLamb::new(groups, LambConfig::default())?),
        other => panic!("unknown optimizer {other}"),
    })
}

fn scaler() -> amp::Result<GradScaler> {
    GradScaler::new(ScalerConfig { init_scale: 1024.0, growth_interval: 4, ..Default::default() })
}

/// Trains steps `from..to`, checking that exactly the overflow steps are skipped, each as a gradient
/// overflow.
fn train(net: &Net, opt: &mut dyn Optimizer, scaler: &mut GradScaler, from: u64, to: u64) -> Outcome {
    for step in from..to {
        let (x, y) = reliability::batch(step, 8, SIZES.0, SIZES.2)?;
        let mut loss = reliability::mse(net, &x, &y)?;
        if OVERFLOWS.contains(&step) {
            loss = (loss * 1e30)?;
            if std::env::var(ROLE).as_deref() == Ok("second") {
                loss = (loss * 1.0000001)?;
            }
        }
        let report = scaler.step_fused(&loss, opt, None)?;
        assert_eq!(report.applied(), !OVERFLOWS.contains(&step), "step {step}: {report}");
        if !report.applied() {
            assert!(matches!(report.skipped, Some(SkipReason::GradientOverflow { .. })), "{report}");
        }
    }
    Ok(())
}

fn state_snapshot(net: &Net, opt: &dyn Optimizer, scaler: &GradScaler) -> amp::Result<Snapshot> {
    let opt: &dyn TrainingState = opt;
    snapshot(net, &[opt, scaler])
}

/// A child's work: the first half and a save, or a load and the second half and a snapshot.
fn child(role: &str, name: &str, dir: &Path) -> Outcome {
    let checkpoint = dir.join(format!("{name}-half.safetensors"));
    if role == "first" {
        let net = fp16_net(SIZES.0, SIZES.1, SIZES.2, 3)?;
        let (mut opt, mut scaler) = (optimizer(name, &net)?, scaler()?);
        train(&net, opt.as_mut(), &mut scaler, 0, STEPS / 2)?;
        let opt: &dyn TrainingState = opt.as_ref();
        amp::checkpoint::save_with(&net, &[opt, &scaler], &checkpoint)?;
        return Ok(());
    }
    // Other initial weights and default settings: everything must come from the checkpoint.
    let mut net = fp16_net(SIZES.0, SIZES.1, SIZES.2, 99)?;
    let mut opt = optimizer(name, &net)?;
    let mut scaler = GradScaler::new(ScalerConfig::default())?;
    amp::checkpoint::load_with(
        &mut net,
        &mut [opt.as_mut() as &mut dyn TrainingState, &mut scaler],
        &checkpoint,
    )?;
    train(&net, opt.as_mut(), &mut scaler, STEPS / 2, STEPS)?;
    let json = serde_json::to_string(&state_snapshot(&net, opt.as_ref(), &scaler)?)?;
    std::fs::write(dir.join(format!("{name}-final.json")), json)?;
    Ok(())
}

/// The children's entry point: does nothing unless the parent test set [`ROLE`].
#[test]
fn child_trains_half_a_run() -> Outcome {
    match (std::env::var(ROLE), std::env::var(OPTIMIZER), std::env::var_os(DIR)) {
        (Ok(role), Ok(name), Some(dir)) => child(&role, &name, Path::new(&dir)),
        _ => Ok(()),
    }
}

fn run_child(role: &str, name: &str, dir: &str) -> Outcome {
    let env = [(ROLE, role), (OPTIMIZER, name), (DIR, dir)];
    let status = reliability::spawn_self("child_trains_half_a_run", &env)?.wait()?;
    assert!(status.success(), "the {role} child of {name} failed: {status}");
    Ok(())
}

#[test]
fn a_run_resumed_in_a_new_process_is_bit_identical_to_an_uninterrupted_one() -> Outcome {
    let dir = reliability::fresh_dir("resume")?;
    let dir_text = dir.to_string_lossy().into_owned();
    for name in ["adamw", "sgd", "lamb"] {
        let net = fp16_net(SIZES.0, SIZES.1, SIZES.2, 3)?;
        let (mut opt, mut scaler) = (optimizer(name, &net)?, scaler()?);
        train(&net, opt.as_mut(), &mut scaler, 0, STEPS)?;
        let straight = state_snapshot(&net, opt.as_ref(), &scaler)?;

        run_child("first", name, &dir_text)?;
        run_child("second", name, &dir_text)?;
        let text = std::fs::read_to_string(dir.join(format!("{name}-final.json")))?;
        let resumed: Snapshot = serde_json::from_str(&text)?;
        assert_eq!(resumed.len(), straight.len(), "{name}: the same parts");
        for ((part, a), (_, b)) in resumed.iter().zip(&straight) {
            assert!(a == b, "{name}: `{part}` differs after the resume");
        }
        let state = scaler.state();
        assert_eq!((state.steps, state.skipped), (STEPS, OVERFLOWS.len() as u64), "{name}");
        println!("{name}: {} parts bit-identical after a resume in a new process", straight.len());
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
