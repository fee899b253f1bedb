//! The CUDA kernels' logic, checked on the CPU against `amp_kernels::reference`.
//!
//! # How
//!
//! Every family's source (`Family::source()`: exactly what NVRTC compiles) is compiled as C++20 by g++
//! with `tests/emulation/cuda_emulation.h` standing in for the CUDA built-ins, and loaded as a shared
//! library ([`harness`]). A launch runs its blocks one at a time on a pool of real OS threads, one per
//! thread of a block, reused from block to block ([`launch`]): `__syncthreads` is a real barrier,
//! `atomicMin` a real atomic. Tables are built by the real `LaunchTable` from host addresses
//! ([`tables`]), so Rust and CUDA must agree on the layout. The data is seeded ([`data`]): tensors
//! spanning several blocks, an empty one, every gradient type and working-copy type.
//!
//! Needs g++ with C++20, no GPU and no cargo feature. Without g++ every test says so and passes, unless
//! `AMP_REQUIRE_EMULATION=1` makes its absence a failure.
//!
//! # What is checked, and how closely
//!
//! Bit for bit, wherever no norm enters:
//!
//! - [`conversions`]: the emulation's software f16 / bf16 conversions against `half` (every rounding
//!   point, random values, the specials); every other check relies on them.
//! - [`unscale`]: unscaled gradients (f16 overflow on rounding included) and the bad-tensor flag
//!   (smallest index wins); `amp_find_non_finite` leaves the gradients alone.
//! - [`adam`], [`sgd`]: every state array, step after step, through skipped steps.
//! - [`skipped_steps`]: a flagged step changes no state, no LAMB scratch, no step counter.
//! - [`scale`]: the step counter, the skip reason, and the loss-scale state machine against the host's
//!   (`ScaleState::record_step`, on amp-kernels' `scale` module, which amp-runtime's scaler runs too).
//!
//! Within a tolerance where a norm enters, since the order of its sum differs:
//!
//! - [`norm`]: per-tensor and global norms within 1 ulp. Both sides sum squares in f64, but in another
//!   order (lanes and a tree on the device, sequentially on the CPU), before rounding to f32. The clip
//!   factor is bit for bit `inv_scale` times the CPU's coefficient of the kernel's own norm.
//! - [`lamb`]: moments bit for bit (they come before the norms); norms within 1 ulp, as above. Where both
//!   of a tensor's norms are exact, master and working copy are bit for bit; where one is an ulp off, the
//!   trust ratio is off by a few ulps, so masters may differ by up to 4 ulps (`MASTER_ULPS`) and the
//!   working copy must be the rounding of the kernel's own master.
//!
//! # What this cannot check
//!
//! The PTX half conversions themselves (the emulation's are software ones, checked against `half`),
//! CUDA's `pow` (here it is glibc's, as in the reference, so Adam and LAMB bias corrections agree
//! trivially; on a GPU they may differ by an ulp), and the scheduling of blocks (one at a time here; what
//! must not depend on it, `atomicMin` on the flag, runs with real threads).

#[path = "../common/mod.rs"]
mod common;

mod data;
mod harness;
mod launch;
mod tables;

mod adam;
mod bf16_state;
mod conversions;
mod lamb;
mod norm;
mod scale;
mod sgd;
mod skipped_steps;
mod unscale;
