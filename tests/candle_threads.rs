//! `amp::threads::single_candle_thread` and `candle_pool_that_parks` in a process of their own (the
//! settings are process-wide and must come before candle's first multi-threaded op, so they cannot
//! share a binary with other tests; the second runs in child processes of this one).

use amp::threads::{
    candle_pool_that_parks, single_candle_thread, CandleThreads, CANDLE_SPIN_VARIABLE,
    CANDLE_THREADS_VARIABLE, PARKING_SPINS,
};
use candle_core::{DType, Device, Tensor};

/// The names of this process's threads (Linux).
fn thread_names() -> Vec<String> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return Vec::new() };
    tasks.flatten().filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok()).collect()
}

/// An op big enough for candle to run it on its pool (64 Ki elements and more).
fn big_add() -> f32 {
    let x = Tensor::ones(1 << 20, DType::F32, &Device::Cpu).unwrap();
    (&x + &x).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap()
}

#[test]
fn one_candle_thread_when_set_first() {
    std::env::remove_var(CANDLE_THREADS_VARIABLE);
    assert_eq!(single_candle_thread(), CandleThreads::Single);
    assert_eq!(std::env::var(CANDLE_THREADS_VARIABLE).unwrap(), "1");
    // A value already there (here the one just set) is kept.
    let kept = CandleThreads::LeftAsSet { variable: CANDLE_THREADS_VARIABLE, value: "1".into() };
    assert_eq!(single_candle_thread(), kept);
    assert_eq!(big_add(), 2.0 * (1 << 20) as f32);
    if cfg!(target_os = "linux") {
        let names = thread_names();
        assert!(!names.is_empty(), "/proc/self/task is readable on Linux");
        assert!(
            !names.iter().any(|n| n.starts_with("candle-bp-")),
            "candle started pool workers despite {CANDLE_THREADS_VARIABLE}=1: {names:?}"
        );
    }
}

/// Where candle's pool is already running, nothing is set and the answer says so. Run in a child
/// process of this test binary (with candle's default pool: the variable removed), since this process
/// has set the variable.
#[test]
fn a_pool_already_running_is_reported() {
    if std::env::var_os("AMP_THREADS_CHILD").is_some() {
        assert_eq!(big_add(), 2.0 * (1 << 20) as f32);
        let started = thread_names().iter().any(|n| n.starts_with("candle-bp-"));
        let expected = if started { CandleThreads::PoolAlreadyStarted } else { CandleThreads::Single };
        assert_eq!(single_candle_thread(), expected);
        if started {
            assert!(std::env::var_os(CANDLE_THREADS_VARIABLE).is_none(), "nothing set once the pool runs");
        }
        println!("pool started: {started}");
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "a_pool_already_running_is_reported", "--nocapture"])
        .env("AMP_THREADS_CHILD", "1")
        .env_remove(CANDLE_THREADS_VARIABLE)
        .env("RAYON_NUM_THREADS", "2") // candle sizes its pool from this: one worker
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    if cfg!(target_os = "linux") {
        assert!(stdout.contains("pool started: true"), "candle's pool did not start in the child:\n{stdout}");
    }
}

/// CPU time of this process's candle pool workers so far, in nanoseconds (Linux's schedstat).
fn candle_workers_cpu_ns() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return 0 };
    tasks
        .flatten()
        .filter(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|n| n.starts_with("candle-bp-")))
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|stat| stat.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// In a child process with candle's default pool (one worker): `candle_pool_that_parks` sets the
/// spins, and the worker then parks between ops instead of spinning. Twenty small ops 3 ms apart: the
/// worker's CPU time is their work and its spins after each, about 5 us each with the setting, a
/// millisecond or so each at candle's default (the control: the variable preset to 25 000, which the
/// function keeps).
#[test]
fn candle_workers_park_between_ops_when_set_first() {
    if let Some(mode) = std::env::var_os("AMP_PARKING_CHILD") {
        let expected = if mode == "set" {
            CandleThreads::Parking { spins: PARKING_SPINS }
        } else {
            CandleThreads::LeftAsSet { variable: CANDLE_SPIN_VARIABLE, value: "25000".into() }
        };
        assert_eq!(candle_pool_that_parks(), expected);
        assert_eq!(
            candle_pool_that_parks(),
            CandleThreads::LeftAsSet {
                variable: CANDLE_SPIN_VARIABLE,
                value: std::env::var(CANDLE_SPIN_VARIABLE).unwrap()
            }
        );
        let x = Tensor::ones(1 << 17, DType::F32, &Device::Cpu).unwrap();
        assert_eq!((&x + &x).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap(), 2.0 * (1 << 17) as f32);
        std::thread::sleep(std::time::Duration::from_millis(50));
        let before = candle_workers_cpu_ns();
        for _ in 0..20 {
            std::hint::black_box((&x + &x).unwrap());
            std::thread::sleep(std::time::Duration::from_millis(3));
        }
        println!("worker cpu ns: {}", candle_workers_cpu_ns() - before);
        return;
    }
    if !cfg!(target_os = "linux") {
        return;
    }
    let run = |mode: &str| -> u64 {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap());
        child
            .args(["--exact", "candle_workers_park_between_ops_when_set_first", "--nocapture"])
            .env("AMP_PARKING_CHILD", mode)
            .env_remove(CANDLE_THREADS_VARIABLE)
            .env("RAYON_NUM_THREADS", "2"); // candle sizes its pool from this: one worker
        if mode == "set" {
            child.env_remove(CANDLE_SPIN_VARIABLE);
        } else {
            child.env(CANDLE_SPIN_VARIABLE, "25000");
        }
        let out = child.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "child failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        let line =
            stdout.lines().find_map(|l| l.strip_prefix("worker cpu ns: ")).expect("the child's report");
        line.trim().parse().unwrap()
    };
    let (parking, spinning) = (run("set"), run("control"));
    if spinning == 0 {
        // A kernel without schedstat (or no worker found): the CPU times cannot be compared here.
        eprintln!("candle's worker reported no CPU time (no /proc/.../schedstat?): not compared");
        return;
    }
    assert!(
        parking < spinning / 2,
        "candle's worker used {parking} ns of CPU over 20 ops with {PARKING_SPINS} spins, {spinning} ns at 25 000"
    );
}
