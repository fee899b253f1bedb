//! The pool's other threads kept looking for work while a training loop runs on [`super::run_on_rayon_pool`].
//!
//! A rayon thread that finds no work yields a few dozen times and then sleeps; the next parallel op
//! wakes it through the kernel (a futex) and it joins the op tens of microseconds late. Between
//! parallel ops a training step runs candle's ops on one thread only, long enough for the others to
//! fall asleep, so every GEMM, optimizer step and fused kernel paid that wake-up: on 2 cores of a Xeon
//! (AMX), the main job's bf16 step spent about 6% of its samples in the scheduler and its products ran
//! 50-100 us later each than with the second thread awake. While a loop runs, each other thread of the
//! pool runs [`look_for_work`] instead: it takes any job the pool has (`rayon::yield_now`) and spins
//! between them, so it joins the next op at once. Every 64 fruitless looks it yields the core to any
//! other thread that wants it (candle's own pool, where a program keeps one), and after [`NAP_AFTER`]
//! without work (a loop that evaluates, writes files or waits) it naps [`NAP`] at a time, after
//! [`LONG_NAP_AFTER`] [`LONG_NAP`] at a time, so an idle loop does not hold a core.
//!
//! A helper runs the pool's jobs from inside its own, so it must never itself start inside a job of
//! a loop (in a join's wait), where it would hold that job until its loop ended, and the loop would
//! wait for the job forever. Two rules keep it out:
//! - the loop starts only after every helper has entered (before the loop has forked anything); a
//!   copy that arrives later (its thread was busy for [`ENTRY_WAIT`]) returns at once;
//! - while a second loop shares the pool, every helper returns, and a copy of either loop returns at
//!   once; a loop that started with company runs without helpers.
//!
//! Helpers also stay out of a pool with more threads than the machine has cores, where spinning
//! threads would take turns on the cores the working ones need.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Idle time after which a helper naps between looks for work.
pub(super) const NAP_AFTER: Duration = Duration::from_millis(2);
/// One nap.
pub(super) const NAP: Duration = Duration::from_micros(100);
/// Idle time after which a helper naps [`LONG_NAP`] at a time: a loop that sleeps or waits on I/O then
/// costs about 1% of a core per helper instead of about 15%.
pub(super) const LONG_NAP_AFTER: Duration = Duration::from_millis(50);
/// One nap after [`LONG_NAP_AFTER`]: the most a loop's first op after a long pause waits for a helper.
pub(super) const LONG_NAP: Duration = Duration::from_millis(1);
/// How long a loop waits for its helpers to enter before it starts without the late ones.
pub(super) const ENTRY_WAIT: Duration = Duration::from_millis(200);

/// Loops running on the pool now.
static LOOPS: AtomicUsize = AtomicUsize::new(0);
/// Helpers of any loop inside their loop now, or about to enter it (read by the tests).
pub(super) static HELPING: AtomicUsize = AtomicUsize::new(0);

/// Set in [`Shared::entry`] once the loop has stopped waiting for its helpers: a copy that comes later stays out.
const CLOSED: usize = 1 << (usize::BITS - 1);

/// What a loop shares with its helpers.
#[derive(Default)]
struct Shared {
    /// The loop has returned (or panicked).
    stop: AtomicBool,
    /// Helpers that entered, with [`CLOSED`] once the loop stopped waiting for more.
    entry: AtomicUsize,
}

/// While alive, the pool's other threads look for work (when this is the pool's only loop). Dropping it
/// (the loop returned or panicked) sends them back to rayon's own idling.
pub(super) struct Helpers {
    shared: Arc<Shared>,
}

impl Helpers {
    /// Starts a helper on every thread of `pool` but the calling one, which must be a thread of
    /// `pool` about to run the loop, and returns once they have entered (or [`ENTRY_WAIT`] passed, or
    /// another loop shares the pool).
    pub(super) fn start(pool: &rayon::ThreadPool) -> Helpers {
        let alone = LOOPS.fetch_add(1, Ordering::AcqRel) == 0;
        let shared = Arc::new(Shared::default());
        let others = pool.current_num_threads().saturating_sub(1);
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        if alone && others > 0 && others < cores {
            let caller = rayon::current_thread_index();
            let copy = shared.clone();
            pool.spawn_broadcast(move |ctx| {
                // The caller's own copy runs whenever the loop first waits in a join: it returns.
                if Some(ctx.index()) != caller {
                    // Counted before it enters, so that a loop sees every helper it waited for.
                    HELPING.fetch_add(1, Ordering::AcqRel);
                    if enter(&copy.entry) {
                        look_for_work(&copy.stop);
                    }
                    HELPING.fetch_sub(1, Ordering::AcqRel);
                }
            });
            let since = Instant::now();
            while shared.entry.load(Ordering::Acquire) < others
                && LOOPS.load(Ordering::Acquire) == 1
                && since.elapsed() < ENTRY_WAIT
            {
                std::hint::spin_loop();
            }
        }
        shared.entry.fetch_or(CLOSED, Ordering::AcqRel);
        Helpers { shared }
    }
}

impl Drop for Helpers {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        LOOPS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Counts a helper in, unless its loop has stopped waiting for helpers.
fn enter(entry: &AtomicUsize) -> bool {
    entry.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n & CLOSED == 0).then_some(n + 1)).is_ok()
}

/// Runs the pool's jobs as they come, spinning between them, until `stop` or until another loop
/// shares the pool.
fn look_for_work(stop: &AtomicBool) {
    /// Fruitless looks between reads of the clock.
    const LOOKS_PER_CLOCK: u32 = 64;
    let mut idle_since: Option<Instant> = None;
    let mut looks = 0u32;
    while !stop.load(Ordering::Acquire) && LOOPS.load(Ordering::Acquire) == 1 {
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            idle_since = None;
            looks = 0;
            continue;
        }
        looks = looks.wrapping_add(1);
        if !looks.is_multiple_of(LOOKS_PER_CLOCK) {
            std::hint::spin_loop();
            continue;
        }
        match idle_since.get_or_insert_with(Instant::now).elapsed() {
            idle if idle > LONG_NAP_AFTER => std::thread::sleep(LONG_NAP),
            idle if idle > NAP_AFTER => std::thread::sleep(NAP),
            // Lets another thread that wants this core run (candle's own pool, where it has one).
            _ => std::thread::yield_now(),
        }
    }
}
