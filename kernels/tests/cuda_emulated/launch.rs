//! A launch: a grid of blocks run one at a time, each on the same pool of OS threads, one per thread of
//! a block, and the pointers the threads share.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

/// Stack of an emulated thread: the kernels need little.
const STACK: usize = 64 * 1024;

/// The emulation header's entry points in one family's library.
#[derive(Clone, Copy)]
pub struct Hooks {
    /// `amp_emu_begin_block`: a fresh block barrier for this many threads.
    pub begin_block: unsafe extern "C" fn(u32),
    /// `amp_emu_set_thread`: the calling thread's block, thread, block size and grid size.
    pub set_thread: unsafe extern "C" fn(u32, u32, u32, u32),
    /// `amp_emu_thread_exit`: the calling thread leaves the block barrier.
    pub thread_exit: unsafe extern "C" fn(),
}

/// Runs a grid of `blocks` blocks of `threads` threads, one block at a time; every thread runs `body`
/// (the kernel call, which must not panic) with its indices set.
///
/// One pool of `threads` OS threads serves every block of the launch, taking turns with the host
/// ([`Turns`]): the host begins a block (a fresh block barrier) while no pool thread is in the library,
/// and begins the next only once every pool thread has left the block's barrier. Within a block the
/// threads meet only at the block barrier, as with fresh threads for every block.
///
/// # Safety
/// `hooks` are the entry points of one library with the emulation header's signatures, and no other
/// launch of that library runs meanwhile (its block barrier and `__shared__` arrays are globals).
pub unsafe fn run_grid(hooks: Hooks, blocks: usize, threads: u32, body: &(dyn Fn() + Sync)) {
    let grid = u32::try_from(blocks).expect("grid size");
    if grid == 0 {
        return;
    }
    let turns = Turns::default();
    std::thread::scope(|scope| {
        for thread in 0..threads {
            let turns = &turns;
            let spawned = std::thread::Builder::new().stack_size(STACK).spawn_scoped(scope, move || {
                for block in 0..grid {
                    if !turns.wait_for_block(block) {
                        return;
                    }
                    // SAFETY: sets this thread's own thread-locals.
                    unsafe { (hooks.set_thread)(block, thread, threads, grid) };
                    body();
                    // SAFETY: one of the `threads` threads the block's barrier counts, done.
                    unsafe { (hooks.thread_exit)() };
                    turns.finish_block(threads);
                }
            });
            if let Err(e) = spawned {
                // The threads spawned so far leave; the scope joins them, then panics.
                turns.cancel();
                panic!("spawning an emulated thread: {e}");
            }
        }
        for _ in 0..grid {
            // SAFETY: no pool thread is in the library: each waits for this block to begin, or has
            // finished the previous one (`run_block` returned). The caller's promise for other launches.
            unsafe { (hooks.begin_block)(threads) };
            turns.run_block(threads);
        }
    });
}

/// How the host and a launch's pool take turns, block after block.
#[derive(Default)]
struct Turns {
    progress: Mutex<Progress>,
    /// The host began a block.
    begun: Condvar,
    /// Every pool thread finished the current block.
    finished: Condvar,
}

#[derive(Default)]
struct Progress {
    /// Blocks the host has begun.
    blocks_begun: u32,
    /// Pool threads done with the current block.
    threads_finished: u32,
    /// The pool could not be spawned: its threads leave.
    cancelled: bool,
}

impl Turns {
    fn lock(&self) -> MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// In a pool thread: waits until the host has begun block `block` (true) or cancelled the launch.
    fn wait_for_block(&self, block: u32) -> bool {
        let progress = self.lock();
        let progress = self
            .begun
            .wait_while(progress, |p| p.blocks_begun <= block && !p.cancelled)
            .unwrap_or_else(PoisonError::into_inner);
        !progress.cancelled
    }

    /// In a pool thread: done with the current block (out of the library until the next begins).
    fn finish_block(&self, threads: u32) {
        let mut progress = self.lock();
        progress.threads_finished += 1;
        if progress.threads_finished == threads {
            self.finished.notify_one();
        }
    }

    /// In the host, before any block has begun: no block will.
    fn cancel(&self) {
        self.lock().cancelled = true;
        self.begun.notify_all();
    }

    /// In the host, after beginning a block: lets the pool run it, and waits until every one of the
    /// `threads` pool threads has finished it.
    fn run_block(&self, threads: u32) {
        let mut progress = self.lock();
        progress.blocks_begun += 1;
        progress.threads_finished = 0;
        self.begun.notify_all();
        let _finished = self
            .finished
            .wait_while(progress, |p| p.threads_finished < threads)
            .unwrap_or_else(PoisonError::into_inner);
    }
}

/// A pointer the threads of one launch share, as a grid shares device memory.
pub struct Shared<T>(*mut T);

impl<T> Clone for Shared<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Shared<T> {}

// SAFETY: hands buffers to the threads of one launch, which the launch joins before the buffers are used
// again; how the threads share them is the kernel's business, and what these tests check.
unsafe impl<T> Send for Shared<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Shared<T> {}

impl<T> Shared<T> {
    pub fn new(p: *const T) -> Self {
        Shared(p.cast_mut())
    }

    pub fn null() -> Self {
        Shared(std::ptr::null_mut())
    }

    pub fn get(self) -> *mut T {
        self.0
    }
}
