//! Loops compiled once per vector extension, the widest the CPU has chosen at run time.
//!
//! The crate is built for baseline x86-64 (SSE2), where the compiler vectorises plain loops 4 floats
//! wide. `widest_vectors!` compiles a loop's body a second and a third time, with AVX-512 and with
//! AVX2 and FMA enabled, and calls the version the CPU runs: the same Rust, 16 or 8 floats wide. The
//! body is an `#[inline(always)]` function, so that its loops are compiled inside each version (a call
//! to a function compiled without the features would stay a call, at baseline width). Every version
//! computes the same bits: the compiler may not reassociate float arithmetic, nor fuse a multiply and
//! an add that the source does not write as one. [`limit_width`] caps the versions chosen (process
//! wide), so that tests run every version on a CPU that has the widest (`tests/vector_widths.rs`).

use std::sync::atomic::{AtomicU8, Ordering};

use crate::Isa;

/// The widest version the loops may run: an [`Isa`] as its index in [`Isa::ALL`].
static LIMIT: AtomicU8 = AtomicU8::new(u8::MAX);

/// Caps the vector extension of the crate's elementwise and packing loops at `isa` (`None`: no cap),
/// for every thread of the process; returns the previous cap. Results do not change (every version
/// computes the same bits), only speed: this exists so that tests and benchmarks can run the narrower
/// versions on a CPU that has wider ones. The GEMM micro-kernels have their own paths
/// ([`crate::gemm::GemmPath`]).
pub fn limit_width(isa: Option<Isa>) -> Option<Isa> {
    let index = isa.map_or(u8::MAX, |isa| Isa::ALL.iter().position(|&i| i == isa).unwrap_or(0) as u8);
    let previous = LIMIT.swap(index, Ordering::Relaxed);
    Isa::ALL.get(usize::from(previous)).copied()
}

/// Whether the loops may run the version for `isa`: the CPU has it and [`limit_width`] allows it.
#[doc(hidden)]
#[must_use]
pub fn allows(isa: Isa) -> bool {
    isa.is_supported()
        && Isa::ALL.iter().position(|&i| i == isa).unwrap_or(0) <= usize::from(LIMIT.load(Ordering::Relaxed))
}

/// `widest_vectors! { fn name<T: Bound>(arg: Type, ...) => body; }` defines `fn name` (same
/// attributes, visibility, generics and arguments) that runs `body(arg, ...)` compiled for AVX-512 (F,
/// BW, VL, with AVX2, FMA and F16C) or for AVX2 (with FMA and F16C), whichever is the widest this CPU
/// has and [`limit_width`] allows, else as compiled for the baseline. `body` must be `#[inline(always)]`
/// and return `()`.
macro_rules! widest_vectors {
    (
        $(#[$attr:meta])*
        $vis:vis fn $name:ident $(< $($g:ident : $b0:ident $(+ $bs:ident)*),+ >)?
            ( $($arg:ident : $ty:ty),* $(,)? ) => $body:ident;
    ) => {
        $(#[$attr])*
        $vis fn $name $(< $($g: $b0 $(+ $bs)*),+ >)? ( $($arg: $ty),* ) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
                unsafe fn avx512 $(< $($g: $b0 $(+ $bs)*),+ >)? ( $($arg: $ty),* ) {
                    $body $(::< $($g),+ >)? ( $($arg),* )
                }
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn avx2 $(< $($g: $b0 $(+ $bs)*),+ >)? ( $($arg: $ty),* ) {
                    $body $(::< $($g),+ >)? ( $($arg),* )
                }
                if $crate::vectorise::allows($crate::Isa::Avx512) {
                    // SAFETY: the CPU has the features the function is compiled for.
                    return unsafe { avx512 $(::< $($g),+ >)? ( $($arg),* ) };
                }
                if $crate::vectorise::allows($crate::Isa::Avx2) {
                    // SAFETY: as above.
                    return unsafe { avx2 $(::< $($g),+ >)? ( $($arg),* ) };
                }
            }
            $body $(::< $($g),+ >)? ( $($arg),* )
        }
    };
}
