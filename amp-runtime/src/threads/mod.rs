//! Process-wide thread settings for training on the CPU.
//!
//! candle 0.11 runs its elementwise ops on a pool of its own (`candle-bp-*` threads, one fewer than
//! the cores, the caller taking the last share) beside rayon's pool, where amp's GEMM, optimizers and
//! kernels run. After each op a candle worker spins for 25 000 `pause` instructions before it parks:
//! on a CPU whose `pause` takes ~140 cycles (Intel since Skylake-SP) about a millisecond, during which
//! it holds a core the GEMM's threads wait for. A training step runs a candle op every few hundred
//! microseconds, so the worker hardly ever parks: on 2 cores `perf` put 18% of the bf16 MLP step's
//! samples in that loop (with candle's ReLUs, before they were fused). Two remedies:
//! [`candle_pool_that_parks`] keeps candle's pool but has its workers park after [`PARKING_SPINS`]
//! spins, and [`single_candle_thread`] runs candle's ops on the calling thread alone.
//!
//! Measured on the main job (`cargo run --release --example train`, 2 cores). Against candle's default
//! pool, one candle thread made the steps 14-25% shorter for fp32, bf16 and fp16 alike (2026-12-03),
//! and on 2026-12-04 beat a pool told to park after 1000 spins (bf16 7.0-7.5 k tokens/s against
//! 5.6-6.4 k, fp32 within 5%): candle ran many of the step's ops then. Since amp's ops took over all
//! but candle's backward pass (its zero fills and adds of the activations' gradients: about a tenth of
//! a step), the parking pool wins, as those adds run on both cores: on a Xeon (AMX), 2026-12-06, the
//! two alternated, three pairs of runs, fp32 steps 0.96-0.97x the time, bf16 0.94-0.95x, fp16
//! 0.96-0.97x (1, 100 and 1000 spins alike, 5000 between; the main job calls it first thing). Where
//! amp's fused ops leave few candle ops in a step (the MLP bench, `cargo bench --bench mlp_step`)
//! neither makes a difference to amp's runs, and one thread slows a model that leans on candle's own
//! ops (the bench's candle matmul run: 63 -> 77 ms), so that bench leaves candle's pool alone.
//!
//! [`run_on_rayon_pool`] runs a training loop on a thread of a rayon pool. Each parallel op called from
//! outside the pool (from `main`) hands its whole work to the pool's threads and sleeps until they are
//! done: a thread wakes and another sleeps at every op, hundreds of times a step. Called from a thread
//! of the pool, the op forks there and that thread takes a share itself. Measured on the main job,
//! which runs that way (2 cores, Zen 3; 2026-12-05; alternated with the build before, 11 pairs of
//! runs): fp32, bf16 and fp16 steps 0.87-1.01x the time, median 0.95x; the operating system's share
//! of the samples from 9% to 6% (its scheduler's from about 4% to 2%). While the loop runs, the pool's
//! other threads look for work instead of sleeping between ops (`helpers`): on the main job on a Xeon
//! (AMX), 2 cores, 2026-12-06, the builds without and with them alternated, six pairs of runs: fp32
//! steps 0.93-0.96x the time, bf16 0.91-0.96x, fp16 0.93-0.96x; the MLP bench's (`cargo bench --bench
//! mlp_step`) bf16 step 0.93-0.96x, fp32 0.98-0.99x, three pairs.

mod helpers;

/// candle's variable for the size of its pool (read once, when the pool starts).
pub const CANDLE_THREADS_VARIABLE: &str = "CANDLE_NUM_THREADS";

/// candle's variable for the `pause` spins its pool's idle workers make before they park (read once,
/// when the pool starts; 25 000 unless set).
pub const CANDLE_SPIN_VARIABLE: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";

