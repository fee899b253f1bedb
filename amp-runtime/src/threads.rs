//! Process-wide thread settings for training on the CPU.
//!
//! candle 0.11 runs its elementwise ops on a pool of its own (`candle-bp-*` threads, one fewer than
//! the cores, the caller taking the last share) beside rayon's pool, where amp's GEMM, optimizers and
//! kernels run. After each op a candle worker spins for 25 000 `pause` instructions before it parks:
//! on a CPU whose `pause` takes ~140 cycles (Intel since Skylake-SP) about a millisecond, during which
//! it holds a core the GEMM's threads wait for. A training step runs a candle op every few hundred
//! microseconds, so the worker hardly ever parks: on 2 cores `perf` put 18% of the bf16 MLP step's
//! samples in that loop (with candle's ReLUs, before they were fused). [`single_candle_thread`] runs
//! candle's ops on the calling thread alone, so the cores stay with rayon's pool.
//!
//! Measured on the main job (`cargo run --release --example train`, 2 cores), which calls it first
//! thing: 14-25% shorter steps for fp32, bf16 and fp16 alike against candle's default pool (2026-12-03);
//! against candle's pool told to park after 1000 spins (`CANDLE_BARRIER_POOL_SPIN_LIMIT=1000`), bf16
//! 7.0-7.5 k tokens/s against 5.6-6.4 k, fp32 within 5% (2026-12-04, alternated). Where amp's fused
//! ops leave few candle ops in a step (the MLP bench, `cargo bench --bench mlp_step`) it makes no
//! difference to amp's runs, and it slows a model that leans on candle's own ops (the bench's candle
//! matmul run: 63 -> 77 ms), so that bench leaves candle's pool alone.

/// candle's variable for the size of its pool (read once, when the pool starts).
pub const CANDLE_THREADS_VARIABLE: &str = "CANDLE_NUM_THREADS";

/// What [`single_candle_thread`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CandleThreads {
    /// candle's ops will run on the calling thread alone.
    Single,
    /// The user had set the variable already; their value stays.
    LeftAsSet(String),
    /// candle's pool was already running, so the variable would not be read; nothing was changed.
    /// Call [`single_candle_thread`] first thing in `main`, before any tensor op.
    PoolAlreadyStarted,
}

impl std::fmt::Display for CandleThreads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Single => {
                write!(f, "candle's elementwise ops on the calling thread, the cores left to rayon")
            }
            Self::LeftAsSet(v) => write!(f, "{CANDLE_THREADS_VARIABLE}={v} (set by the user, kept)"),
            Self::PoolAlreadyStarted => {
                write!(f, "candle's thread pool had started: left as it is (call single_candle_thread first in main)")
            }
        }
    }
}

/// Makes candle run its elementwise ops on the calling thread, without a pool of its own whose idle
/// workers spin on the cores amp's GEMM needs. Sets [`CANDLE_THREADS_VARIABLE`] to 1 unless the user
/// set it; it must run before candle's pool starts (its first multi-threaded op) and, since it changes
/// the environment, before the program starts threads of its own: call it first thing in `main`.
/// Where the pool has started already (detected on Linux by its threads' names) nothing changes and
/// the result says so.
pub fn single_candle_thread() -> CandleThreads {
    if let Ok(value) = std::env::var(CANDLE_THREADS_VARIABLE) {
        return CandleThreads::LeftAsSet(value);
    }
    if candle_pool_running() {
        return CandleThreads::PoolAlreadyStarted;
    }
    std::env::set_var(CANDLE_THREADS_VARIABLE, "1");
    CandleThreads::Single
}

/// Whether a thread of candle's pool (named `candle-bp-<n>`) exists in this process. Linux only; `false`
/// elsewhere (where the caller's word that it runs first is all there is).
fn candle_pool_running() -> bool {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return false };
    tasks.flatten().any(|task| {
        std::fs::read_to_string(task.path().join("comm")).is_ok_and(|name| name.starts_with("candle-bp-"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn says_what_it_did() {
        assert!(CandleThreads::Single.to_string().contains("calling thread"));
        assert!(CandleThreads::LeftAsSet("4".into()).to_string().contains("CANDLE_NUM_THREADS=4"));
        assert!(CandleThreads::PoolAlreadyStarted.to_string().contains("first in main"));
    }
}
