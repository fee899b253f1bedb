//! Compute kernels of amp: the bandwidth-bound steps of mixed-precision training on CPU, fused into one
//! memory pass per parameter and run over many tensors at once.
//!
//! - [`unscale`]: multiply gradients by `1 / loss_scale` and detect infinities and NaNs, in one pass.
//! - [`norm`]: deterministic global and per-tensor L2 norms (gradient clipping, LAMB).
//! - [`optim`]: fused Adam / AdamW, SGD and LAMB steps over fp32 master weights and fp32 state (Adam's
//!   moments and SGD's momentum buffer also in bf16), reading f32, f16 or bf16 gradients and optionally writing the f16 / bf16
//!   working copy in the same pass.
//! - [`stochastic`]: f32 to bf16 with stochastic rounding, from counter-based random bits.
//! - [`clip`]: clipping by value, and the clip-by-norm coefficient.
//! - [`conv`]: convolution as matrix products: an image's patches as the columns of a matrix (im2col)
//!   and that matrix's gradient folded back onto the image (col2im).
//! - [`convert`]: f32 <-> f16 / bf16 with `half`'s rounding, bit for bit.
//! - [`reduce`]: column sums in f32 (a linear layer's bias gradient).
//! - [`layer_norm`]: layer normalisation forward and backward, one pass each.
//! - [`fresh`]: new output vectors written in parallel blocks, each zeroed by its writer just before.
//! - [`scale`]: the dynamic loss scale's state machine (growth, backoff, hysteresis, floor, ceiling).
//! - [`reference`](mod@reference): slow scalar versions of every kernel, the oracle of the tests.
//! - [`timing`]: the interleaved timing harness of the workspace's benchmarks.
//! - [`cuda`]: the same kernels for NVIDIA GPUs, CUDA C++ compiled at run time with NVRTC (feature `cuda`),
//!   plus the loss scale's state machine on the device.
//!
//! No candle types appear here: tensors are plain slices ([`GradSlice`], [`GradSliceMut`],
//! [`HalfSliceMut`]). Work is split into chunks of up to 64 Ki elements across all tensors and run on the
//! current rayon pool; a call allocates nothing. On x86-64 with AVX2 + FMA + F16C a hand-vectorised path
//! runs, elsewhere a portable one; both give bit-identical results ([`Isa`]).
//!
//! ```
//! use amp_kernels::optim::{adam_step, AdamParams, AdamTensor};
//! use amp_kernels::unscale::unscale_and_check;
//! use amp_kernels::{GradSliceMut, HalfSliceMut};
//! use half::f16;
//!
//! // One parameter: fp32 master, f16 working copy and f16 gradient scaled by 1024.
//! let mut master = vec![1.0f32; 10];
//! let mut working = vec![f16::ONE; 10];
//! let mut grad = vec![f16::from_f32(0.5 * 1024.0); 10];
//! let (mut m, mut v) = (vec![0.0f32; 10], vec![0.0f32; 10]);
//!
//! // Unscale + overflow check (here done separately; `adam_step` can also unscale inline).
//! let overflow = unscale_and_check(&mut [GradSliceMut::F16(&mut grad)], 1.0 / 1024.0);
//! assert_eq!(overflow, None); // a Some(i) means: skip this step, do not call the optimizer.
//!
//! let params = AdamParams { lr: 0.1, weight_decay: 0.0, ..AdamParams::default() };
//! let mut tensors = [AdamTensor::new(&mut master, (&grad[..]).into(), &mut m, &mut v)
//!     .with_working(HalfSliceMut::F16(&mut working))];
//! adam_step(&mut tensors, &params, 1.0);
//! // First Adam step moves every weight by lr against the gradient's sign.
//! assert!((master[0] - 0.9).abs() < 1e-6);
//! assert_eq!(working[0], f16::from_f32(master[0]));
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))] // docs.rs: items of the `cuda` feature say so
#![warn(missing_docs)]

#[macro_use]
pub mod vectorise;

mod activation;
#[cfg(target_arch = "x86_64")]
mod amx;
mod backend;
mod branchless;
pub mod channel_affine;
pub mod clip;
pub mod conv;
pub mod convert;
pub mod cuda;
pub mod exp;
pub mod fresh;
pub mod gelu;
pub mod gemm;
mod isa;
mod lanes;
pub mod layer_norm;
mod mul_add;
pub mod norm;
pub mod optim;
mod par;
pub mod pool;
mod portable;
pub mod reduce;
pub mod reference;
pub mod relu;
pub mod resize;
pub mod rms_norm;
pub mod rope;
pub mod scale;
pub mod silu;
#[cfg(target_arch = "x86_64")]
mod simd;
mod slices;
pub mod softmax;
pub mod squared_error;
pub mod stochastic;
pub mod timing;
pub mod unscale;

pub use isa::Isa;
pub use slices::{Dtype, GradSlice, GradSliceMut, HalfSliceMut};