/// The spins [`candle_pool_that_parks`] sets: about 5 us of `pause` on an Intel core since Skylake-SP,
/// 2-3 us on a Zen. Enough to catch the next of a run of candle ops, short against the gaps between
/// them in a training step (amp's ops between; 1 to 1000 spins measured alike on the main job).
pub const PARKING_SPINS: u32 = 100;

/// What [`single_candle_thread`] or [`candle_pool_that_parks`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CandleThreads {
    /// candle's ops will run on the calling thread alone.
    Single,
    /// candle's pool keeps its threads, which park after this many spins without work.
    Parking {
        /// The spins before a worker parks.
        spins: u32,
    },
    /// The user had set the variable already; their value stays.
    LeftAsSet {
        /// The variable ([`CANDLE_THREADS_VARIABLE`] or [`CANDLE_SPIN_VARIABLE`]).
        variable: &'static str,
        /// Its value.
        value: String,
    },
    /// candle's pool was already running, so the variable would not be read; nothing was changed.
    /// Call [`single_candle_thread`] or [`candle_pool_that_parks`] first thing in `main`, before any
    /// tensor op.
    PoolAlreadyStarted,
}

impl std::fmt::Display for CandleThreads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Single => {
                write!(f, "candle's elementwise ops on the calling thread, the cores left to rayon")
            }
            Self::Parking { spins } => {
                write!(f, "candle's pool parks its idle threads after {spins} spins ({CANDLE_SPIN_VARIABLE})")
            }
            Self::LeftAsSet { variable, value } => write!(f, "{variable}={value} (set by the user, kept)"),
            Self::PoolAlreadyStarted => {
                write!(
                    f,
                    "candle's thread pool had started: left as it is (set its threads up first in main)"
                )
            }
        }
    }
}

/// Makes candle run its elementwise ops on the calling thread, without a pool of its own whose idle
/// workers spin on the cores amp's GEMM needs. Sets [`CANDLE_THREADS_VARIABLE`] to 1 unless the user
/// set it; it must run before candle's pool starts (its first multi-threaded op) and, since it changes
/// the environment, before the program starts threads of its own: call it first thing in `main`.
/// Where the pool has started already (detected on Linux by its threads' names) nothing changes and
/// the result says so. A model whose step runs candle's ops back to back does better with
/// [`candle_pool_that_parks`] (see the module's notes).
pub fn single_candle_thread() -> CandleThreads {
    set_before_the_pool(CANDLE_THREADS_VARIABLE, "1", CandleThreads::Single)
}

/// Keeps candle's pool, so that its ops (the zero fills and adds of its backward pass) run on every
/// core, but has its idle workers park after [`PARKING_SPINS`] spins instead of 25 000, so that they
/// leave the cores to amp's GEMM between candle's ops. Sets [`CANDLE_SPIN_VARIABLE`] unless the user
/// set it; as [`single_candle_thread`], call it first thing in `main`, before candle's pool starts
/// (where it has, nothing changes and the result says so).
pub fn candle_pool_that_parks() -> CandleThreads {
    set_before_the_pool(
        CANDLE_SPIN_VARIABLE,
        &PARKING_SPINS.to_string(),
        CandleThreads::Parking { spins: PARKING_SPINS },
    )
}

/// Sets candle's `variable` to `value` and returns `done`, unless the user set it or candle's pool runs.
fn set_before_the_pool(variable: &'static str, value: &str, done: CandleThreads) -> CandleThreads {
    if let Ok(value) = std::env::var(variable) {
        return CandleThreads::LeftAsSet { variable, value };
    }
    if candle_pool_running() {
        return CandleThreads::PoolAlreadyStarted;
    }
    std::env::set_var(variable, value);
    done
}

/// Stack of each thread of [`run_on_rayon_pool`]'s pool. candle walks the graph recursively in
/// `backward`: measured with candle 0.11.1, a chain of 10 000 ops overflowed a 2 MiB stack (rayon's
/// default), where `main` has 8 MiB (Linux's default). Only the pages a thread touches are committed.
pub const POOL_STACK_BYTES: usize = 64 << 20;

