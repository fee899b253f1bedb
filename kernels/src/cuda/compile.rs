//! Compiling a family with NVRTC: the options that make results match the CPU, and errors that carry
//! NVRTC's log.

use cudarc::nvrtc::{CompileOptions, Ptx};

use super::Family;

/// A GPU architecture to compile for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Ampere (A100): the oldest with bf16 conversions (`cvt.rn.bf16.f32`).
    Sm80,
    /// Hopper (H100, H200).
    Sm90,
}

impl Arch {
    /// Every architecture CI compiles for.
    pub const ALL: [Arch; 2] = [Arch::Sm80, Arch::Sm90];

    /// NVRTC's name for it.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Arch::Sm80 => "sm_80",
            Arch::Sm90 => "sm_90",
        }
    }

    /// The newest architecture not above compute capability `major.minor` (PTX runs on later GPUs).
    ///
    /// # Errors
    /// Below 8.0: the kernels use bf16 conversions Ampere introduced.
    pub fn for_compute_capability(major: i32, minor: i32) -> Result<Self, CompileError> {
        match (major, minor) {
            (9.., _) => Ok(Arch::Sm90),
            (8, _) => Ok(Arch::Sm80),
            _ => Err(CompileError::Unsupported { major, minor }),
        }
    }
}

/// A family could not be compiled.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CompileError {
    /// NVRTC is not installed where the loader looks.
    #[error(
        "libnvrtc not found: install the CUDA toolkit or the `nvidia-cuda-nvrtc` wheel and put its lib \
         folder on LD_LIBRARY_PATH (scripts/cuda-toolchain.sh nvrtc does both)"
    )]
    NvrtcMissing,
    /// NVRTC rejected the source.
    #[error("NVRTC could not compile {family}.cu for {arch}: {message}\n{log}")]
    Nvrtc {
        /// The family.
        family: &'static str,
        /// The architecture.
        arch: &'static str,
        /// NVRTC's status.
        message: String,
        /// NVRTC's log: the compiler's errors with line numbers in [`Family::source`].
        log: String,
    },
    /// A GPU older than the kernels need.
    #[error("compute capability {major}.{minor} is below 8.0: amp's CUDA kernels need Ampere or newer")]
    Unsupported {
        /// Major version.
        major: i32,
        /// Minor version.
        minor: i32,
    },
}

/// Whether libnvrtc can be loaded. Always true when the CUDA libraries are linked rather than loaded.
#[must_use]
pub fn nvrtc_available() -> bool {
    #[cfg(feature = "cuda-dynamic-loading")]
    {
        // SAFETY: only tries to dlopen the library; no symbol is called.
        unsafe { cudarc::nvrtc::sys::is_culib_present() }
    }
    #[cfg(not(feature = "cuda-dynamic-loading"))]
    {
        true
    }
}

/// Compiles `family` to PTX for `arch`. No FMA contraction, IEEE division and square root, no
/// flush-to-zero: the arithmetic the CPU reference does.
///
/// # Errors
/// [`CompileError::NvrtcMissing`] when libnvrtc cannot be loaded, [`CompileError::Nvrtc`] with the log
/// when the source does not compile.
pub fn compile(family: &Family, arch: Arch) -> Result<Ptx, CompileError> {
    if !nvrtc_available() {
        return Err(CompileError::NvrtcMissing);
    }
    let options = CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(false),
        arch: Some(arch.name()),
        name: Some(format!("{}.cu", family.name)),
        options: vec!["--std=c++17".into()],
        ..CompileOptions::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(family.source(), options).map_err(|e| {
        let (message, log) = match e {
            cudarc::nvrtc::CompileError::CompileError { nvrtc, log, .. } => {
                (nvrtc.to_string(), log.to_string_lossy().into_owned())
            }
            other => (other.to_string(), String::new()),
        };
        CompileError::Nvrtc { family: family.name, arch: arch.name(), message, log }
    })
}
