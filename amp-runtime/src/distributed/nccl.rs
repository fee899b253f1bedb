//! The NCCL communicator (cudarc's `nccl` bindings): one GPU per rank, the collectives run by NVIDIA's
//! library on the GPUs' own links (NVLink, PCIe, InfiniBand), on candle's stream of each rank's device.
//!
//! NCCL has no launcher of its own: the ranks meet through a unique id that one of them creates and
//! the others receive. [`Nccl::new`] hands it out over a bootstrap [`Communicator`] (MPI under
//! `mpirun`, as candle-vllm does), so the launch is MPI's and the bytes move through NCCL.
//!
//! How NCCL sums a 16-bit wire: each combine adds two values of the wire type and rounds once to it
//! (its reduction kernels add halves with the type's own add, or through float on GPUs without one),
//! the same rule as amp's MPI reduction op ([`sum_half_words`](super::sum_half_words)); the order of
//! the combines is NCCL's (rings or trees), so sums over more than two ranks may differ by the
//! rounding of a reordered sum from one engine to the other.
//!
//! A peer that dies: NCCL's collectives wait for it. Under `mpirun` the launcher ends every rank when
//! one exits abnormally; a program that must survive alone would poll `ncclCommGetAsyncError` and
//! abort the communicator, which amp does not do yet.

use std::ffi::{c_char, CStr};
use std::mem::MaybeUninit;
use std::sync::Arc;

use amp_kernels::Dtype;
use candle_core::{Device, Tensor};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::{result, sys};

use super::communicator::{
    check_blocks, check_root, Collective, Communicator, SingleProcess, Traffic, TrafficReport,
};
use super::data_parallel::agree_lowest;
use super::device::DeviceCollectives;
use super::wire::{HalfWire, Wire};
use crate::cuda::{cuda_error, device_ref, DeviceRef};
use crate::error::{Error, Result};

/// Collectives issued between one `ncclGroupStart` and its `ncclGroupEnd` at most: NCCL fuses a
/// group's operations into few launches, and bounds how many it aggregates.
const GROUP_OPS: usize = 256;

/// A group of GPUs, one per rank, that run collectives through NCCL. It implements [`Communicator`]
/// (host slices go through a device buffer, for the agreement word, checks and tests) and
/// [`DeviceCollectives`] (CUDA tensors summed and broadcast where they are), which
/// [`all_reduce_gradients`](super::all_reduce_gradients),
/// [`broadcast_masters`](super::broadcast_masters) and [`DataParallel`](super::DataParallel) use for a
/// model on the GPU.
///
/// ```no_run
/// # fn main() -> amp_runtime::Result<()> {
/// use amp_runtime::distributed::{Mpi, Nccl};
/// let mpi = Mpi::init()?; // launched by `mpirun -np <GPUs>`
/// let device = candle_core::Device::new_cuda(amp_runtime::distributed::local_rank().unwrap_or(0))?;
/// let nccl = Nccl::new(&mpi, &device)?; // every rank: the id travels over MPI
/// # Ok(()) }
/// ```
pub struct Nccl {
    comm: sys::ncclComm_t,
    device: Device,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    traffic: Traffic,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("rank", &self.rank)
            .field("world_size", &self.world)
            .field("device", &self.device.location())
            .finish()
    }
}

