//! [`Mpi`] in a build without the `mpi` feature: the same type and entry point, which says how to get
//! the real one. No value of it can exist, so its collectives are never reached.

use std::convert::Infallible;

use super::communicator::{Communicator, TrafficReport};
use super::wire::Wire;
use crate::error::{Error, Result};

/// MPI's world. This build has no MPI: [`Mpi::init`] returns [`Error::MpiNotBuilt`].
#[derive(Debug)]
pub struct Mpi {
    never: Infallible,
}

impl Mpi {
    /// Always [`Error::MpiNotBuilt`] in this build.
    pub fn init() -> Result<Self> {
        Err(Error::MpiNotBuilt)
    }

    /// Ends every process of the job with `code`. Unreachable in this build: no `Mpi` exists.
    pub fn abort(&self, code: i32) -> ! {
        let _ = code;
        match self.never {}
    }
}

impl Communicator for Mpi {
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