/// Runs `work` on a thread of amp's rayon pool and returns what it returns, so that the parallel ops
/// inside it (amp's GEMM, kernels and optimizers) fork from a thread of the pool instead of waking it
/// from outside at every op (see the module's documentation). The pool starts at the first call and
/// serves every later one: as many threads as rayon's global pool would have (`RAYON_NUM_THREADS`,
/// else one a core), stacks of [`POOL_STACK_BYTES`]. Called from a thread of a rayon pool already,
/// runs `work` right there. The dispatch override scoped on the calling thread
/// ([`crate::dispatch::with_override`]) holds inside `work` too; other thread-local state (a
/// [`crate::cast_cache::CastCache`]) stays with the calling thread. A panic in `work` reaches the
/// caller. Where the pool cannot start (no thread could be spawned), `work` runs on the calling
/// thread, with a warning logged once. While `work` runs, the pool's other threads spin between the
/// ops it forks instead of going to sleep, so each op starts on every core at once; they yield the
/// core to any other thread that wants it, nap after 2 ms without work (1 ms at a time after 50 ms),
/// and go back to sleeping as rayon does when `work` returns. They stay out of a call whose work shares the pool with another
/// call's (from the moment the second starts), and of a pool with more threads than the machine has
/// cores.
///
/// ```
/// let loss = amp_runtime::threads::run_on_rayon_pool(|| {
///     // The training loop: every step's parallel ops fork from this thread.
///     assert!(rayon::current_thread_index().is_some());
///     0.5f32
/// });
/// assert_eq!(loss, 0.5);
/// ```
pub fn run_on_rayon_pool<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        return work();
    }
    match amp_pool() {
        Some(pool) => {
            let scoped = crate::dispatch::scoped_override();
            pool.install(|| {
                let _helpers = helpers::Helpers::start(pool);
                crate::dispatch::with_scoped(scoped, work)
            })
        }
        None => work(),
    }
}

