//! How eight consecutive elements of an operand become eight words of a panel in a ymm register, so
//! that the register transposes ([`super::transpose`]) pack a k-contiguous operand from where it lies
//! even when packing converts it: f32 rounded to bf16 or f16 for a half product on the f32 kernels
//! (activations under O2), bf16 or f16 widened to f32 (half working copies). Without a conversion in
//! registers such an operand went through a tile on the stack first, element by element into it,
//! then transposed out of it: on an AVX2-only CPU (AMD Zen 3) the bf16 main job spent about 2% of its
//! samples more than fp32's in that packing.
//!
//! [`convert_run`] converts a whole run with the same loads (packing's runs of contiguous lines and its
//! tiles' rows). Each load writes what [`super::pack::Source::rounded`] writes for the element, bit for
//! bit (NaN payloads and signs included; the tests below load every 16-bit pattern, and special values,
//! the roundings' edges and 100,000 random patterns of f32, as eights and as runs).

use super::pack::Source;
use super::Compute;

/// A conversion from a run of operand elements to panel words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Load {
    /// The operand already holds the words (f32 for f32 compute, bf16 pairs): a plain load.
    Words,
    /// f32 rounded to bf16, as f32.
    F32ToBf16,
    /// f32 rounded to f16, as f32 (F16C).
    F32ToF16,
    /// bf16 widened to f32 (exact).
    Bf16ToF32,
    /// f16 widened to f32 (exact; F16C).
    F16ToF32,
}

impl Load {
    /// The load from an f32 operand for `compute`'s f32 panels (one `k` a step).
    pub(crate) const fn from_f32(compute: Compute) -> Load {
        match compute {
            Compute::F32 => Load::Words,
            Compute::Bf16 => Load::F32ToBf16,
            Compute::F16 => Load::F32ToF16,
        }
    }

    /// Bytes of the operand per panel word.
    #[cfg(target_arch = "x86_64")]
    pub(crate) const fn source_bytes(self) -> usize {
        match self {
            Load::Words | Load::F32ToBf16 | Load::F32ToF16 => 4,
            Load::Bf16ToF32 | Load::F16ToF32 => 2,
        }
    }
}

