//! Instruction-set selection: which code path a kernel runs.
//!
//! Every kernel has a portable path (plain Rust, written so LLVM auto-vectorises it for whatever the
//! compile target offers) and, on x86-64, a hand-vectorised AVX2 + FMA + F16C path. The path is chosen
//! at run time, once per call, from [`Isa::detect`]; the `*_with` variants of each kernel take an explicit
//! [`Isa`] so tests and benchmarks can run both paths on the same machine.
//!
//! Both paths perform the same f32 operations in the same order, so they produce bit-identical results.

/// A code path for the kernels of this crate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Plain Rust, any CPU.
    Portable,
    /// x86-64 with AVX2, FMA and F16C (Haswell / Zen 1 and later).
    Avx2,
}

impl Isa {
    /// The fastest path this CPU supports.
    #[must_use]
    pub fn detect() -> Isa {
        if Isa::Avx2.is_supported() {
            Isa::Avx2
        } else {
            Isa::Portable
        }
    }

    /// Whether this CPU (and operating system) can run this path. Cheap: the feature flags are cached by
    /// the standard library after the first query.
    #[must_use]
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Portable => true,
            Isa::Avx2 => avx2_supported(),
        }
    }

    /// Every path this CPU supports, portable first.
    pub fn supported() -> impl Iterator<Item = Isa> {
        [Isa::Portable, Isa::Avx2].into_iter().filter(|isa| isa.is_supported())
    }

    /// The path a kernel actually runs when asked for `self`: `self` if supported, otherwise
    /// [`Isa::Portable`]. Kernels never run an unsupported path, so passing any [`Isa`] is safe.
    #[must_use]
    pub fn or_portable(self) -> Isa {
        if self.is_supported() {
            self
        } else {
            Isa::Portable
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_supported() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx2_supported() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn portable_is_always_supported_and_listed_first() {
        assert!(Isa::Portable.is_supported());
        assert_eq!(Isa::supported().next(), Some(Isa::Portable));
    }

    #[test]
    fn detect_picks_avx2_exactly_when_supported() {
        assert_eq!(Isa::detect() == Isa::Avx2, Isa::Avx2.is_supported());
        assert_eq!(Isa::Avx2.or_portable(), Isa::detect());
    }
}
