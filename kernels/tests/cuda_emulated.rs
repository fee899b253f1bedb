//! The CUDA kernels' logic, checked on the CPU. Every family's source (`Family::source()`: exactly what
//! NVRTC compiles) is compiled as C++20 by g++ with `tests/emulation/cuda_emulation.h` standing in for
//! the CUDA built-ins, and loaded as a shared library. A launch runs its blocks one at a time, each with
//! its threads as real OS threads (`__syncthreads` is a real barrier, `atomicMin` a real atomic). Tables
//! are built by the real [`LaunchTable`] from host addresses, so Rust and CUDA must agree on the layout.
//! Results are compared with `amp_kernels::reference`, bit for bit where the kernels promise it.
//!
//! Needs g++ with C++20, no GPU and no cargo feature. Without g++ every test says so and passes, unless
//! `AMP_REQUIRE_EMULATION=1` makes its absence a failure.
//!
//! What this cannot check: the PTX half conversions themselves (the emulation's are software ones,
//! checked here against `half`), CUDA's `pow` (here it is glibc's, as in the reference, so Adam and LAMB
//! bias corrections agree trivially; on a GPU they may differ by an ulp), and the scheduling of blocks
//! (one at a time here; what must not depend on it, `atomicMin` on the flag, runs with real threads).

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock, PoisonError};

use amp_kernels::clip::clip_coefficient;
use amp_kernels::cuda::{
    LaunchTable, ScaleChange, ScaleState, TensorKind, BLOCK_THREADS, FAMILIES, NO_BAD_TENSOR, STATE_WORDS,
};
use amp_kernels::optim::{AdamParams, AdamTensor, LambParams, LambTensor, SgdParams, SgdTensor, TensorNorms};
use amp_kernels::{reference, Dtype};
use common::{assert_same, assert_same_owned, assert_same_state, views, views_mut, Owned, Rng, State};
use half::{bf16, f16};
use libloading::Library;

const HEADER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/emulation/cuda_emulation.h");

/// Elements per block in the tests' tables: small, so tensors span several blocks.
const CHUNK: usize = 1000;

/// Stack of an emulated thread: the kernels need little.
const STACK: usize = 64 * 1024;

/// Threads of the one-thread kernels' launches (only thread 0 of block 0 may act).
const FEW_THREADS: u32 = 8;

/// The test tensors, in one table of 7 blocks of at most [`CHUNK`] elements: lengths giving two blocks
/// (the second a single element), exactly one block, none, short ones; every gradient type, both
/// working-copy types after f32 and f16 gradients, and no working copy. (Each block costs BLOCK_THREADS
/// thread spawns: the sizes are kept small.)
const SPECS: [(usize, Dtype, Option<Dtype>); 7] = [
    (800, Dtype::F32, Some(Dtype::Bf16)),
    (1000, Dtype::Bf16, Some(Dtype::Bf16)),
    (1001, Dtype::F16, Some(Dtype::F16)),
    (0, Dtype::F16, Some(Dtype::Bf16)),
    (7, Dtype::F16, Some(Dtype::Bf16)),
    (300, Dtype::Bf16, None),
    (64, Dtype::F32, Some(Dtype::F16)),
];

// ---- The emulator ----

type BeginBlock = unsafe extern "C" fn(u32);
type SetThread = unsafe extern "C" fn(u32, u32, u32, u32);
type ThreadExit = unsafe extern "C" fn();

/// One family, compiled and loaded.
struct Module {
    name: &'static str,
    library: Library,
    begin_block: BeginBlock,
    set_thread: SetThread,
    thread_exit: ThreadExit,
    /// A library's globals (the block barrier, `__shared__` arrays) serve one launch at a time.
    running: Mutex<()>,
}

/// The C function `symbol` of `library`.
///
/// # Safety
/// `F` is a function pointer type with the symbol's C signature.
unsafe fn symbol<F: Copy>(library: &Library, name: &str, symbol: &str) -> F {
    // SAFETY: the caller's promise on `F`; the pointer is used only while the library stays loaded (it
    // lives in a static until the process ends).
    match unsafe { library.get::<F>(symbol) } {
        Ok(f) => *f,
        Err(e) => panic!("{name}: no symbol {symbol}: {e}"),
    }
}

impl Module {
    fn load(name: &'static str, path: &Path) -> Module {
        // SAFETY: a library just built from our sources: its initialisers only set up its globals.
        let library = unsafe { Library::new(path) }.unwrap_or_else(|e| panic!("loading {name}: {e}"));
        // SAFETY: the signatures of the emulation header's exports.
        let (begin_block, set_thread, thread_exit) = unsafe {
            (
                symbol::<BeginBlock>(&library, name, "amp_emu_begin_block"),
                symbol::<SetThread>(&library, name, "amp_emu_set_thread"),
                symbol::<ThreadExit>(&library, name, "amp_emu_thread_exit"),
            )
        };
        Module { name, library, begin_block, set_thread, thread_exit, running: Mutex::new(()) }
    }

    /// The kernel (or export) `name`.
    ///
    /// # Safety
    /// As [`symbol`].
    unsafe fn kernel<F: Copy>(&self, name: &str) -> F {
        // SAFETY: the caller's promise.
        unsafe { symbol(&self.library, self.name, name) }
    }

    /// Runs a grid of `blocks` blocks of `threads` threads, one block at a time; every thread runs `body`
    /// (the kernel call) with its indices set.
    fn launch(&self, blocks: usize, threads: u32, body: &(dyn Fn() + Sync)) {
        let _one_at_a_time = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        let grid = u32::try_from(blocks).expect("grid size");
        for block in 0..grid {
            // SAFETY: no thread of this library runs: launches hold the lock, and join each block.
            unsafe { (self.begin_block)(threads) };
            std::thread::scope(|scope| {
                for thread in 0..threads {
                    std::thread::Builder::new()
                        .stack_size(STACK)
                        .spawn_scoped(scope, move || {
                            // SAFETY: sets this thread's own thread-locals.
                            unsafe { (self.set_thread)(block, thread, threads, grid) };
                            body();
                            // SAFETY: one of the `threads` threads the block's barrier counts, done.
                            unsafe { (self.thread_exit)() };
                        })
                        .expect("spawning an emulated thread");
                }
            });
        }
    }
}

struct Emulator {
    modules: Vec<Module>,
}

impl Emulator {
    fn module(&self, name: &str) -> &Module {
        self.modules.iter().find(|m| m.name == name).unwrap_or_else(|| panic!("no family {name}"))
    }
}

/// Every family compiled (once per process, in parallel), or `None` without g++.
fn emulator() -> Option<&'static Emulator> {
    static EMULATOR: OnceLock<Option<Emulator>> = OnceLock::new();
    EMULATOR.get_or_init(build).as_ref()
}

