//! `amp::threads::single_candle_thread` in a process of its own (the setting is process-wide and must
//! come before candle's first multi-threaded op, so it cannot share a binary with other tests).

use amp::threads::{single_candle_thread, CandleThreads, CANDLE_THREADS_VARIABLE};
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
    assert_eq!(single_candle_thread(), CandleThreads::LeftAsSet("1".into()));
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
