//! Instruction-set selection: which code path a kernel runs.
//!
//! Every kernel has a portable path (plain Rust, written so LLVM auto-vectorises it for whatever the
//! compile target offers) and, on x86-64, hand-vectorised paths. The path is chosen at run time, once per
//! call, from [`Isa::detect`]; the `*_with` variants of each kernel take an explicit [`Isa`] so tests and
//! benchmarks can run every path this CPU has on the same data.
//!
//! The bandwidth-bound kernels (unscale, norms, optimizers, conversions) have one x86 path, AVX2 + FMA +
//! F16C, which the AVX-512 levels also run: those kernels are bound by memory, not by vector width. The
//! GEMM ([`crate::gemm`]) has a micro-kernel per level: ymm FMA, zmm FMA, `vdpbf16ps` and AMX tiles.

/// A code path for the kernels of this crate, from the most portable to the most specialised. Each
/// level implies the ones before it on every CPU that has it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust, any CPU.
    Portable,
    /// x86-64 with AVX2, FMA and F16C (Haswell / Zen 1 and later).
    Avx2,
    /// [`Isa::Avx2`] plus AVX-512 F/BW/VL (Skylake-SP / Zen 4 and later).
    Avx512,
    /// [`Isa::Avx512`] plus AVX512-BF16: the `vdpbf16ps` bf16 dot product (Cooper Lake, Sapphire Rapids,
    /// Zen 4 and later).
    Avx512Bf16,
    /// [`Isa::Avx512Bf16`] plus AMX-TILE and AMX-BF16 (Sapphire Rapids and later), with the operating
    /// system's permission to use tile data: on Linux (5.16 or later) amp asks for it once per process
    /// (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); elsewhere this level is not used.
    AmxBf16,
}

impl Isa {
    /// Every level, most portable first.
    pub const ALL: [Isa; 5] = [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16, Isa::AmxBf16];

    /// The fastest path this CPU supports.
    #[must_use]
    pub fn detect() -> Isa {
        Isa::ALL.into_iter().rev().find(|isa| isa.is_supported()).unwrap_or(Isa::Portable)
    }

    /// Whether this CPU (and operating system) can run this path. Cheap: the feature flags are cached by
    /// the standard library after the first query.
    #[must_use]
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Portable => true,
            Isa::Avx2 => features::avx2(),
            Isa::Avx512 => features::avx2() && features::avx512(),
            Isa::Avx512Bf16 => features::avx2() && features::avx512() && features::avx512_bf16(),
            Isa::AmxBf16 => Isa::Avx512Bf16.is_supported() && features::amx_bf16(),
        }
    }

    /// Every path this CPU supports, portable first.
    pub fn supported() -> impl Iterator<Item = Isa> {
        Isa::ALL.into_iter().filter(|isa| isa.is_supported())
    }

    /// The path a kernel actually runs when asked for `self`: `self` if supported, otherwise the most
    /// specialised supported level below it. Kernels never run an unsupported path, so passing any
    /// [`Isa`] is safe.
    #[must_use]
    pub fn or_portable(self) -> Isa {
        Isa::ALL.into_iter().rev().find(|isa| *isa <= self && isa.is_supported()).unwrap_or(Isa::Portable)
    }

    /// The CPU features this level needs, as `/proc/cpuinfo` names them.
    #[must_use]
    pub fn features(self) -> &'static str {
        match self {
            Isa::Portable => "none",
            Isa::Avx2 => "avx2 fma f16c",
            Isa::Avx512 => "avx2 fma f16c avx512f avx512bw avx512vl",
            Isa::Avx512Bf16 => "avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16",
            Isa::AmxBf16 => {
                "avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16 amx_tile amx_bf16 (and Linux 5.16+)"
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod features {
    use std::arch::is_x86_feature_detected;

    pub(super) fn avx2() -> bool {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }

    pub(super) fn avx512() -> bool {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
    }

    pub(super) fn avx512_bf16() -> bool {
        is_x86_feature_detected!("avx512bf16")
    }

    pub(super) fn amx_bf16() -> bool {
        crate::amx::is_enabled()
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod features {
    pub(super) fn avx2() -> bool {
        false
    }

    pub(super) fn avx512() -> bool {
        false
    }

    pub(super) fn avx512_bf16() -> bool {
        false
    }

    pub(super) fn amx_bf16() -> bool {
        false
    }
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
    fn detect_picks_the_most_specialised_supported_level() {
        let best = Isa::detect();
        assert!(best.is_supported());
        assert!(Isa::ALL.into_iter().filter(|isa| *isa > best).all(|isa| !isa.is_supported()));
        assert_eq!(Isa::AmxBf16.or_portable(), best);
    }

    #[test]
    fn levels_are_cumulative() {
        for pair in Isa::ALL.windows(2) {
            assert!(!pair[1].is_supported() || pair[0].is_supported(), "{:?} without {:?}", pair[1], pair[0]);
        }
    }
}