fn build() -> Option<Emulator> {
    let required = std::env::var("AMP_REQUIRE_EMULATION").is_ok_and(|v| v == "1");
    let gxx = Command::new("g++").arg("--version").output();
    if !gxx.is_ok_and(|out| out.status.success()) {
        assert!(!required, "AMP_REQUIRE_EMULATION=1 but g++ cannot be run");
        eprintln!("skipped: g++ not found (the CUDA emulation compiles the kernels as C++20 with g++)");
        return None;
    }
    let dir = std::env::temp_dir().join(format!("amp-cuda-emulated-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("creating the build directory");
    let jobs: Vec<_> = FAMILIES
        .iter()
        .map(|family| {
            let source = dir.join(format!("{}.cc", family.name));
            std::fs::write(&source, family.source()).expect("writing a source");
            let library = dir.join(format!("libamp_emulated_{}.so", family.name));
            let child = Command::new("g++")
                .args(["-std=c++20", "-O1", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"])
                .args(["-Wall", "-DAMP_CPU_EMULATION", "-include", HEADER])
                .arg(&source)
                .arg("-o")
                .arg(&library)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("starting g++");
            (family.name, library, child)
        })
        .collect();
    let modules = jobs
        .into_iter()
        .map(|(name, library, child)| {
            let out = child.wait_with_output().expect("running g++");
            let log = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "g++ failed on {name}.cu:\n{log}");
            if !log.trim().is_empty() {
                eprintln!("g++ warnings on {name}.cu:\n{log}");
            }
            Module::load(name, &library)
        })
        .collect();
    // The libraries stay mapped; their files are no longer needed.
    let _ = std::fs::remove_dir_all(&dir);
    Some(Emulator { modules })
}

/// A pointer the threads of one launch share, as a grid shares device memory.
struct Shared<T>(*mut T);

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
    fn new(p: *const T) -> Self {
        Shared(p.cast_mut())
    }

    fn null() -> Self {
        Shared(std::ptr::null_mut())
    }

    fn get(self) -> *mut T {
        self.0
    }
}

// ---- Tables ----

fn address(o: &mut Owned) -> u64 {
    match o {
        Owned::F32(v) => v.as_mut_ptr() as u64,
        Owned::F16(v) => v.as_mut_ptr() as u64,
        Owned::Bf16(v) => v.as_mut_ptr() as u64,
    }
}

fn dtype(o: &Owned) -> Dtype {
    o.view().dtype()
}

fn n_of(table: &LaunchTable) -> i32 {
    i32::try_from(table.tensors()).expect("tensor count")
}

fn lists_of(table: &LaunchTable) -> i32 {
    i32::try_from(table.lists()).expect("list count")
}

/// A table whose list 0 is `grads`, followed by `lists - 1` absent lists.
fn grads_table(grads: &mut [Owned], lists: usize) -> LaunchTable {
    let kinds: Vec<TensorKind> = grads.iter().map(|g| TensorKind::grad(dtype(g))).collect();
    let lens: Vec<usize> = grads.iter().map(Owned::len).collect();
    let mut words = vec![grads.iter_mut().map(address).collect::<Vec<u64>>()];
    words.resize(lists, vec![0; grads.len()]);
    let lists: Vec<&[u64]> = words.iter().map(Vec::as_slice).collect();
    LaunchTable::new(&lists, &lens, &kinds, CHUNK).expect("table")
}

/// What a list of an optimizer's table holds.
#[derive(Clone, Copy)]
enum Slot {
    Grad,
    Master,
    A,
    B,
    C,
    Working,
    Absent,
}

fn slot_address(s: &mut State, slot: Slot) -> u64 {
    match slot {
        Slot::Grad => address(&mut s.grad),
        Slot::Master => s.master.as_mut_ptr() as u64,
        Slot::A => s.a.as_mut_ptr() as u64,
        Slot::B => s.b.as_mut_ptr() as u64,
        Slot::C => s.c.as_mut().map_or(0, |c| c.as_mut_ptr() as u64),
        Slot::Working => s.working.as_mut().map_or(0, address),
        Slot::Absent => 0,
    }
}

fn states_table(states: &mut [State], slots: &[Slot]) -> LaunchTable {
    let kinds: Vec<TensorKind> = states
        .iter()
        .map(|s| TensorKind { grad: dtype(&s.grad), working: s.working.as_ref().map(dtype) })
        .collect();
    let lens: Vec<usize> = states.iter().map(|s| s.master.len()).collect();
    let words: Vec<Vec<u64>> =
        slots.iter().map(|&slot| states.iter_mut().map(|s| slot_address(s, slot)).collect()).collect();
    let lists: Vec<&[u64]> = words.iter().map(Vec::as_slice).collect();
    LaunchTable::new(&lists, &lens, &kinds, CHUNK).expect("table")
}

// ---- Launches, with the signatures of the .cu files ----

fn unscale(emu: &Emulator, grads: &mut [Owned], lists: usize, inv_scale: f32, bad: &mut i32) {
    type Kernel = unsafe extern "C" fn(*const u64, i32, i32, *const f32, *mut i32);
    let m = emu.module("unscale");
    // SAFETY: amp_unscale's signature in unscale.cu.
    let kernel: Kernel = unsafe { m.kernel("amp_unscale") };
    let table = grads_table(grads, lists);
    let (words, n, lists) = (Shared::new(table.words().as_ptr()), n_of(&table), lists_of(&table));
    let (inv, bad) = (Shared::new(&inv_scale), Shared::new(bad));
    m.launch(table.blocks(), BLOCK_THREADS, &|| {
        // SAFETY: the table holds the addresses, lengths and types of `grads`, borrowed mutably for the
        // launch; the other pointers are live borrows.
        unsafe { kernel(words.get(), n, lists, inv.get(), bad.get()) }
    });
}

fn find_non_finite(emu: &Emulator, grads: &mut [Owned], lists: usize, bad: &mut i32) {
    type Kernel = unsafe extern "C" fn(*const u64, i32, i32, *mut i32);
    let m = emu.module("unscale");
    // SAFETY: amp_find_non_finite's signature in unscale.cu.
    let kernel: Kernel = unsafe { m.kernel("amp_find_non_finite") };
    let table = grads_table(grads, lists);
    let (words, n, lists) = (Shared::new(table.words().as_ptr()), n_of(&table), lists_of(&table));
    let bad = Shared::new(bad);
    m.launch(table.blocks(), BLOCK_THREADS, &|| {
        // SAFETY: as in `unscale`.
        unsafe { kernel(words.get(), n, lists, bad.get()) }
    });
}

/// What `amp_norm_finish` writes.
struct Norms {
    per_tensor: Vec<f32>,
    norm: f32,
    factor: f32,
}

fn global_norm(
    emu: &Emulator,
    grads: &mut [Owned],
    lists: usize,
    inv_scale: f32,
    max_norm: f32,
    with_per_tensor: bool,
    bad: &mut i32,
) -> Norms {
    type SumSquares = unsafe extern "C" fn(*const u64, i32, i32, *mut f64, *mut i32);
    type Finish =
        unsafe extern "C" fn(*const u64, i32, *const f64, *const f32, f32, *mut f32, *mut f32, *mut i32);
    let m = emu.module("norm");
    // SAFETY: the signatures in norm.cu.
    let (sum_squares, finish): (SumSquares, Finish) =
        unsafe { (m.kernel("amp_sum_squares"), m.kernel("amp_norm_finish")) };
    let table = grads_table(grads, lists);
    let mut partials = vec![f64::NAN; table.blocks()];
    let mut per_tensor = vec![f32::NAN; table.tensors()];
    let mut out = [f32::NAN; 2];
    let (words, first_block) =
        (Shared::new(table.words().as_ptr()), Shared::new(table.first_block().as_ptr()));
    let (n, lists) = (n_of(&table), lists_of(&table));
    let (partials_p, bad) = (Shared::new(partials.as_mut_ptr()), Shared::new(bad));
    m.launch(table.blocks(), BLOCK_THREADS, &|| {
        // SAFETY: as in `unscale` (read only); `partials` has a slot per block.
        unsafe { sum_squares(words.get(), n, lists, partials_p.get(), bad.get()) }
    });
    // The per-tensor output may be null.
    let per = if with_per_tensor { Shared::new(per_tensor.as_mut_ptr()) } else { Shared::null() };
    let (inv, out_p) = (Shared::new(&inv_scale), Shared::new(out.as_mut_ptr()));
    m.launch(1, BLOCK_THREADS, &|| {
        // SAFETY: `first_block` has n + 1 entries, `partials` one per block, `per_tensor` n, `out` 2.
        unsafe {
            finish(
                first_block.get(),
                n,
                partials_p.get(),
                inv.get(),
                max_norm,
                per.get(),
                out_p.get(),
                bad.get(),
            )
        }
    });
    Norms { per_tensor, norm: out[0], factor: out[1] }
}

const ADAM_SLOTS: [Slot; 6] = [Slot::Grad, Slot::Master, Slot::A, Slot::B, Slot::C, Slot::Working];

fn adam(emu: &Emulator, states: &mut [State], steps: &i64, bad: &i32, factor: f32, hp: &AdamParams) {
    type Kernel = unsafe extern "C" fn(
        *const u64,
        i32,
        *const i64,
        *const i32,
        *const f32,
        f64,
        f64,
        f64,
        f64,
        f64,
        i32,
        i32,
    );
    let m = emu.module("adam");
    // SAFETY: amp_adam's signature in adam.cu.
    let kernel: Kernel = unsafe { m.kernel("amp_adam") };
    let table = states_table(states, &ADAM_SLOTS);
    let (words, n) = (Shared::new(table.words().as_ptr()), n_of(&table));
    let (steps, bad, factor) = (Shared::new(steps), Shared::new(bad), Shared::new(&factor));
    let (decoupled, bias_correction) = (i32::from(hp.decoupled_weight_decay), i32::from(hp.bias_correction));
    let hp = *hp;
    m.launch(table.blocks(), BLOCK_THREADS, &|| {
        // SAFETY: the table holds the addresses, lengths and types of `states`' buffers (f32 masters and
        // moments), borrowed mutably for the launch; the other pointers are live borrows.
        unsafe {
            kernel(
                words.get(),
                n,
                steps.get(),
                bad.get(),
                factor.get(),
                hp.lr,
                hp.beta1,
                hp.beta2,
                hp.eps,
                hp.weight_decay,
                decoupled,
                bias_correction,
            );
        }
    });
}

fn sgd(emu: &Emulator, states: &mut [State], steps: &i64, bad: &i32, factor: f32, hp: &SgdParams) {
    type Kernel =
        unsafe extern "C" fn(*const u64, i32, *const i64, *const i32, *const f32, f64, f64, f64, f64, i32);
    let m = emu.module("sgd");
    // SAFETY: amp_sgd's signature in sgd.cu.
    let kernel: Kernel = unsafe { m.kernel("amp_sgd") };
    let buffer = if hp.momentum != 0.0 { Slot::A } else { Slot::Absent };
    let table = states_table(states, &[Slot::Grad, Slot::Master, buffer, Slot::Working]);
    let (words, n) = (Shared::new(table.words().as_ptr()), n_of(&table));
    let (steps, bad, factor) = (Shared::new(steps), Shared::new(bad), Shared::new(&factor));
    let nesterov = i32::from(hp.nesterov);
    let hp = *hp;
    m.launch(table.blocks(), BLOCK_THREADS, &|| {
        // SAFETY: as in `adam`.
        unsafe {
            kernel(
                words.get(),
                n,
                steps.get(),
                bad.get(),
                factor.get(),
                hp.lr,
                hp.weight_decay,
                hp.momentum,
                hp.dampening,
                nesterov,
            );
        }
    });
}

/// LAMB's device scratch: two partial sums per block, two norms and a ratio per tensor.
struct LambScratch {
    partials: Vec<f64>,
    norms: Vec<f32>,
    ratios: Vec<f32>,
}

impl LambScratch {
    fn new(blocks: usize, tensors: usize, fill: f32) -> Self {
        LambScratch {
            partials: vec![f64::from(fill); 2 * blocks],
            norms: vec![fill; 2 * tensors],
            ratios: vec![fill; tensors],
        }
    }
}

const LAMB_SLOTS: [Slot; 5] = [Slot::Grad, Slot::Master, Slot::A, Slot::B, Slot::Working];

/// Threads per block of `amp_lamb_ratios` (one per tensor), as launch.rs.
const RATIO_THREADS: u32 = 128;

fn lamb(
    emu: &Emulator,
    states: &mut [State],
    steps: &i64,
    bad: &i32,
    factor: f32,
    hp: &LambParams,
    scratch: &mut LambScratch,
) {
    type Moments = unsafe extern "C" fn(
        *const u64,
        i32,
        *const i64,
        *const i32,
        *const f32,
        f64,
        f64,
        f64,
        f64,
        i32,
        i32,
        i32,
        *mut f64,
    );
    type Ratios =
        unsafe extern "C" fn(*const u64, i32, *const i32, *const f64, f64, f64, i32, *mut f32, *mut f32);
    type Apply = unsafe extern "C" fn(
        *const u64,
        i32,
        *const i64,
        *const i32,
        f64,
        f64,
        f64,
        f64,
        i32,
        i32,
        *const f32,
    );
    let m = emu.module("lamb");
    // SAFETY: the signatures in lamb.cu.
    let (moments, ratios, apply): (Moments, Ratios, Apply) =
        unsafe { (m.kernel("amp_lamb_moments"), m.kernel("amp_lamb_ratios"), m.kernel("amp_lamb_apply")) };
    let table = states_table(states, &LAMB_SLOTS);
    assert!(scratch.partials.len() >= 2 * table.blocks() && scratch.ratios.len() >= table.tensors());
    assert!(scratch.norms.len() >= 2 * table.tensors());
    let (words, first_block) =
        (Shared::new(table.words().as_ptr()), Shared::new(table.first_block().as_ptr()));
    let n = n_of(&table);
    let (steps, bad, factor) = (Shared::new(steps), Shared::new(bad), Shared::new(&factor));
    let partials = Shared::new(scratch.partials.as_mut_ptr());
    let (norms, ratios_p) =
        (Shared::new(scratch.norms.as_mut_ptr()), Shared::new(scratch.ratios.as_mut_ptr()));
    let decoupled = i32::from(hp.decoupled_weight_decay);
    let bias_correction = i32::from(hp.bias_correction);
    let (grad_averaging, always_adapt) = (i32::from(hp.grad_averaging), i32::from(hp.always_adapt));
    let hp = *hp;
    m.launch(table.blocks(), BLOCK_THREADS, &|| {
        // SAFETY: as in `adam`; `partials` has two slots per block.
        unsafe {
            moments(
                words.get(),
                n,
                steps.get(),
                bad.get(),
                factor.get(),
                hp.beta1,
                hp.beta2,
                hp.eps,
                hp.weight_decay,
                decoupled,
                bias_correction,
                grad_averaging,
                partials.get(),
            );
        }
    });
    m.launch(table.tensors().div_ceil(RATIO_THREADS as usize), RATIO_THREADS, &|| {
        // SAFETY: `first_block` has n + 1 entries, `norms` 2n, `ratios` n, `partials` two per block.
        unsafe {
            ratios(
                first_block.get(),
                n,
                bad.get(),
                partials.get(),
                hp.lr,
                hp.weight_decay,
                always_adapt,
                norms.get(),
                ratios_p.get(),
            );
        }
    });
    m.launch(table.blocks(), BLOCK_THREADS, &|| {
        // SAFETY: as in `adam`; `ratios` has n entries.
        unsafe {
            apply(
                words.get(),
                n,
                steps.get(),
                bad.get(),
                hp.beta1,
                hp.beta2,
                hp.eps,
                hp.weight_decay,
                decoupled,
                bias_correction,
                ratios_p.get(),
            );
        }
    });
}

fn count_step(emu: &Emulator, steps: &mut i64, bad: &i32) {
    type Kernel = unsafe extern "C" fn(*mut i64, *const i32);
    let m = emu.module("scale");
    // SAFETY: amp_count_step's signature in scale.cu.
    let kernel: Kernel = unsafe { m.kernel("amp_count_step") };
    let (steps, bad) = (Shared::new(steps), Shared::new(bad));
    m.launch(1, FEW_THREADS, &|| {
        // SAFETY: live borrows; only thread 0 writes.
        unsafe { kernel(steps.get(), bad.get()) }
    });
}

fn mark_skipped(emu: &Emulator, bad: &mut i32, reason: i32) {
    type Kernel = unsafe extern "C" fn(*mut i32, i32);
    let m = emu.module("scale");
    // SAFETY: amp_mark_skipped's signature in scale.cu.
    let kernel: Kernel = unsafe { m.kernel("amp_mark_skipped") };
    let bad = Shared::new(bad);
    m.launch(1, FEW_THREADS, &|| {
        // SAFETY: a live borrow.
        unsafe { kernel(bad.get(), reason) }
    });
}

/// The device scaler state: `amp_scale_state`, whose 64-bit counters need 8-byte alignment.
#[repr(C, align(8))]
struct DeviceState([u32; STATE_WORDS]);

/// The dynamic scale's settings (`ScaleConfig` of the cuda feature, `ScalerConfig` of amp-runtime).
#[derive(Clone, Copy, Debug)]
struct ScaleConfig {
    dynamic: bool,
    growth_factor: f32,
    backoff_factor: f32,
    growth_interval: u32,
    hysteresis: u32,
    min_scale: f32,
    max_scale: f32,
}

fn scale_update(emu: &Emulator, state: &mut DeviceState, c: &ScaleConfig) {
    type Kernel = unsafe extern "C" fn(*mut DeviceState, i32, f32, f32, u32, u32, f32, f32);
    let m = emu.module("scale");
    // SAFETY: amp_scale_update's signature in scale.cu (DeviceState is amp_scale_state's layout).
    let kernel: Kernel = unsafe { m.kernel("amp_scale_update") };
    let state = Shared::new(state);
    let c = *c;
    let dynamic = i32::from(c.dynamic);
    m.launch(1, FEW_THREADS, &|| {
        // SAFETY: a live borrow; only thread 0 writes.
        unsafe {
            kernel(
                state.get(),
                dynamic,
                c.growth_factor,
                c.backoff_factor,
                c.growth_interval,
                c.hysteresis,
                c.min_scale,
                c.max_scale,
            );
        }
    });
}

// ---- Reference runs ----

fn reference_adam(states: &mut [State], hp: &AdamParams, factor: f32) {
    let mut tensors: Vec<AdamTensor<'_>> = states
        .iter_mut()
        .map(|s| {
            let mut t = AdamTensor::new(&mut s.master, s.grad.view(), &mut s.a, &mut s.b);
            if let Some(c) = s.c.as_mut() {
                t = t.with_max_exp_avg_sq(c);
            }
            if let Some(w) = s.working.as_mut() {
                t = t.with_working(w.half_mut());
            }
            t
        })
        .collect();
    reference::adam_step(&mut tensors, hp, factor);
}

fn reference_sgd(states: &mut [State], hp: &SgdParams, factor: f32) {
    let mut tensors: Vec<SgdTensor<'_>> = states
        .iter_mut()
        .map(|s| SgdTensor {
            master: &mut s.master,
            grad: s.grad.view(),
            momentum_buffer: (hp.momentum != 0.0).then_some(&mut s.a[..]),
            working: s.working.as_mut().map(Owned::half_mut),
        })
        .collect();
    reference::sgd_step(&mut tensors, hp, factor);
}

fn reference_lamb(states: &mut [State], hp: &LambParams, factor: f32) -> Vec<TensorNorms> {
    let mut norms = vec![TensorNorms::default(); states.len()];
    let mut tensors: Vec<LambTensor<'_>> = states
        .iter_mut()
        .map(|s| LambTensor {
            master: &mut s.master,
            grad: s.grad.view(),
            exp_avg: &mut s.a,
            exp_avg_sq: &mut s.b,
            working: s.working.as_mut().map(Owned::half_mut),
        })
        .collect();
    reference::lamb_step(&mut tensors, hp, factor, &mut norms);
    norms
}

// ---- Data and comparisons ----

/// Gradients of the [`SPECS`] types, magnitudes 2^lo .. 2^(hi+1) times `scale`.
fn gradients(rng: &mut Rng, lo: i32, hi: i32, scale: f32) -> Vec<Owned> {
    SPECS
        .iter()
        .map(|&(n, grad, _)| {
            let values: Vec<f32> = rng.vec(n, lo, hi).iter().map(|x| x * scale).collect();
            Owned::new(grad, &values)
        })
        .collect()
}

/// Optimizer states of the [`SPECS`] types (masters around 1, gradients 2^-6 .. 2^7 times `scale`).
fn states(rng: &mut Rng, with_c: bool, scale: f32) -> Vec<State> {
    SPECS.iter().map(|&(n, grad, working)| State::random(rng, n, grad, working, with_c, scale)).collect()
}

/// New gradients for both copies of the states.
fn regrade(rng: &mut Rng, a: &mut [State], b: &mut [State], scale: f32) {
    for (s, t) in a.iter_mut().zip(b) {
        let values: Vec<f32> = rng.vec(s.master.len(), -6, 6).iter().map(|x| x * scale).collect();
        s.grad = Owned::new(dtype(&s.grad), &values);
        t.grad = s.grad.clone();
    }
}

/// Distance in ulps of two finite f32 (consecutive representable values are 1 apart, across zero too).
fn ulps(a: f32, b: f32) -> u64 {
    let key = |x: f32| {
        let bits = i64::from(x.to_bits() as i32);
        if bits < 0 {
            i64::from(i32::MIN) - bits
        } else {
            bits
        }
    };
    key(a).abs_diff(key(b))
}

fn bad_of(tensor: Option<usize>) -> i32 {
    tensor.map_or(NO_BAD_TENSOR, |t| i32::try_from(t).expect("tensor index"))
}

// ---- Tests ----

/// The software conversions the emulation uses instead of PTX `cvt` agree with `half` (round to
/// nearest even, exact widening); every other test relies on them.
#[test]
fn emulated_half_conversions_match_half() {
    let Some(emu) = emulator() else { return };
    let m = emu.module("unscale");
    // SAFETY: the signatures of the header's test exports.
    let (widen, to_f16, to_bf16): (
        unsafe extern "C" fn(u16) -> f32,
        unsafe extern "C" fn(f32) -> u16,
        unsafe extern "C" fn(f32) -> u16,
    ) = unsafe {
        (
            m.kernel("amp_emu_test_f16_to_f32"),
            m.kernel("amp_emu_test_f32_to_f16"),
            m.kernel("amp_emu_test_f32_to_bf16"),
        )
    };
    for h in 0..=u16::MAX {
        // SAFETY: a pure function.
        let got = unsafe { widen(h) };
        let want = f16::from_bits(h).to_f32();
        assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "f16 {h:#06x}");
    }
    let check = |x: f32| {
        // SAFETY: pure functions.
        let (h, b) = unsafe { (to_f16(x), to_bf16(x)) };
        let (want_h, want_b) = (f16::from_f32(x), bf16::from_f32(x));
        if x.is_nan() {
            assert!(f16::from_bits(h).is_nan() && h & 0x0200 != 0, "{x:?} -> f16 {h:#06x}: not a quiet NaN");
            assert!(
                bf16::from_bits(b).is_nan() && b & 0x0040 != 0,
                "{x:?} -> bf16 {b:#06x}: not a quiet NaN"
            );
        } else {
            assert_eq!(h, want_h.to_bits(), "{x:e} ({:#010x}) -> f16", x.to_bits());
            assert_eq!(b, want_b.to_bits(), "{x:e} ({:#010x}) -> bf16", x.to_bits());
        }
    };
    // Every rounding point: the midpoints between consecutive finite f16 / bf16 values (exact in f32;
    // normals, subnormals, the overflow threshold), and their f32 neighbours on both sides.
    let neighbours = |x: f32| [x, f32::from_bits(x.to_bits() - 1), f32::from_bits(x.to_bits() + 1)];
    for bits in 0..0x7c00u16 {
        let (lo, hi) = (f16::from_bits(bits).to_f32(), f16::from_bits(bits + 1).to_f32());
        let mid = if hi.is_finite() { (lo + hi) / 2.0 } else { 65520.0 };
        for x in neighbours(mid) {
            check(x);
            check(-x);
        }
    }
    for bits in 0..0x7f80u32 {
        for x in neighbours(f32::from_bits(bits << 16 | 0x8000)) {
            check(x);
            check(-x);
        }
    }
    // Random values and payloads, and the specials.
    let mut rng = Rng(7);
    for _ in 0..200_000 {
        check(f32::from_bits(rng.next_u64() as u32));
    }
    for x in [0.0, f32::MIN_POSITIVE, f32::MAX, f32::INFINITY, f32::NAN, f32::from_bits(0x7f80_0001)] {
        check(x);
        check(-x);
    }
}

fn check_unscale(emu: &Emulator, grads: &[Owned], inv_scale: f32, lists: usize, bad_before: i32, want: i32) {
    let what = format!("inv_scale {inv_scale:e}, {lists} lists, bad_tensor {bad_before} before");
    let mut expected = grads.to_vec();
    let reference = reference::unscale_and_check(&mut views_mut(&mut expected), inv_scale);
    assert_eq!(bad_of(reference).min(bad_before), want, "{what}: the scenario is not what it should be");
    let mut got = grads.to_vec();
    let mut bad = bad_before;
    unscale(emu, &mut got, lists, inv_scale, &mut bad);
    for (t, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert_same_owned(&format!("{what}: tensor {t}"), g, e);
    }
    assert_eq!(bad, want, "{what}: bad_tensor");
}

#[test]
fn unscale_matches_the_reference() {
    let Some(emu) = emulator() else { return };
    let mut rng = Rng(1);
    // Finite: 2^-30 .. 2^5 times 1024, with an inexact inverse scale; unscaling reaches f16 subnormals
    // and zeros. A 6-list table: the kernel finds the types after `lists` address lists.
    let grads = gradients(&mut rng, -30, 4, 1024.0);
    check_unscale(emu, &grads, 1.0 / 3000.0, 6, NO_BAD_TENSOR, NO_BAD_TENSOR);

    // Rounding to f16 overflows: 32752 * 2 = 65504 is the largest f16 (kept finite, tensor 2's
    // single-element second block), 32768 * 2 = 65536 rounds to infinity although finite in f32
    // (tensor 4). 1e38 * 2 stays finite in f32 and bf16.
    let mut grads = gradients(&mut rng, -30, 4, 1.0);
    grads[2].set(1000, 32752.0);
    grads[6].set(63, 1e38);
    grads[1].set(5, 1e38);
    grads[4].set(6, 32768.0);
    check_unscale(emu, &grads, 2.0, 1, NO_BAD_TENSOR, 4);

    // The smallest index wins, whatever was flagged before and in which block: an f32 overflow on
    // multiplying (tensor 0), an infinity in the last element of tensor 1 (bf16), a NaN in tensor 5,
    // with tensor 6 flagged by an earlier kernel.
    grads[0].set(799, 3e38);
    grads[1].set(999, f32::INFINITY);
    grads[5].set(200, f32::NAN);
    check_unscale(emu, &grads, 2.0, 3, 6, 0);
}

#[test]
fn find_non_finite_matches_the_reference() {
    let Some(emu) = emulator() else { return };
    let mut rng = Rng(2);
    let mut grads = gradients(&mut rng, -20, 10, 1.0);
    let mut cases = vec![(grads.clone(), None)];
    // A NaN in the last tensor and an infinity in tensor 2's single-element second block.
    grads[6].set(63, f32::NAN);
    grads[2].set(1000, f32::NEG_INFINITY);
    cases.push((grads.clone(), Some(2)));
    grads[0].set(799, f32::INFINITY);
    cases.push((grads.clone(), Some(0)));
    for (i, (case, want)) in cases.into_iter().enumerate() {
        assert_eq!(reference::find_non_finite(&views(&case)), want);
        let mut got = case.clone();
        let mut bad = NO_BAD_TENSOR;
        find_non_finite(emu, &mut got, 1 + i % 3, &mut bad);
        assert_eq!(bad, bad_of(want), "case {i}");
        for (t, (g, c)) in got.iter().zip(&case).enumerate() {
            assert_same_owned(&format!("case {i}: tensor {t} unchanged"), g, c);
        }
    }
}

#[test]
fn norms_and_clip_factor_match_the_reference() {
    let Some(emu) = emulator() else { return };
    let mut rng = Rng(3);
    let mut grads = gradients(&mut rng, -6, 6, 256.0);
    let inv_scale = 1.0 / 300.0;
    let mut per = vec![0.0; grads.len()];
    let want = reference::l2_norms(&views(&grads), inv_scale, &mut per);

    let mut bad = NO_BAD_TENSOR;
    let got = global_norm(emu, &mut grads, 3, inv_scale, 0.0, true, &mut bad);
    assert_eq!(bad, NO_BAD_TENSOR);
    let mut exact = 0;
    for (t, (&g, &w)) in got.per_tensor.iter().zip(&per).enumerate() {
        assert!(ulps(g, w) <= 1, "tensor {t}: norm {g:e} vs reference {w:e}");
        exact += usize::from(g == w);
    }
    assert!(ulps(got.norm, want) <= 1, "global norm {:e} vs reference {want:e}", got.norm);
    eprintln!("norms: {exact} of {} per-tensor norms bit-identical, global: {}", per.len(), got.norm == want);
    assert_eq!(per[3], 0.0, "the empty tensor");
    assert_eq!(got.per_tensor[3], 0.0, "the empty tensor");
    assert_eq!(got.factor.to_bits(), inv_scale.to_bits(), "no clipping: the factor is inv_scale");

    // Clipping: the factor is inv_scale times the CPU's coefficient of the kernel's own norm.
    let norm = got.norm;
    for max_norm in [norm * 0.999, norm * 4.0] {
        let clipped = global_norm(emu, &mut grads, 1, inv_scale, max_norm, false, &mut bad);
        assert_eq!(clipped.norm.to_bits(), norm.to_bits(), "deterministic");
        assert!(clipped.per_tensor.iter().all(|x| x.is_nan()), "a null per_tensor is not written");
        let want = inv_scale * clip_coefficient(norm, max_norm);
        assert_eq!(clipped.factor.to_bits(), want.to_bits(), "factor for max_norm {max_norm}");
    }
    assert_eq!(bad, NO_BAD_TENSOR);

    // A norm that overflows f32 while every element is finite marks n (stage 2), unless a smaller index
    // is already marked. A small table: three tensors, two blocks.
    let mut grads = vec![
        Owned::new(Dtype::Bf16, &rng.vec(10, -6, 6)),
        Owned::new(Dtype::F32, &rng.vec(20, -6, 6)),
        Owned::new(Dtype::F16, &[]),
    ];
    grads[1].set(10, 3e38);
    grads[1].set(19, -3e38);
    assert_eq!(reference::find_non_finite(&views(&grads)), None);
    let mut bad = NO_BAD_TENSOR;
    let got = global_norm(emu, &mut grads, 1, 1.0, 1.0, true, &mut bad);
    assert_eq!(got.norm, f32::INFINITY);
    assert_eq!(bad, 3, "an overflowing norm sets bad_tensor = n");
    let mut bad = 2;
    let _ = global_norm(emu, &mut grads, 1, 1.0, 1.0, true, &mut bad);
    assert_eq!(bad, 2, "the smallest index wins");

    // A non-finite element marks its tensor (stage 1).
    grads[0].set(9, f32::NAN);
    let mut bad = NO_BAD_TENSOR;
    let got = global_norm(emu, &mut grads, 2, 1.0, 1.0, true, &mut bad);
    assert!(got.norm.is_nan() && got.per_tensor[0].is_nan());
    assert_eq!(bad, 0);
}

#[test]
fn adam_matches_the_reference_step_by_step() {
    let Some(emu) = emulator() else { return };
    let mut rng = Rng(4);
    let base = AdamParams { lr: 1e-2, weight_decay: 0.05, ..AdamParams::default() };
    let configs = [
        AdamParams { decoupled_weight_decay: true, amsgrad: false, ..base },
        AdamParams { decoupled_weight_decay: true, amsgrad: true, ..base },
        AdamParams { decoupled_weight_decay: false, amsgrad: true, bias_correction: false, ..base },
    ];
    let scale = 1024.0;
    // An inverse scale times a clip coefficient.
    let factor = (1.0 / scale) * 0.75;
    for (c, hp) in configs.iter().enumerate() {
        let mut got = states(&mut rng, hp.amsgrad, scale);
        let mut want = got.clone();
        let mut steps = 0i64;
        let mut applied = 0u64;
        // Applied, (skipped, for the first configuration), applied: bias corrections of steps 1 and 2
        // from the device counter.
        for round in 0..3 {
            let skipped = round == 1;
            if skipped && c > 0 {
                continue;
            }
            regrade(&mut rng, &mut got, &mut want, scale);
            let bad = if skipped { 3 } else { NO_BAD_TENSOR };
            adam(emu, &mut got, &steps, &bad, factor, hp);
            count_step(emu, &mut steps, &bad);
            if !skipped {
                applied += 1;
                reference_adam(&mut want, &AdamParams { step: applied, ..*hp }, factor);
            }
            assert_same_state(&format!("config {c} ({hp:?}) round {round}"), &got, &want);
            assert_eq!(steps, applied as i64, "the device step counter");
        }
    }
}

#[test]
fn sgd_matches_the_reference_step_by_step() {
    let Some(emu) = emulator() else { return };
    let mut rng = Rng(5);
    let configs = [
        SgdParams { lr: 0.05, weight_decay: 1e-2, ..SgdParams::default() },
        SgdParams { lr: 0.05, momentum: 0.9, dampening: 0.1, weight_decay: 1e-2, ..SgdParams::default() },
        SgdParams { lr: 0.05, momentum: 0.9, nesterov: true, weight_decay: 5e-3, ..SgdParams::default() },
    ];
    let scale = 512.0;
    let factor = 1.0 / scale;
    for (c, hp) in configs.iter().enumerate() {
        let mut got = states(&mut rng, false, scale);
        let mut want = got.clone();
        let mut steps = 0i64;
        for round in 0..3 {
            // The second configuration skips its first round: its momentum buffers must still take the
            // next gradient as is. The others start applied.
            let skipped = round == 0;
            if skipped && c != 1 {
                continue;
            }
            regrade(&mut rng, &mut got, &mut want, scale);
            let bad = if skipped { 0 } else { NO_BAD_TENSOR };
            let first_step = steps == 0;
            sgd(emu, &mut got, &steps, &bad, factor, hp);
            count_step(emu, &mut steps, &bad);
            if !skipped {
                reference_sgd(&mut want, &SgdParams { first_step, ..*hp }, factor);
            }
            assert_same_state(&format!("config {c} ({hp:?}) round {round}"), &got, &want);
        }
        assert_eq!(steps, 2);
    }
}

#[test]
fn lamb_matches_the_reference() {
    let Some(emu) = emulator() else { return };
    let mut rng = Rng(6);
    let base = LambParams { lr: 1e-2, ..LambParams::default() };
    let configs = [
        base,
        LambParams { decoupled_weight_decay: false, ..base },
        LambParams {
            weight_decay: 0.0,
            always_adapt: true,
            grad_averaging: false,
            bias_correction: false,
            ..base
        },
        LambParams { weight_decay: 0.0, ..base },
    ];
    let scale = 256.0;
    let factor = 1.0 / scale;
    let (mut norms_exact, mut norms_total, mut masters_off, mut worst) = (0, 0, 0, 0);
    for (c, hp) in configs.iter().enumerate() {
        let mut got = states(&mut rng, false, scale);
        // A zero master: ||p|| = 0, so the ratio is lr alone.
        got[4].master.fill(0.0);
        let mut want = got.clone();
        // One step per configuration, at various device step counts (the bias corrections).
        let mut steps = [0i64, 1, 4, 9][c];
        let blocks = states_table(&mut got, &LAMB_SLOTS).blocks();
        let mut scratch = LambScratch::new(blocks, got.len(), f32::NAN);
        let bad = NO_BAD_TENSOR;
        lamb(emu, &mut got, &steps, &bad, factor, hp, &mut scratch);
        count_step(emu, &mut steps, &bad);
        let step = u64::try_from(steps).expect("a positive count");
        let norms = reference_lamb(&mut want, &LambParams { step, ..*hp }, factor);
        let what = format!("config {c} ({hp:?})");
        for (t, (g, w)) in got.iter().zip(&want).enumerate() {
            // Moments come before the norms: bit for bit.
            assert_same(&format!("{what} t{t} exp_avg"), &g.a, &w.a);
            assert_same(&format!("{what} t{t} exp_avg_sq"), &g.b, &w.b);
            // Norms: f64 sums in another order (lanes and a tree vs sequential), rounded to f32.
            let (param, update) = (scratch.norms[2 * t], scratch.norms[2 * t + 1]);
            let (want_param, want_update) = (norms[t].param, norms[t].update);
            assert!(ulps(param, want_param) <= 1, "{what} t{t}: ||p|| {param:e} vs {want_param:e}");
            assert!(ulps(update, want_update) <= 1, "{what} t{t}: ||u|| {update:e} vs {want_update:e}");
            norms_total += 2;
            norms_exact += usize::from(param == want_param) + usize::from(update == want_update);
            if param == want_param && update == want_update {
                // Same ratio: the update is elementwise, bit for bit.
                assert_same(&format!("{what} t{t} master"), &g.master, &w.master);
                if let (Some(x), Some(y)) = (&g.working, &w.working) {
                    assert_same_owned(&format!("{what} t{t} working"), x, y);
                }
            } else {
                // A ratio a few ulps off: the masters within MASTER_ULPS, the working copy the rounding
                // of the kernel's own master.
                for (i, (&x, &y)) in g.master.iter().zip(&w.master).enumerate() {
                    let d = ulps(x, y);
                    assert!(d <= MASTER_ULPS, "{what} t{t} master[{i}]: {x:e} vs {y:e} ({d} ulps)");
                    worst = worst.max(d);
                    masters_off += usize::from(d != 0);
                }
                if let Some(x) = &g.working {
                    assert_same_owned(&format!("{what} t{t} working"), x, &Owned::new(dtype(x), &g.master));
                }
            }
        }
    }
    eprintln!(
        "lamb: {norms_exact} of {norms_total} norms bit-identical; {masters_off} masters differ, by at most {worst} ulps"
    );
}

/// Masters may differ from the reference by this many ulps when a LAMB norm differs by one: the ratio
/// `lr * (||p|| / ||u||)` is then off by up to ~3 ulps, and `ratio * u` is far smaller than `p`.
const MASTER_ULPS: u64 = 4;

#[test]
fn skipped_steps_change_nothing() {
    let Some(emu) = emulator() else { return };
    let mut rng = Rng(8);
    let scale = 1024.0;
    // Any flag value but AMP_NO_BAD_TENSOR skips (here: tensor 3 held a non-finite value).
    let bad = 3;
    let mut steps = 5i64;

    let mut got = states(&mut rng, true, scale);
    let before = got.clone();
    adam(emu, &mut got, &steps, &bad, 1.0 / scale, &AdamParams { amsgrad: true, ..AdamParams::default() });
    assert_same_state("adam", &got, &before);

    let mut got = states(&mut rng, false, scale);
    let before = got.clone();
    let hp = SgdParams { lr: 0.1, momentum: 0.9, weight_decay: 0.1, ..SgdParams::default() };
    sgd(emu, &mut got, &steps, &bad, 1.0 / scale, &hp);
    assert_same_state("sgd", &got, &before);

    let mut got = states(&mut rng, false, scale);
    let before = got.clone();
    let blocks = states_table(&mut got, &LAMB_SLOTS).blocks();
    let mut scratch = LambScratch::new(blocks, got.len(), -7.0);
    lamb(emu, &mut got, &steps, &bad, 1.0 / scale, &LambParams::default(), &mut scratch);
    assert_same_state("lamb", &got, &before);
    assert!(scratch.partials.iter().all(|&x| x == -7.0), "lamb partials written");
    assert!(scratch.norms.iter().chain(&scratch.ratios).all(|&x| x == -7.0), "lamb norms written");

    count_step(emu, &mut steps, &bad);
    assert_eq!(steps, 5, "a skipped step is not counted");
}

#[test]
fn count_step_and_mark_skipped() {
    let Some(emu) = emulator() else { return };
    let mut steps = 41i64;
    count_step(emu, &mut steps, &NO_BAD_TENSOR);
    assert_eq!(steps, 42);
    count_step(emu, &mut steps, &0);
    assert_eq!(steps, 42);
    let mut bad = NO_BAD_TENSOR;
    mark_skipped(emu, &mut bad, 9);
    assert_eq!(bad, 9);
    mark_skipped(emu, &mut bad, 12);
    assert_eq!(bad, 9, "the smallest reason wins");
    mark_skipped(emu, &mut bad, 3);
    assert_eq!(bad, 3);
}

/// amp-runtime's `ScaleState::update` (amp-runtime/src/scaler/state.rs), copied: amp-runtime is not a
/// dependency of amp-kernels.
#[derive(Clone, Copy, Debug, PartialEq)]
struct HostScale {
    scale: f32,
    growth_tracker: u32,
    hysteresis_left: u32,
    steps: u64,
    skipped: u64,
    applied: u64,
}

impl HostScale {
    fn update(&mut self, overflow: bool, config: &ScaleConfig) -> ScaleChange {
        self.steps += 1;
        if overflow {
            self.skipped += 1;
        } else {
            self.applied += 1;
        }
        if !config.dynamic {
            return ScaleChange::Kept;
        }
        if overflow {
            self.growth_tracker = 0;
            if self.hysteresis_left > 1 {
                self.hysteresis_left -= 1;
                return ScaleChange::Tolerated;
            }
            if self.scale <= config.min_scale {
                return ScaleChange::AtFloor;
            }
            self.scale = (self.scale * config.backoff_factor).max(config.min_scale);
            return ScaleChange::BackedOff;
        }
        self.growth_tracker += 1;
        if self.growth_tracker < config.growth_interval {
            return ScaleChange::Kept;
        }
        self.growth_tracker = 0;
        let grown = self.scale * config.growth_factor;
        if !grown.is_finite() || self.scale >= config.max_scale {
            return ScaleChange::Kept;
        }
        self.scale = grown.min(config.max_scale);
        self.hysteresis_left = config.hysteresis;
        ScaleChange::Grew
    }
}

#[test]
fn scale_update_matches_the_state_machine() {
    let Some(emu) = emulator() else { return };
    let dynamic = ScaleConfig {
        dynamic: true,
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval: 3,
        hysteresis: 2,
        min_scale: 4096.0,
        max_scale: 1_048_576.0,
    };
    let fixed = ScaleConfig { dynamic: false, ..dynamic };
    let mut seen = Vec::new();
    for (seed, p_overflow, config, init, steps) in [
        (10, 0.15, dynamic, 65536.0, 60),
        (11, 0.45, dynamic, 65536.0, 60),
        (12, 0.8, dynamic, 8192.0, 40),
        // Not a power of two: the ceiling is reached by min(grown, max), then growth stops there.
        (13, 0.05, ScaleConfig { max_scale: 1e6, ..dynamic }, 300_000.0, 20),
        (14, 0.4, fixed, 65536.0, 20),
    ] {
        let mut rng = Rng(seed);
        let mut device = DeviceState(ScaleState::new(init, config.hysteresis).to_words());
        let mut host = HostScale {
            scale: init,
            growth_tracker: 0,
            hysteresis_left: config.hysteresis,
            steps: 0,
            skipped: 0,
            applied: 0,
        };
        let mut counter = 0i64;
        for step in 0..steps {
            let overflow = rng.unit() < p_overflow;
            let mut reason = None;
            if overflow {
                let mut bad = device.0[ScaleState::BAD_TENSOR_WORD] as i32;
                for _ in 0..1 + rng.next_u64() % 2 {
                    let r = (rng.next_u64() % 20) as i32;
                    mark_skipped(emu, &mut bad, r);
                    reason = Some(reason.map_or(r, |x: i32| x.min(r)));
                }
                device.0[ScaleState::BAD_TENSOR_WORD] = bad as u32;
            }
            count_step(emu, &mut counter, &(device.0[ScaleState::BAD_TENSOR_WORD] as i32));
            scale_update(emu, &mut device, &config);
            let change = host.update(overflow, &config);
            seen.push(change);

            let what = format!("seed {seed} step {step} (overflow {overflow}, {change:?})");
            let got = ScaleState::from_words(&device.0).unwrap_or_else(|| panic!("{what}: bad change code"));
            assert_eq!(got.scale.to_bits(), host.scale.to_bits(), "{what}: scale");
            assert_eq!(got.inv_scale.to_bits(), (1.0 / host.scale).to_bits(), "{what}: inv_scale");
            assert_eq!(got.growth_tracker, host.growth_tracker, "{what}: growth_tracker");
            assert_eq!(got.hysteresis_left, host.hysteresis_left, "{what}: hysteresis_left");
            assert_eq!(
                (got.steps, got.skipped, got.applied),
                (host.steps, host.skipped, host.applied),
                "{what}"
            );
            assert_eq!(got.last_change, change, "{what}: last_change");
            assert_eq!(got.bad_tensor, None, "{what}: the flag is cleared");
            assert_eq!(got.last_bad_tensor, reason.map(|r| r as u32), "{what}: last_bad_tensor");
            assert_eq!(counter, host.applied as i64, "{what}: the optimizer's step counter");
        }
    }
    for change in [
        ScaleChange::Kept,
        ScaleChange::Grew,
        ScaleChange::BackedOff,
        ScaleChange::Tolerated,
        ScaleChange::AtFloor,
    ] {
        assert!(seen.contains(&change), "the sequences never produced {change:?}");
    }
}