/// `out[i] = run[i].rounded(compute)` for the run (up to the shorter length): eight at a time through
/// a register load where one converts and the loops may use AVX2 ([`crate::vectorise::allows`]; F16C
/// comes with it), the rest element by element. Packing's runs of contiguous lines (an operand read
/// transposed: weight gradients) and its tiles' rows convert with it: where `f16` widens or `f32`
/// rounds to `f16`, F16C's one instruction does what the portable bit arithmetic does in about ten
/// (on a Zen 3, the fp16 main job's weight-gradient packing took a fifth fewer samples, and its step
/// went from 0.97-0.99x of fp32's speed to 0.99-1.01x, three alternated rounds each).
#[inline(always)]
pub(crate) fn convert_run<S: Source>(run: &[S], compute: Compute, out: &mut [f32]) {
    let len = run.len().min(out.len());
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if len >= 8 {
        let load = S::register_load(compute, 1).filter(|&load| load != Load::Words);
        if let Some(load) = load.filter(|_| crate::vectorise::allows(crate::Isa::Avx2)) {
            // SAFETY: the CPU has AVX2 and F16C (`allows`); `run` holds `len` elements of the type the
            // load reads (`register_load` of `S`), `out` `len` floats.
            done = unsafe { x86::convert(load, run.as_ptr().cast(), len, out.as_mut_ptr()) };
        }
    }
    for (out, &x) in out[done..len].iter_mut().zip(&run[done..len]) {
        *out = x.rounded(compute);
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    /// Eight panel words from the eight elements at `at`.
    pub(crate) trait Eight {
        /// # Safety
        /// AVX2 and F16C (the caller's `target_feature`); `at` readable for eight elements.
        unsafe fn load(at: *const u8) -> __m256i;
    }

    /// [`super::Load::Words`].
    pub(crate) struct Words;
    /// [`super::Load::F32ToBf16`].
    pub(crate) struct F32ToBf16;
    /// [`super::Load::F32ToF16`].
    pub(crate) struct F32ToF16;
    /// [`super::Load::Bf16ToF32`].
    pub(crate) struct Bf16ToF32;
    /// [`super::Load::F16ToF32`].
    pub(crate) struct F16ToF32;

    // SAFETY (every intrinsic below): AVX2 and F16C, which the `target_feature` callers enable; the
    // loads read eight elements at `at`, as `Eight::load`'s caller guarantees.

    impl Eight for Words {
        #[inline(always)]
        unsafe fn load(at: *const u8) -> __m256i {
            unsafe { _mm256_loadu_si256(at.cast()) }
        }
    }

    impl Eight for F32ToBf16 {
        #[inline(always)]
        unsafe fn load(at: *const u8) -> __m256i {
            unsafe { bf16_rounded(_mm256_loadu_si256(at.cast())) }
        }
    }

    /// f32 bits rounded to bf16 in their top half, the low half zero: `crate::branchless::bf16_bits` on
    /// each lane, shifted back (rounded to nearest even on the bits; a NaN made quiet with its sign and
    /// top payload bits). The packing's loads and the ymm kernel's half output both round with it.
    ///
    /// # Safety
    /// AVX2 (inlined into callers that enable it).
    #[inline(always)]
    pub(crate) unsafe fn bf16_rounded(x: __m256i) -> __m256i {
        unsafe {
            let top = _mm256_set1_epi32(0xFFFF_0000_u32 as i32);
            let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(1));
            let rounded = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7FFF)), lsb);
            let rounded = _mm256_and_si256(rounded, top);
            let quiet = _mm256_and_si256(_mm256_or_si256(x, _mm256_set1_epi32(0x0040_0000)), top);
            let magnitude = _mm256_and_si256(x, _mm256_set1_epi32(0x7FFF_FFFF));
            let nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7F80_0000));
            _mm256_blendv_epi8(rounded, quiet, nan)
        }
    }

    impl Eight for F32ToF16 {
        /// F16C's round trip, rounding to nearest even: what `half` computes where the CPU has F16C
        /// (it asks at run time) and `crate::branchless::f16_rounded` everywhere.
        #[inline(always)]
        unsafe fn load(at: *const u8) -> __m256i {
            unsafe {
                let x = _mm256_loadu_ps(at.cast());
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x);
                _mm256_castps_si256(_mm256_cvtph_ps(h))
            }
        }
    }

    impl Eight for Bf16ToF32 {
        /// The bits shifted into an f32's top half, a NaN made quiet (as `half`'s `bf16::to_f32`).
        #[inline(always)]
        unsafe fn load(at: *const u8) -> __m256i {
            unsafe {
                let x = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(at.cast())));
                let magnitude = _mm256_and_si256(x, _mm256_set1_epi32(0x7FFF_FFFF));
                let nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7F80_0000));
                _mm256_or_si256(x, _mm256_and_si256(nan, _mm256_set1_epi32(0x0040_0000)))
            }
        }
    }

    impl Eight for F16ToF32 {
        #[inline(always)]
        unsafe fn load(at: *const u8) -> __m256i {
            unsafe { _mm256_castps_si256(_mm256_cvtph_ps(_mm_loadu_si128(at.cast()))) }
        }
    }

    /// Converts the leading multiple of eight of `len` elements at `src` by `load` into `out`; returns
    /// how many.
    ///
    /// # Safety
    /// AVX2 and F16C; `src` readable for `len` elements of the load's source type, `out` writable for
    /// `len` floats.
    #[target_feature(enable = "avx2,f16c")]
    pub(crate) unsafe fn convert(load: super::Load, src: *const u8, len: usize, out: *mut f32) -> usize {
        use super::Load;
        // SAFETY (each): as the caller guarantees.
        unsafe {
            match load {
                Load::Words => run::<Words>(src, 4, len, out),
                Load::F32ToBf16 => run::<F32ToBf16>(src, 4, len, out),
                Load::F32ToF16 => run::<F32ToF16>(src, 4, len, out),
                Load::Bf16ToF32 => run::<Bf16ToF32>(src, 2, len, out),
                Load::F16ToF32 => run::<F16ToF32>(src, 2, len, out),
            }
        }
    }

    /// [`convert`] by `E`, whose elements are `bytes` wide.
    #[inline(always)]
    unsafe fn run<E: Eight>(src: *const u8, bytes: usize, len: usize, out: *mut f32) -> usize {
        let whole = len / 8 * 8;
        for i in (0..whole).step_by(8) {
            // SAFETY: elements i..i + 8 lie inside both (caller); AVX2 and F16C (caller).
            unsafe { _mm256_storeu_si256(out.add(i).cast(), E::load(src.add(i * bytes))) };
        }
        whole
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use half::{bf16, f16};

    use super::x86::{Bf16ToF32, Eight, F16ToF32, F32ToBf16, F32ToF16, Words};
    use super::{convert_run, Load};
    use crate::gemm::pack::Source;
    use crate::gemm::Compute;

    /// Special values, the edges of both roundings, and random bit patterns (every NaN class among them).
    fn f32_bits() -> Vec<u32> {
        let specials =
            [0.0f32, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN, f32::MIN_POSITIVE]
                .map(f32::to_bits);
        // bf16's carry into the exponent and to infinity, ties to even; f16's largest finite, its
        // overflow, its smallest normal and subnormals; f32 subnormals; signalling and quiet NaNs.
        #[rustfmt::skip]
        let edges = [
            0x7F7F_8000, 0x7F7F_7FFF, 0x0000_8000, 0x3F80_8000, 0x3F81_8000,
            0x477F_EFFF, 0x477F_F000, 0x3880_0000, 0x3300_0000, 0x3300_0001,
            0x0000_0001, 0x8000_0001, 0x7F80_0001, 0xFFC0_0001, 0x7FBF_FFFF, 0x7FC0_0000,
            0xFFFF_8000, 0xFFFF_FFFF,
        ];
        let mut state = 0x0123_4567u32;
        let randoms = (0..100_000).map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state
        });
        specials.into_iter().chain(edges).chain(randoms).collect()
    }

    #[target_feature(enable = "avx2,f16c")]
    fn loaded<E: Eight, T: Copy>(src: &[T]) -> Vec<u32> {
        src.chunks_exact(8)
            .flat_map(|eight| {
                // SAFETY: AVX2 and F16C enabled; eight elements readable.
                let v = unsafe { E::load(eight.as_ptr().cast()) };
                // SAFETY: a register of eight u32.
                unsafe { std::mem::transmute::<_, [u32; 8]>(v) }
            })
            .collect()
    }

    #[test]
    fn every_load_writes_what_packing_writes_element_by_element() {
        if !crate::Isa::Avx2.is_supported() {
            eprintln!("skipped: this CPU has no AVX2 and F16C, so the loads never run here");
            return;
        }
        let bits = f32_bits();
        let bits = &bits[..bits.len() / 8 * 8];
        let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        // Every 16-bit pattern.
        let xb: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        let xh: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        // SAFETY (each call): the CPU has AVX2 and F16C (checked above).
        unsafe {
            assert_same("words", &loaded::<Words, _>(&x), &x, |v| *v);
            assert_same("f32 to bf16", &loaded::<F32ToBf16, _>(&x), &x, |v| v.rounded(Compute::Bf16));
            assert_same("f32 to f16", &loaded::<F32ToF16, _>(&x), &x, |v| v.rounded(Compute::F16));
            for compute in [Compute::F32, Compute::Bf16] {
                assert_same("bf16 widened", &loaded::<Bf16ToF32, _>(&xb), &xb, |v| v.rounded(compute));
            }
            for compute in [Compute::F32, Compute::F16] {
                assert_same("f16 widened", &loaded::<F16ToF32, _>(&xh), &xh, |v| v.rounded(compute));
            }
        }
        assert_eq!(
            [Compute::F32, Compute::Bf16, Compute::F16].map(Load::from_f32),
            [Load::Words, Load::F32ToBf16, Load::F32ToF16]
        );
    }

    #[test]
    fn runs_convert_as_packing_rounds_each_element() {
        let bits = f32_bits();
        let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        let xb: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        let xh: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        for compute in [Compute::F32, Compute::Bf16, Compute::F16] {
            converted_runs(&x, compute);
            converted_runs(&xb, compute);
            converted_runs(&xh, compute);
        }
    }

    /// [`convert_run`] of all of `src`, and of short runs of every length to 33 from a few offsets
    /// (the eights and the tail), against `Source::rounded` of each element; an output longer than the
    /// run keeps its tail.
    fn converted_runs<S: Source + std::fmt::Debug>(src: &[S], compute: Compute) {
        let mut out = vec![0.0f32; src.len()];
        convert_run(src, compute, &mut out);
        let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
        assert_same(&format!("a run for {compute:?}"), &got, src, |v| v.rounded(compute));
        for len in 0..=33 {
            for offset in 0..3 {
                let run = &src[offset * 1000..][..len];
                let mut out = vec![f32::from_bits(0xDEAD_BEEF); len + 5];
                convert_run(run, compute, &mut out);
                let got: Vec<u32> = out[..len].iter().map(|v| v.to_bits()).collect();
                assert_same(&format!("{len} from {offset} for {compute:?}"), &got, run, |v| {
                    v.rounded(compute)
                });
                assert!(out[len..].iter().all(|v| v.to_bits() == 0xDEAD_BEEF), "wrote past the run");
            }
        }
    }

    /// Each loaded word against `want` of its element, naming the first that differs.
    fn assert_same<T: Copy + std::fmt::Debug>(what: &str, got: &[u32], src: &[T], want: impl Fn(&T) -> f32) {
        assert_eq!(got.len(), src.len(), "{what}");
        for (g, x) in got.iter().zip(src) {
            assert_eq!(
                *g,
                want(x).to_bits(),
                "{what} of {x:?}: {:#010x} against {:#010x}",
                g,
                want(x).to_bits()
            );
        }
    }
}
