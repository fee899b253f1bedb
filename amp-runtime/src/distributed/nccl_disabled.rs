//! [`Nccl`] in a build without the `nccl` feature: the same type and entry points, which say how to get
//! the real one. No value of it can exist, so its collectives are never reached.

use std::convert::Infallible;

use candle_core::Device;

use super::communicator::{Communicator, TrafficReport};
use super::wire::Wire;
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

impl Communicator for Nccl {
    fn rank(&self) -> usize {
        match self.never {}
    }

    fn world_size(&self) -> usize {
        match self.never {}
    }

    fn traffic(&self) -> TrafficReport {
        match self.never {}
    }

    fn all_reduce_sum(&self, _: &mut [f32], _: Wire) -> Result<()> {
        match self.never {}
    }

    fn all_reduce_max_u32(&self, _: u32) -> Result<u32> {
        match self.never {}
    }

    fn reduce_scatter_sum(&self, _: &[f32], _: &mut [f32], _: Wire) -> Result<()> {
        match self.never {}
    }

    fn all_gather(&self, _: &[f32], _: &mut [f32]) -> Result<()> {
        match self.never {}
    }

    fn broadcast(&self, _: &mut [f32], _: usize) -> Result<()> {
        match self.never {}
    }

    fn broadcast_bytes(&self, _: &mut [u8], _: usize) -> Result<()> {
        match self.never {}
    }

    fn barrier(&self) -> Result<()> {
        match self.never {}
    }
}