impl Nccl {
    /// Joins the NCCL group of every rank of `bootstrap`, on `device` (a CUDA device; one per rank).
    /// Rank 0 creates NCCL's unique id and broadcasts it over `bootstrap`; every rank then creates its
    /// communicator (a collective call: every rank of `bootstrap` must make it).
    ///
    /// # Errors
    /// On every rank, when any rank's device is not a CUDA device or rank 0 cannot create the id
    /// ([`Error::Nccl`] naming the rank); [`Error::Nccl`] when NCCL cannot create the communicator.
    pub fn new(bootstrap: &dyn Communicator, device: &Device) -> Result<Self> {
        let (rank, world) = (bootstrap.rank(), bootstrap.world_size());
        let mut id = [0u8; 128];
        let ready = prepare(device).and_then(|stream| {
            if rank == 0 {
                let unique = result::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", &e))?;
                for (byte, c) in id.iter_mut().zip(unique.internal) {
                    *byte = c as u8;
                }
            }
            Ok(stream)
        });
        // Every rank learns whether every rank is ready before any enters NCCL's (collective) init.
        if let Some((_, failed)) = agree_lowest(bootstrap, u32::from(ready.is_err()))? {
            return Err(ready.err().unwrap_or_else(|| Error::Nccl {
                reason: format!("rank {failed} could not join the group (its error says why)"),
            }));
        }
        let stream = ready?;
        bootstrap.broadcast_bytes(&mut id, 0)?;
        let unique = sys::ncclUniqueId { internal: id.map(|b| b as c_char) };
        let (ranks, me) = (to_int("world size", world)?, to_int("rank", rank)?);
        let mut comm = MaybeUninit::uninit();
        // SAFETY: `comm` is written by NCCL on success; the context of `device` is bound to this thread.
        unsafe { result::comm_init_rank(comm.as_mut_ptr(), ranks, unique, me) }
            .map_err(|e| nccl_error("ncclCommInitRank", &e))?;
        // SAFETY: initialised by the successful call above.
        let comm = unsafe { comm.assume_init() };
        Ok(Nccl { comm, device: device.clone(), stream, rank, world, traffic: Traffic::default() })
    }

    /// A group of this process alone on `device`: every collective runs through NCCL (for tests, and
    /// code that is the same on one GPU as on many).
    ///
    /// # Errors
    /// As [`Nccl::new`].
    pub fn single(device: &Device) -> Result<Self> {
        Nccl::new(&SingleProcess::new(), device)
    }

    /// The device this rank's collectives run on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    fn cu_stream(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as sys::cudaStream_t
    }

    /// Copies `values` to the device, runs `op` on their address, and copies them back.
    fn in_place<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        values: &mut [T],
        op: impl FnOnce(*mut std::ffi::c_void) -> Result<()>,
    ) -> Result<()> {
        if values.is_empty() {
            return Ok(());
        }
        let mut buffer = self.stream.clone_htod(values).map_err(cuda_error)?;
        {
            let (address, _record) = buffer.device_ptr_mut(&self.stream);
            op(address as *mut std::ffi::c_void)?;
        }
        self.stream.memcpy_dtoh(&buffer, values).map_err(cuda_error)?;
        self.stream.synchronize().map_err(cuda_error)
    }

    /// Copies `send` to the device, runs `op` on its address and a device buffer as long as `recv`,
    /// and copies that buffer into `recv`.
    fn send_receive<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: impl FnOnce(*const std::ffi::c_void, *mut std::ffi::c_void) -> Result<()>,
    ) -> Result<()> {
        if send.is_empty() || recv.is_empty() {
            return Ok(());
        }
        let sent = self.stream.clone_htod(send).map_err(cuda_error)?;
        let mut received = self.stream.alloc_zeros::<T>(recv.len()).map_err(cuda_error)?;
        {
            let (from, _record_send) = sent.device_ptr(&self.stream);
            let (to, _record_recv) = received.device_ptr_mut(&self.stream);
            op(from as *const std::ffi::c_void, to as *mut std::ffi::c_void)?;
        }
        self.stream.memcpy_dtoh(&received, recv).map_err(cuda_error)?;
        self.stream.synchronize().map_err(cuda_error)
    }

    /// Runs `op` on each of `targets` (skipping empty ones), `GROUP_OPS` at a time in NCCL groups.
    fn grouped(
        &self,
        what: &'static str,
        targets: &[DeviceRef],
        op: impl Fn(&DeviceRef) -> std::result::Result<result::NcclStatus, result::NcclError>,
    ) -> Result<()> {
        let targets: Vec<&DeviceRef> = targets.iter().filter(|t| t.len > 0).collect();
        for chunk in targets.chunks(GROUP_OPS) {
            result::group_start().map_err(|e| nccl_error("ncclGroupStart", &e))?;
            let issued = chunk.iter().try_for_each(|t| op(t).map(drop).map_err(|e| nccl_error(what, &e)));
            // The group is closed whatever happened inside it.
            let ended = result::group_end().map_err(|e| nccl_error("ncclGroupEnd", &e));
            issued?;
            ended?;
        }
        Ok(())
    }

    /// The device view of `tensor`, which must be on this communicator's device.
    fn device_view(&self, tensor: &Tensor) -> Result<DeviceRef> {
        if !tensor.device().same_device(&self.device) {
            return Err(Error::Nccl {
                reason: format!(
                    "a tensor on {:?} handed to the NCCL communicator of {:?}: each rank's collectives move \
                     the buffers of its own GPU (move the tensor there first)",
                    tensor.device().location(),
                    self.device.location()
                ),
            });
        }
        device_ref(tensor, &self.stream)
    }

    /// Copies `src` into `dst` on the device (same dtype and length, both contiguous).
    fn copy_into(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        let (to, from) = (self.device_view(dst)?, self.device_view(src)?);
        debug_assert_eq!((to.len, to.dtype), (from.len, from.dtype));
        let bytes = to.len * dtype_size(to.dtype);
        // SAFETY: both ranges are `bytes` long inside live allocations of the same device, ordered on
        // the stream every use of them is queued on.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                to.address,
                from.address,
                bytes,
                self.stream.cu_stream(),
            )
        }
        .map_err(cuda_error)
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // SAFETY: `comm` came from ncclCommInitRank and is released once, here. A rank unwinding from
        // a panic aborts (does not wait for operations its peers may never complete).
        let released = unsafe {
            if std::thread::panicking() {
                result::comm_abort(self.comm)
            } else {
                result::comm_destroy(self.comm)
            }
        };
        if let Err(e) = released {
            tracing::warn!("rank {}: releasing the NCCL communicator: {}", self.rank, describe(&e));
        }
    }
}