/// [`run_on_rayon_pool`]'s pool, started at the first call (`None` if it could not start).
fn amp_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let pool = rayon::ThreadPoolBuilder::new()
            .stack_size(POOL_STACK_BYTES)
            .thread_name(|i| format!("amp-rayon-{i}"))
            .build();
        pool.map_err(|error| {
            tracing::warn!(%error, "amp: no rayon pool could start; training on the calling thread");
        })
        .ok()
    })
    .as_ref()
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

    use crate::dispatch::{self, GemmPath, Override};
    use candle_core::{Device, Var};
    use std::sync::atomic::Ordering;
    use std::sync::{Mutex, MutexGuard};
    use std::time::{Duration, Instant};

    /// The tests that run work on amp's pool, one at a time: helpers stand down while two loops
    /// share it.
    fn exclusive_pool() -> MutexGuard<'static, ()> {
        static POOL: Mutex<()> = Mutex::new(());
        let pool = POOL.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // The last test's helpers have left (they see its loop stop at their next look).
        assert_eq!(wait_for_helpers(0), 0, "a helper of an earlier loop stayed");
        pool
    }

    /// Whether helpers run on amp's pool here: two threads at least, no more than the cores.
    fn helpers_run() -> bool {
        let threads = amp_pool().expect("the pool starts").current_num_threads();
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        threads > 1 && threads <= cores
    }

    /// Waits (up to 20 s) until `helping` helpers are inside their loop; the count seen last.
    fn wait_for_helpers(helping: usize) -> usize {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let now = helpers::HELPING.load(Ordering::Acquire);
            if now == helping || Instant::now() > deadline {
                return now;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn the_other_threads_help_while_the_work_runs_and_stop_when_it_returns() {
        let _pool = exclusive_pool();
        let others =
            if helpers_run() { amp_pool().expect("the pool starts").current_num_threads() - 1 } else { 0 };
        let (at_start, sum) = run_on_rayon_pool(|| {
            // The work starts once every helper has entered, before it forks anything: none can start
            // inside one of its jobs.
            let at_start = helpers::HELPING.load(Ordering::Acquire);
            // Work forked now runs on the helpers as on sleeping threads: same result.
            let sum: u64 = rayon::iter::ParallelIterator::sum(
                rayon::iter::IntoParallelIterator::into_par_iter(0..100_000u64),
            );
            (at_start, sum)
        });
        assert_eq!(at_start, others, "every other thread of the pool helps from the work's start");
        assert_eq!(sum, 4_999_950_000);
        assert_eq!(wait_for_helpers(0), 0, "the helpers return with the work");
        // A panicking work stops them too.
        let panicked = std::panic::catch_unwind(|| {
            run_on_rayon_pool(|| {
                wait_for_helpers(others);
                panic!("the work failed")
            })
        });
        assert!(panicked.is_err());
        assert_eq!(wait_for_helpers(0), 0, "the helpers return when the work panics");
    }

    #[test]
    fn a_loop_started_beside_another_holds_neither() {
        let _pool = exclusive_pool();
        if amp_pool().expect("the pool starts").current_num_threads() < 2 {
            eprintln!("skipped: two loops need two threads in the pool");
            return;
        }
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;
        // Loop B runs with its helper; loop A starts on that helper's thread, while B looks for work
        // (as in a join's wait) until A says it started, then for whatever A queued. A then waits for B
        // to pass: a helper of A that had landed in B's loop and stayed would hold B until A ended, and
        // A would never see it.
        let (a_started, b_passed) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let (b_running, b_is_running) = std::sync::mpsc::channel();
        let b = {
            let (a_started, b_passed) = (a_started.clone(), b_passed.clone());
            std::thread::spawn(move || {
                run_on_rayon_pool(|| {
                    b_running.send(()).unwrap();
                    while !a_started.load(Ordering::Acquire) {
                        std::hint::spin_loop();
                    }
                    // A's helper was queued for this thread before A said it started.
                    while rayon::yield_now() == Some(rayon::Yield::Executed) {}
                    b_passed.store(true, Ordering::Release);
                })
            })
        };
        b_is_running.recv().unwrap();
        let a_saw_b_pass = run_on_rayon_pool(|| {
            a_started.store(true, Ordering::Release);
            let deadline = Instant::now() + Duration::from_secs(20);
            while !b_passed.load(Ordering::Acquire) && Instant::now() < deadline {
                std::hint::spin_loop();
            }
            b_passed.load(Ordering::Acquire)
        });
        b.join().unwrap();
        assert!(a_saw_b_pass, "a helper of loop A held loop B");
        assert_eq!(wait_for_helpers(0), 0);
    }

    #[test]
    fn two_loops_on_the_pool_at_once_both_finish() {
        let _pool = exclusive_pool();
        if amp_pool().expect("the pool starts").current_num_threads() < 2 {
            eprintln!("skipped: two loops that wait for each other need two threads in the pool");
            return;
        }
        // Two callers whose loops wait for each other inside, forking all the while: a helper of one
        // loop taken inside the other's fork-join would hold it until its own loop ended, and the
        // loops would never meet. Both loops run before either forks or blocks: a loop still queued
        // could be taken up inside the other's fork-join and block it at the barrier (rayon's, not the
        // helpers', hazard).
        let meet = std::sync::Arc::new(std::sync::Barrier::new(2));
        let started = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (done, finished) = std::sync::mpsc::channel();
        for caller in 0..2u64 {
            let (meet, started, done) = (meet.clone(), started.clone(), done.clone());
            std::thread::spawn(move || {
                let sum = run_on_rayon_pool(|| {
                    started.fetch_add(1, Ordering::AcqRel);
                    while started.load(Ordering::Acquire) < 2 {
                        std::hint::spin_loop();
                    }
                    let mut sum = 0u64;
                    for round in 0..50u64 {
                        let (a, b) = rayon::join(|| round * 2, || caller + round);
                        sum += a + b;
                        if round % 10 == 0 {
                            meet.wait();
                        }
                    }
                    sum
                });
                done.send(sum).unwrap();
            });
        }
        let mut sums: Vec<u64> = (0..2)
            .map(|_| finished.recv_timeout(Duration::from_secs(60)).expect("both loops finish"))
            .collect();
        sums.sort_unstable();
        assert_eq!(sums, [3675, 3725]);
        assert_eq!(wait_for_helpers(0), 0);
    }

    #[test]
    fn work_runs_on_one_pool_call_after_call_and_its_ops_fork_there() {
        let _pool = exclusive_pool();
        let caller = std::thread::current().id();
        let (on_pool, name, same_thread) = run_on_rayon_pool(|| {
            let me = std::thread::current().id();
            // A parallel op inside forks from this thread, which takes a share itself.
            let threads: Vec<_> = rayon::broadcast(|_| std::thread::current().id());
            (
                rayon::current_thread_index().is_some(),
                std::thread::current().name().map(String::from),
                threads.contains(&me),
            )
        });
        assert!(on_pool && same_thread);
        assert!(name.as_deref().is_some_and(|n| n.starts_with("amp-rayon-")), "{name:?}");
        assert_eq!(std::thread::current().id(), caller);
        // Every call runs on the same pool.
        let pools: Vec<Vec<_>> = (0..2)
            .map(|_| {
                run_on_rayon_pool(|| {
                    let mut ids = rayon::broadcast(|_| std::thread::current().id());
                    ids.sort_by_key(|id| format!("{id:?}"));
                    ids
                })
            })
            .collect();
        assert_eq!(pools[0], pools[1]);
        // From a thread of a pool, it runs right there.
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let (outer, inner) =
            pool.install(|| (std::thread::current().id(), run_on_rayon_pool(|| std::thread::current().id())));
        assert_eq!(outer, inner);
    }

    #[test]
    fn a_graph_too_deep_for_rayons_default_stack_backpropagates() {
        let _pool = exclusive_pool();
        // candle's backward walks the graph recursively: 10 000 ops overflowed a 2 MiB stack.
        let grad = run_on_rayon_pool(|| {
            let v = Var::new(&[1f32, 2.0], &Device::Cpu).unwrap();
            let mut x = v.as_tensor().clone();
            for _ in 0..20_000 {
                x = (x * 1.0).unwrap();
            }
            let grads = x.sum_all().unwrap().backward().unwrap();
            grads.get(v.as_tensor()).unwrap().to_vec1::<f32>().unwrap()
        });
        assert_eq!(grad, [1.0, 1.0]);
    }

    #[test]
    fn the_callers_scoped_dispatch_override_holds_inside() {
        let _pool = exclusive_pool();
        let over = Override::Path(GemmPath::Portable);
        let inside = dispatch::with_override(over, || run_on_rayon_pool(dispatch::current_override)).unwrap();
        assert_eq!(inside, over);
        assert_eq!(run_on_rayon_pool(dispatch::current_override), dispatch::current_override());
    }

    #[test]
    #[should_panic(expected = "the work failed")]
    fn a_panic_in_the_work_reaches_the_caller() {
        let _pool = exclusive_pool();
        run_on_rayon_pool(|| panic!("the work failed"));
    }

    #[test]
    fn says_what_it_did() {
        assert!(CandleThreads::Single.to_string().contains("calling thread"));
        let set = CandleThreads::LeftAsSet { variable: CANDLE_THREADS_VARIABLE, value: "4".into() };
        assert!(set.to_string().contains("CANDLE_NUM_THREADS=4"));
        let parking = CandleThreads::Parking { spins: 100 }.to_string();
        assert!(parking.contains("after 100 spins") && parking.contains(CANDLE_SPIN_VARIABLE));
        assert!(CandleThreads::PoolAlreadyStarted.to_string().contains("first in main"));
    }
}
