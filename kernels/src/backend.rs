//! The resolved code path a kernel call runs, and the dispatch from it to a backend function.

use half::{bf16, f16};

use crate::Isa;

/// An [`Isa`] this CPU supports: only constructible through [`Backend::new`], which falls back to
/// [`Isa::Portable`]. Holding `Backend(isa)` with `isa >= Isa::Avx2` proves AVX2, FMA and F16C are
/// available (every level above AVX2 includes them), which is what makes the `unsafe` calls in
/// [`dispatch!`] sound. The bandwidth-bound kernels have one x86 path, so every level above AVX2 runs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Backend(Isa);

impl Backend {
    /// Resolves `isa` against this CPU.
    pub(crate) fn new(isa: Isa) -> Backend {
        Backend(isa.or_portable())
    }

    /// Whether the AVX2 path runs (never, off x86-64).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn is_avx2(self) -> bool {
        self.0 >= Isa::Avx2
    }
}

/// An element type both backends handle.
#[cfg(target_arch = "x86_64")]
pub(crate) trait Element: crate::portable::Elem + crate::simd::Elem {}

/// An element type both backends handle.
#[cfg(not(target_arch = "x86_64"))]
pub(crate) trait Element: crate::portable::Elem {}

impl Element for f32 {}
impl Element for f16 {}
impl Element for bf16 {}

/// A type LAMB keeps its moments in (f32, or bf16 rounded stochastically), both backends.
#[cfg(target_arch = "x86_64")]
pub(crate) trait Moment: Element + crate::portable::lamb::Moment + crate::simd::lamb::Moment {}

/// A type LAMB keeps its moments in (f32, or bf16 rounded stochastically), both backends.
#[cfg(not(target_arch = "x86_64"))]
pub(crate) trait Moment: Element + crate::portable::lamb::Moment {}

impl Moment for f32 {}
impl Moment for bf16 {}

/// `dispatch!(backend, module::function::<T>(args))` calls `crate::simd::module::function` when `backend`
/// is AVX2 and `crate::portable::module::function` otherwise (always, off x86-64).
macro_rules! dispatch {
    ($backend:expr, $module:ident :: $f:ident $(::<$($t:ty),+>)? ($($arg:expr),* $(,)?)) => {{
        #[cfg(target_arch = "x86_64")]
        let result = if $backend.is_avx2() {
            // SAFETY: a `Backend` is AVX2 only if `Isa::or_portable` found AVX2, FMA and F16C.
            unsafe { $crate::simd::$module::$f $(::<$($t),+>)? ($($arg),*) }
        } else {
            $crate::portable::$module::$f $(::<$($t),+>)? ($($arg),*)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let result = {
            let _ = $backend;
            $crate::portable::$module::$f $(::<$($t),+>)? ($($arg),*)
        };
        result
    }};
}

pub(crate) use dispatch;