impl Communicator for Nccl {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn traffic(&self) -> TrafficReport {
        self.traffic.report()
    }

    fn all_reduce_sum(&self, values: &mut [f32], wire: Wire) -> Result<()> {
        self.traffic.record(Collective::AllReduce, values.len() * wire.bytes_per_value());
        let (comm, stream) = (self.comm, self.cu_stream());
        match wire.half() {
            None => {
                let len = values.len();
                self.in_place(values, |at| {
                    // SAFETY: `at` holds `len` f32 values on this communicator's device.
                    unsafe {
                        result::all_reduce(at, at, len, sys::ncclDataType_t::ncclFloat32, SUM, comm, stream)
                    }
                    .map(drop)
                    .map_err(|e| nccl_error("ncclAllReduce", &e))
                })
            }
            Some(half) => {
                let mut words = half.encode_all(values);
                let len = words.len();
                self.in_place(&mut words, |at| {
                    // SAFETY: `at` holds `len` 16-bit values of the wire's type.
                    unsafe { result::all_reduce(at, at, len, half_type(half), SUM, comm, stream) }
                        .map(drop)
                        .map_err(|e| nccl_error("ncclAllReduce", &e))
                })?;
                half.decode_into(&words, values);
                Ok(())
            }
        }
    }

    fn all_reduce_max_u32(&self, word: u32) -> Result<u32> {
        self.traffic.record(Collective::AllReduce, 4);
        self.max_word(word)
    }

    fn reduce_scatter_sum(&self, values: &[f32], out: &mut [f32], wire: Wire) -> Result<()> {
        check_blocks("reduce_scatter_sum", values.len(), out.len(), self.world)?;
        self.traffic.record(Collective::ReduceScatter, values.len() * wire.bytes_per_value());
        let (comm, stream, block) = (self.comm, self.cu_stream(), out.len());
        match wire.half() {
            None => self.send_receive(values, out, |from, to| {
                // SAFETY: `from` holds world x `block` f32 values, `to` room for `block`.
                unsafe {
                    result::reduce_scatter(
                        from,
                        to,
                        block,
                        sys::ncclDataType_t::ncclFloat32,
                        SUM,
                        comm,
                        stream,
                    )
                }
                .map(drop)
                .map_err(|e| nccl_error("ncclReduceScatter", &e))
            }),
            Some(half) => {
                let words = half.encode_all(values);
                let mut sums = vec![0u16; block];
                self.send_receive(&words, &mut sums, |from, to| {
                    // SAFETY: as above, 16-bit values of the wire's type.
                    unsafe { result::reduce_scatter(from, to, block, half_type(half), SUM, comm, stream) }
                        .map(drop)
                        .map_err(|e| nccl_error("ncclReduceScatter", &e))
                })?;
                half.decode_into(&sums, out);
                Ok(())
            }
        }
    }

