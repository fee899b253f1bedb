//! The emulator: every kernel family compiled as C++20 by g++ (with the emulation header standing in for
//! the CUDA built-ins) and loaded as a shared library; its kernels looked up and launched ([`run_grid`]).

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock, PoisonError};

use amp_kernels::cuda::FAMILIES;
use libloading::Library;

use crate::launch::{run_grid, Hooks};

const HEADER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/emulation/cuda_emulation.h");

/// Every family, compiled and loaded.
pub struct Emulator {
    modules: Vec<Module>,
}

impl Emulator {
    pub fn module(&self, name: &str) -> &Module {
        self.modules.iter().find(|m| m.name == name).unwrap_or_else(|| panic!("no family {name}"))
    }
}

/// Every family compiled (once per process, in parallel), or `None` without g++.
pub fn emulator() -> Option<&'static Emulator> {
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

/// One family, compiled and loaded.
pub struct Module {
    name: &'static str,
    library: Library,
    hooks: Hooks,
    /// A library's globals (the block barrier, `__shared__` arrays) serve one launch at a time.
    running: Mutex<()>,
}

impl Module {
    fn load(name: &'static str, path: &Path) -> Module {
        // SAFETY: a library just built from our sources: its initialisers only set up its globals.
        let library = unsafe { Library::new(path) }.unwrap_or_else(|e| panic!("loading {name}: {e}"));
        // SAFETY: the signatures of the emulation header's exports.
        let hooks = unsafe {
            Hooks {
                begin_block: symbol(&library, name, "amp_emu_begin_block"),
                set_thread: symbol(&library, name, "amp_emu_set_thread"),
                thread_exit: symbol(&library, name, "amp_emu_thread_exit"),
            }
        };
        Module { name, library, hooks, running: Mutex::new(()) }
    }

    /// The kernel (or export) `name`.
    ///
    /// # Safety
    /// As [`symbol`].
    pub unsafe fn kernel<F: Copy>(&self, name: &str) -> F {
        // SAFETY: the caller's promise.
        unsafe { symbol(&self.library, self.name, name) }
    }

    /// Runs a grid of `blocks` blocks of `threads` threads, one block at a time, on one pool of threads;
    /// every thread runs `body` (the kernel call, which must not panic) with its indices set.
    pub fn launch(&self, blocks: usize, threads: u32, body: &(dyn Fn() + Sync)) {
        let _one_at_a_time = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: the hooks were loaded with the header's signatures; the lock keeps other launches of
        // this library out.
        unsafe { run_grid(self.hooks, blocks, threads, body) };
    }
}
