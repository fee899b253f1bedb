//! Durable checkpoints: a child process trains and saves a model, its AdamW state and its loss scaler
//! in a loop while this test kills it with SIGKILL at seeded random moments. After every kill the
//! checkpoint either does not exist yet or loads, and equals one of the complete states the child
//! wrote (the child logs each state's checksum before saving it). Each child resumes from the
//! checkpoint the previous one left, as a restarted job would.

mod common;
mod reliability;

use std::collections::HashSet;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use amp::optim::{AdamConfig, FusedAdamW, ParamGroups};
use amp::scaler::ScalerConfig;
use amp::GradScaler;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use reliability::{checksum, fp16_net, snapshot, Net, Outcome};

/// Set in the child: the directory of its checkpoint and checksum log.
const CHILD_DIR: &str = "AMP_KILL_TEST_DIR";
const KILLS: usize = 200;
const CHECKPOINT: &str = "run.safetensors";
const LOG: &str = "checksums.log";
/// Wide enough that a save takes a while (about 0.4 MB with the moments), so that kills land in it.
const SIZES: (usize, usize, usize) = (32, 256, 32);

fn training_state() -> amp::Result<(Net, FusedAdamW, GradScaler)> {
    let net = fp16_net(SIZES.0, SIZES.1, SIZES.2, 7)?;
    let adam = FusedAdamW::new(ParamGroups::from_model(&net)?, AdamConfig::default())?;
    let scaler =
        GradScaler::new(ScalerConfig { init_scale: 1024.0, growth_interval: 5, ..Default::default() })?;
    Ok((net, adam, scaler))
}

fn state_checksum(net: &Net, adam: &FusedAdamW, scaler: &GradScaler) -> amp::Result<u64> {
    Ok(checksum(&snapshot(net, &[adam, scaler])?))
}

/// The child: resume from the checkpoint if there is one, then step, log, save, forever.
fn save_forever(dir: &Path) -> Outcome {
    let (mut net, mut adam, mut scaler) = training_state()?;
    let path = dir.join(CHECKPOINT);
    if path.exists() {
        amp::checkpoint::load_with(&mut net, &mut [&mut adam, &mut scaler], &path)?;
    }
    let mut log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join(LOG))?;
    // The previous child may have been killed in the middle of a line: end it, so ours start clean.
    log.write_all(b"\n")?;
    println!("ready");
    std::io::stdout().flush()?;
    loop {
        let step = scaler.state().steps;
        let (x, y) = reliability::batch(step, 8, SIZES.0, SIZES.2)?;
        scaler.step_fused(&reliability::mse(&net, &x, &y)?, &mut adam, None)?;
        // Logged before the save begins: every checkpoint on disk has its checksum in the log.
        let line = format!("{:016x}\n", state_checksum(&net, &adam, &scaler)?);
        log.write_all(line.as_bytes())?; // one write: a kill cannot split it

        amp::checkpoint::save_with(&net, &[&adam, &scaler], &path)?;
    }
}

/// The child's entry point: does nothing unless the parent test set [`CHILD_DIR`].
#[test]
fn child_saves_until_killed() -> Outcome {
    match std::env::var_os(CHILD_DIR) {
        Some(dir) => save_forever(Path::new(&dir)),
        None => Ok(()),
    }
}

/// What a kill left.
#[derive(Debug, Default)]
struct Tally {
    tried: usize,
    loaded: usize,
    absent: usize,
    distinct: HashSet<String>,
}

/// Checks the checkpoint after a kill: absent, or loadable and one of the logged states.
fn check_after_kill(dir: &Path, tally: &mut Tally) -> Outcome {
    let path = dir.join(CHECKPOINT);
    if !path.exists() {
        tally.absent += 1;
        return Ok(());
    }
    let (mut net, mut adam, mut scaler) = training_state()?;
    amp::checkpoint::load_with(&mut net, &mut [&mut adam, &mut scaler], &path)
        .unwrap_or_else(|e| panic!("kill {}: the checkpoint does not load: {e}", tally.tried));
    let found = format!("{:016x}", state_checksum(&net, &adam, &scaler)?);
    let logged: HashSet<String> = reliability::read_lines(&dir.join(LOG)).into_iter().collect();
    assert!(
        logged.contains(&found),
        "kill {}: the checkpoint holds a state the child never wrote",
        tally.tried
    );
    tally.loaded += 1;
    tally.distinct.insert(found);
    Ok(())
}

#[test]
fn checkpoints_survive_sigkill_at_random_moments() -> Outcome {
    let dir = reliability::fresh_dir("kill")?;
    let dir_text = dir.to_string_lossy().into_owned();
    let mut rng = StdRng::seed_from_u64(14);
    let mut tally = Tally::default();
    let started = Instant::now();
    for _ in 0..KILLS {
        let mut child = reliability::spawn_self("child_saves_until_killed", &[(CHILD_DIR, &dir_text)])?;
        // A child that is not ready within a minute is stuck: it is killed and the test fails.
        let ready = reliability::wait_for_line(&mut child, "ready", Duration::from_secs(60));
        // The child is killed while it trains, logs or saves; a few times before it is ready.
        std::thread::sleep(Duration::from_micros(rng.random_range(0..40_000)));
        let exited = child.try_wait()?;
        child.kill()?; // SIGKILL on Unix
        child.wait()?;
        assert!(ready && exited.is_none(), "the child stopped by itself ({exited:?}): see its error above");
        tally.tried += 1;
        check_after_kill(&dir, &mut tally)?;
    }
    let partials = std::fs::read_dir(&dir)?
        .filter(|e| e.as_ref().is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".partial")))
        .count();
    let saves = reliability::read_lines(&dir.join(LOG)).iter().filter(|l| !l.is_empty()).count();
    println!(
        "checkpoint kill test: {} kills survived of {} tried in {:.1} s; {} checkpoints loaded ({} distinct \
         states), {} kills before the first save; {} kills landed inside a save (temporary files left); \
         {} saves begun",
        tally.loaded + tally.absent,
        tally.tried,
        started.elapsed().as_secs_f64(),
        tally.loaded,
        tally.distinct.len(),
        tally.absent,
        partials,
        saves
    );
    assert_eq!(tally.tried, KILLS);
    assert!(tally.distinct.len() > KILLS / 10, "the checkpoint moved on between kills: {tally:?}");
    assert!(partials > 0, "some kills landed inside a save, so the test exercised the race");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