    fn all_gather(&self, mine: &[f32], out: &mut [f32]) -> Result<()> {
        check_blocks("all_gather", out.len(), mine.len(), self.world)?;
        self.traffic.record(Collective::AllGather, 4 * mine.len());
        let (comm, stream, block) = (self.comm, self.cu_stream(), mine.len());
        self.send_receive(mine, out, |from, to| {
            // SAFETY: `from` holds `block` f32 values, `to` room for world x `block`.
            unsafe { result::all_gather(from, to, block, sys::ncclDataType_t::ncclFloat32, comm, stream) }
                .map(drop)
                .map_err(|e| nccl_error("ncclAllGather", &e))
        })
    }

    fn broadcast(&self, values: &mut [f32], root: usize) -> Result<()> {
        check_root("broadcast", root, self.world)?;
        self.traffic.record(Collective::Broadcast, 4 * values.len());
        self.broadcast_raw(values, sys::ncclDataType_t::ncclFloat32, root)
    }

    fn broadcast_bytes(&self, bytes: &mut [u8], root: usize) -> Result<()> {
        check_root("broadcast_bytes", root, self.world)?;
        self.traffic.record(Collective::Broadcast, bytes.len());
        self.broadcast_raw(bytes, sys::ncclDataType_t::ncclUint8, root)
    }

    fn barrier(&self) -> Result<()> {
        // NCCL has no barrier: a one-word collective that every rank must join, waited for.
        self.traffic.record(Collective::AllReduce, 0);
        self.max_word(0).map(drop)
    }

    fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        Some(self)
    }
}

impl Nccl {
    fn max_word(&self, word: u32) -> Result<u32> {
        let mut words = [word];
        let (comm, stream) = (self.comm, self.cu_stream());
        self.in_place(&mut words, |at| {
            // SAFETY: `at` holds one u32.
            unsafe { result::all_reduce(at, at, 1, sys::ncclDataType_t::ncclUint32, MAX, comm, stream) }
                .map(drop)
                .map_err(|e| nccl_error("ncclAllReduce", &e))
        })?;
        Ok(words[0])
    }

    fn broadcast_raw<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        values: &mut [T],
        dtype: sys::ncclDataType_t,
        root: usize,
    ) -> Result<()> {
        let (comm, stream, len, root) = (self.comm, self.cu_stream(), values.len(), to_int("root", root)?);
        self.in_place(values, |at| {
            // SAFETY: `at` holds `len` values of `dtype`.
            unsafe { result::broadcast(at, at, len, dtype, root, comm, stream) }
                .map(drop)
                .map_err(|e| nccl_error("ncclBroadcast", &e))
        })
    }
}

impl DeviceCollectives for Nccl {
    fn all_reduce_sum_tensors(&self, tensors: &[&Tensor], wire: Wire, scale: f32) -> Result<()> {
        let wire_dtype = match wire {
            Wire::F32 => candle_core::DType::F32,
            Wire::Bf16 => candle_core::DType::BF16,
            Wire::F16 => candle_core::DType::F16,
        };
        // A tensor of another dtype than the wire's travels as a converted copy, written back after.
        let mut copies: Vec<(usize, Tensor)> = Vec::new();
        let mut in_place: Vec<&Tensor> = Vec::new();
        let mut targets = Vec::with_capacity(tensors.len());
        for (index, tensor) in tensors.iter().enumerate() {
            if tensor.dtype() == wire_dtype {
                targets.push(self.device_view(tensor)?);
                in_place.push(tensor);
            } else {
                let copy = tensor.to_dtype(wire_dtype)?;
                targets.push(self.device_view(&copy)?);
                copies.push((index, copy));
            }
        }
        let values: usize = targets.iter().map(|t| t.len).sum();
        self.traffic.record(Collective::AllReduce, values * wire.bytes_per_value());
        let (comm, stream) = (self.comm, self.cu_stream());
        self.grouped("ncclAllReduce", &targets, |t| {
            let at = t.address as *mut std::ffi::c_void;
            // SAFETY: `t` is a live contiguous range of `t.len` values of `t.dtype` on this device,
            // kept alive (the tensors or their copies) until the stream has run the collective.
            unsafe { result::all_reduce(at, at, t.len, nccl_type(t.dtype), SUM, comm, stream) }
        })?;
        if scale != 1.0 && !in_place.is_empty() {
            // Multiplied in f32 and rounded once into each tensor's dtype.
            crate::passes::unscale_and_check(&in_place, scale)?;
        }
        for (index, copy) in copies {
            let sum = match scale {
                1.0 => copy,
                _ => (copy.to_dtype(candle_core::DType::F32)? * f64::from(scale))?,
            };
            self.copy_into(tensors[index], &sum.to_dtype(tensors[index].dtype())?)?;
        }
        Ok(())
    }

