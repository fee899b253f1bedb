//! The pool's other threads kept looking for work while a training loop runs on [`super::run_on_rayon_pool`].
//!
//! A rayon thread that finds no work yields a few dozen times and then sleeps; the next parallel op
//! wakes it through the kernel (a futex) and it joins the op tens of microseconds late. Between
//! parallel ops a training step runs candle's ops on one thread only, long enough for the others to
//! fall asleep, so every GEMM, optimizer step and fused kernel paid that wake-up: on 2 cores of a Xeon
//! (AMX), the main job's bf16 step spent about 6% of its samples in the scheduler and its products ran
//! 50-100 us later each than with the second thread awake. While a loop runs, each other thread of the
//! pool runs [`look_for_work`] instead: it takes any job the pool has (`rayon::yield_now`) and spins
//! between them, so it joins the next op at once. After [`NAP_AFTER`] without work (a loop that
//! evaluates, writes files or waits) it naps [`NAP`] at a time, so an idle loop does not hold a core.
//!
//! Only while one loop runs: a helper takes any job of the pool, and one taken inside the job of
//! another caller (in a join's wait) would hold that job until its own loop ended. When a second loop
//! starts on the pool, every helper returns, and none starts again until the pool is down to one loop
//! once more, at the next call.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Idle time after which a helper naps between looks for work.
pub(super) const NAP_AFTER: Duration = Duration::from_millis(2);
/// One nap.
pub(super) const NAP: Duration = Duration::from_micros(100);

/// Loops running on the pool now.
static LOOPS: AtomicUsize = AtomicUsize::new(0);
/// Helpers inside [`look_for_work`] now (read by the tests).
pub(super) static HELPING: AtomicUsize = AtomicUsize::new(0);

/// While alive, the pool's other threads look for work (when this is the pool's only loop). Dropping it
/// (the loop returned or panicked) sends them back to rayon's own idling.
pub(super) struct Helpers {
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl Helpers {
    /// Starts a helper on every thread of `pool` but the calling one, which must be a thread of
    /// `pool` about to run the loop.
    pub(super) fn start(pool: &rayon::ThreadPool) -> Helpers {
        LOOPS.fetch_add(1, Ordering::AcqRel);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let caller = rayon::current_thread_index();
        if pool.current_num_threads() > 1 {
            let stop = stop.clone();
            pool.spawn_broadcast(move |ctx| {
                // The caller's own copy runs whenever the loop first waits in a join: it returns.
                if Some(ctx.index()) != caller {
                    look_for_work(&stop);
                }
            });
        }
        Helpers { stop }
    }
}

impl Drop for Helpers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        LOOPS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Runs the pool's jobs as they come, spinning between them, until `stop` or until another loop
/// shares the pool.
fn look_for_work(stop: &std::sync::atomic::AtomicBool) {
    /// Fruitless looks between reads of the clock.
    const LOOKS_PER_CLOCK: u32 = 64;
    HELPING.fetch_add(1, Ordering::AcqRel);
    let mut idle_since: Option<Instant> = None;
    let mut looks = 0u32;
    while !stop.load(Ordering::Acquire) && LOOPS.load(Ordering::Acquire) == 1 {
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            idle_since = None;
            looks = 0;
            continue;
        }
        looks += 1;
        if !looks.is_multiple_of(LOOKS_PER_CLOCK) {
            std::hint::spin_loop();
        } else if idle_since.get_or_insert_with(Instant::now).elapsed() > NAP_AFTER {
            std::thread::sleep(NAP);
        } else {
            // Lets another thread that wants this core run (candle's own pool, where it has one).
            std::thread::yield_now();
        }
    }
    HELPING.fetch_sub(1, Ordering::AcqRel);
}
