//! [`Mpi`] in a build without the `mpi` feature: the same type and entry point, which says how to get
//! the real one. No value of it can exist, so its collectives are never reached.

use std::convert::Infallible;

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

super::uninhabited::uninhabited_communicator!(Mpi);