    fn broadcast_tensors(&self, tensors: &[&Tensor], root: usize) -> Result<()> {
        check_root("broadcast_tensors", root, self.world)?;
        let targets = tensors.iter().map(|t| self.device_view(t)).collect::<Result<Vec<_>>>()?;
        let bytes: usize = targets.iter().map(|t| t.len * dtype_size(t.dtype)).sum();
        self.traffic.record(Collective::Broadcast, bytes);
        let (comm, stream, root) = (self.comm, self.cu_stream(), to_int("root", root)?);
        self.grouped("ncclBroadcast", &targets, |t| {
            let at = t.address as *mut std::ffi::c_void;
            // SAFETY: as in `all_reduce_sum_tensors`; moved as bytes, so every dtype arrives exactly.
            unsafe {
                result::broadcast(
                    at,
                    at,
                    t.len * dtype_size(t.dtype),
                    sys::ncclDataType_t::ncclUint8,
                    root,
                    comm,
                    stream,
                )
            }
        })
    }
}

const SUM: sys::ncclRedOp_t = sys::ncclRedOp_t::ncclSum;
const MAX: sys::ncclRedOp_t = sys::ncclRedOp_t::ncclMax;

/// The stream of a CUDA `device`, its context bound to this thread (NCCL's init uses the current one).
fn prepare(device: &Device) -> Result<Arc<CudaStream>> {
    let cuda = device.as_cuda_device().map_err(|_| Error::Nccl {
        reason: format!(
            "{:?} is not a CUDA device: NCCL moves GPU buffers (one GPU per rank)",
            device.location()
        ),
    })?;
    let stream = cuda.cuda_stream();
    stream.context().bind_to_thread().map_err(cuda_error)?;
    Ok(stream)
}

fn nccl_type(dtype: Dtype) -> sys::ncclDataType_t {
    match dtype {
        Dtype::F32 => sys::ncclDataType_t::ncclFloat32,
        Dtype::F16 => sys::ncclDataType_t::ncclFloat16,
        Dtype::Bf16 => sys::ncclDataType_t::ncclBfloat16,
    }
}

fn half_type(half: HalfWire) -> sys::ncclDataType_t {
    match half {
        HalfWire::Bf16 => sys::ncclDataType_t::ncclBfloat16,
        HalfWire::F16 => sys::ncclDataType_t::ncclFloat16,
    }
}

fn dtype_size(dtype: Dtype) -> usize {
    match dtype {
        Dtype::F32 => 4,
        Dtype::F16 | Dtype::Bf16 => 2,
    }
}

fn to_int(what: &'static str, value: usize) -> Result<i32> {
    i32::try_from(value)
        .map_err(|_| Error::Nccl { reason: format!("{what} {value} does not fit NCCL's int") })
}

/// NCCL's own words for a failure.
fn describe(error: &result::NcclError) -> String {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any result code.
    let text = unsafe { CStr::from_ptr(sys::ncclGetErrorString(error.0)) };
    format!("{} ({:?})", text.to_string_lossy(), error.0)
}

fn nccl_error(call: &'static str, error: &result::NcclError) -> Error {
    Error::Nccl { reason: format!("{call} failed: {}", describe(error)) }
}
