//! The `Communicator` implementation of a type with no values: what a build without an engine's
//! feature (MPI, NCCL) provides, so that code written against the engine compiles everywhere.

/// Implements [`Communicator`](super::Communicator) for `$ty`, a struct with a field `never:
/// std::convert::Infallible`: no value exists, so no method can be reached.
macro_rules! uninhabited_communicator {
    ($ty:ty) => {
        impl $crate::distributed::Communicator for $ty {
            fn rank(&self) -> usize {
                match self.never {}
            }

            fn world_size(&self) -> usize {
                match self.never {}
            }

            fn traffic(&self) -> $crate::distributed::TrafficReport {
                match self.never {}
            }

            fn all_reduce_sum(&self, _: &mut [f32], _: $crate::distributed::Wire) -> $crate::Result<()> {
                match self.never {}
            }

            fn all_reduce_max_u32(&self, _: u32) -> $crate::Result<u32> {
                match self.never {}
            }

            fn reduce_scatter_sum(
                &self,
                _: &[f32],
                _: &mut [f32],
                _: $crate::distributed::Wire,
            ) -> $crate::Result<()> {
                match self.never {}
            }

            fn all_gather(&self, _: &[f32], _: &mut [f32]) -> $crate::Result<()> {
                match self.never {}
            }

            fn broadcast(&self, _: &mut [f32], _: usize) -> $crate::Result<()> {
                match self.never {}
            }

            fn broadcast_bytes(&self, _: &mut [u8], _: usize) -> $crate::Result<()> {
                match self.never {}
            }

            fn barrier(&self) -> $crate::Result<()> {
                match self.never {}
            }
        }
    };
}

pub(super) use uninhabited_communicator;
