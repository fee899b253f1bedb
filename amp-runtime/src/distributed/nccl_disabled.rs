//! [`Nccl`] in a build without the `nccl` feature: the same type and entry points, which say how to get
//! the real one. No value of it can exist, so its collectives are never reached.

use std::convert::Infallible;

use candle_core::Device;

use super::communicator::Communicator;
use crate::error::{Error, Result};

/// A group of GPUs, one per rank, over NVIDIA's NCCL. This build has no NCCL: its constructors return
/// [`Error::NcclNotBuilt`].
#[derive(Debug)]
pub struct Nccl {
    never: Infallible,
}

impl Nccl {
    /// Always [`Error::NcclNotBuilt`] in this build.
    pub fn new(bootstrap: &dyn Communicator, device: &Device) -> Result<Self> {
        let _ = (bootstrap, device);
        Err(Error::NcclNotBuilt)
    }

    /// Always [`Error::NcclNotBuilt`] in this build.
    pub fn single(device: &Device) -> Result<Self> {
        let _ = device;
        Err(Error::NcclNotBuilt)
    }
}

super::uninhabited::uninhabited_communicator!(Nccl);
