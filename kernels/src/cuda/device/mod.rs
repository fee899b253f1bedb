//! The kernels on a device: each family compiled once per device for its architecture and cached
//! ([`CudaKernels::for_context`]), device-resident buffers ([`DeviceTable`], [`DeviceScaler`]) and typed
//! launches ([`CudaKernels::unscale`], [`CudaKernels::adam`], ...). Feature `cuda`.

mod buffers;
mod launch;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaContext, CudaFunction};

pub use buffers::{DeviceScaler, DeviceTable, GradFactor, LambBuffers, NormBuffers};
pub use launch::OptimizerStep;

use super::{compile, Arch, CompileError, TableError, FAMILIES};

/// A CUDA operation of amp failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// No usable driver (libcuda missing, or no device).
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    /// A kernel family did not compile.
    #[error(transparent)]
    Compile(#[from] CompileError),
    /// The driver reported an error (launch, copy, module load).
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// A launch table could not be built.
    #[error(transparent)]
    Table(#[from] TableError),
    /// A launch was given inconsistent buffers.
    #[error("{0}")]
    Mismatch(String),
}

/// Whether a CUDA driver and at least one device can be used: false instead of a panic when libcuda is
/// missing (cudarc's dynamic loading panics on first use without this check).
#[must_use]
pub fn device_available() -> bool {
    #[cfg(feature = "cuda-dynamic-loading")]
    {
        // SAFETY: only tries to dlopen the library.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return false;
        }
    }
    CudaContext::device_count().is_ok_and(|n| n > 0)
}

/// Every kernel of every family, loaded on one device.
#[derive(Debug)]
pub struct CudaKernels {
    context: Arc<CudaContext>,
    arch: Arch,
    functions: HashMap<&'static str, CudaFunction>,
}

/// Kernels already compiled, by device ordinal: NVRTC runs once per device and process.
static LOADED: Mutex<Vec<(usize, Arc<CudaKernels>)>> = Mutex::new(Vec::new());

impl CudaKernels {
    /// The kernels for `context`'s device, compiled on first use (about a second per family) and cached.
    ///
    /// # Errors
    /// A device older than sm_80, NVRTC missing or failing (with its log), or a module that does not load.
    pub fn for_context(context: &Arc<CudaContext>) -> Result<Arc<Self>, CudaError> {
        let ordinal = context.ordinal();
        let mut loaded = LOADED.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, kernels)) = loaded.iter().find(|(o, _)| *o == ordinal) {
            return Ok(kernels.clone());
        }
        let (major, minor) = context.compute_capability()?;
        let arch = Arch::for_compute_capability(major, minor)?;
        let mut functions = HashMap::new();
        for family in &FAMILIES {
            let module = context.load_module(compile(family, arch)?)?;
            for &name in family.kernels {
                functions.insert(name, module.load_function(name)?);
            }
        }
        let kernels = Arc::new(CudaKernels { context: context.clone(), arch, functions });
        loaded.push((ordinal, kernels.clone()));
        Ok(kernels)
    }

    /// The device's context.
    #[must_use]
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }

    /// The architecture the kernels were compiled for.
    #[must_use]
    pub fn arch(&self) -> Arch {
        self.arch
    }

    fn function(&self, name: &str) -> Result<&CudaFunction, CudaError> {
        self.functions.get(name).ok_or_else(|| CudaError::Mismatch(format!("no kernel named {name}")))
    }
}
