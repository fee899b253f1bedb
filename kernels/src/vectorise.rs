//! Loops compiled once per vector extension, the widest the CPU has chosen at run time.
//!
//! The crate is built for baseline x86-64 (SSE2), where the compiler vectorises plain loops 4 floats
//! wide. `widest_vectors!` compiles a loop's body a second and a third time, with AVX-512 and with
//! AVX2 and FMA enabled, and calls the version the CPU runs: the same Rust, 16 or 8 floats wide. The
//! body is an `#[inline(always)]` function, so that its loops are compiled inside each version (a call
//! to a function compiled without the features would stay a call, at baseline width). Every version
//! computes the same bits: the compiler may not reassociate float arithmetic, nor fuse a multiply and
//! an add that the source does not write as one.

/// `widest_vectors! { fn name<T: Bound>(arg: Type, ...) => body; }` defines `fn name` (same
/// attributes, visibility, generics and arguments) that runs `body(arg, ...)` compiled for AVX-512 (F,
/// BW, VL, with AVX2, FMA and F16C) or for AVX2 (with FMA and F16C), whichever is the widest this CPU
/// has, else as compiled for the baseline. `body` must be `#[inline(always)]` and return `()`.
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
                if $crate::Isa::Avx512.is_supported() {
                    // SAFETY: the CPU has the features the function is compiled for.
                    return unsafe { avx512 $(::< $($g),+ >)? ( $($arg),* ) };
                }
                if $crate::Isa::Avx2.is_supported() {
                    // SAFETY: as above.
                    return unsafe { avx2 $(::< $($g),+ >)? ( $($arg),* ) };
                }
            }
            $body $(::< $($g),+ >)? ( $($arg),* )
        }
    };
}
