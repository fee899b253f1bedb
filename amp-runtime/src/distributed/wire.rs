//! The dtype gradients travel in between ranks, and the 16-bit codec with its reduction rule.
//!
//! MPI has no f16 or bf16 datatype. A 16-bit wire therefore moves the values as `u16` words (their bit
//! patterns) and reduces them with a user-defined operation, [`sum_half_words`]: decode both operands
//! to f32, add in f32, round once to the wire's type (round to nearest even). Each combine of two
//! partial sums rounds once, as a reduction in a half type must; the sum never goes through a wider
//! accumulator between ranks.

use amp_kernels::convert::{narrow, widen};
use amp_kernels::{GradSlice, HalfSliceMut};
use half::slice::HalfBitsSliceExt;
use half::{bf16, f16};

/// Values [`sum_half_words`] and `round_trip` convert at a time, through buffers of this many on the stack.
const COMBINE_CHUNK: usize = 2048;

/// The dtype gradients travel in between ranks.
///
/// fp32 is exact per value and the default (Megatron-LM reduces in fp32 by default). bf16 and fp16
/// halve the bytes moved, at one rounding per value and one per combine of partial sums: bf16 keeps
/// fp32's range (no overflow) with 8 significant bits; fp16 keeps 11 bits but overflows above 65504,
/// which a pre-divide factor ([`DataParallelConfig::predivide_factor`](super::DataParallelConfig))
/// guards against.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Wire {
    /// 4 bytes a value, exact.
    #[default]
    F32,
    /// 2 bytes a value: bfloat16 bit patterns.
    Bf16,
    /// 2 bytes a value: IEEE binary16 bit patterns.
    F16,
}

/// The 16-bit wire types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HalfWire {
    /// bfloat16.
    Bf16,
    /// IEEE binary16.
    F16,
}

impl Wire {
    /// Bytes one value takes on the wire.
    pub fn bytes_per_value(self) -> usize {
        match self {
            Wire::F32 => 4,
            Wire::Bf16 | Wire::F16 => 2,
        }
    }

    /// The 16-bit type, for the wires that use one.
    pub fn half(self) -> Option<HalfWire> {
        match self {
            Wire::F32 => None,
            Wire::Bf16 => Some(HalfWire::Bf16),
            Wire::F16 => Some(HalfWire::F16),
        }
    }

    /// Unit roundoff of one rounding to the wire type (0 for fp32, which is not rounded): 2^-8 for bf16,
    /// 2^-11 for fp16. Error bounds of a reduction are stated in it.
    pub fn unit_roundoff(self) -> f64 {
        match self {
            Wire::F32 => 0.0,
            Wire::Bf16 => 2f64.powi(-8),
            Wire::F16 => 2f64.powi(-11),
        }
    }
}

impl HalfWire {
    /// The bit pattern of `value` rounded to this type (round to nearest even).
    pub fn encode(self, value: f32) -> u16 {
        match self {
            HalfWire::Bf16 => bf16::from_f32(value).to_bits(),
            HalfWire::F16 => f16::from_f32(value).to_bits(),
        }
    }

    /// The value of a bit pattern of this type, exactly, as f32.
    pub fn decode(self, word: u16) -> f32 {
        match self {
            HalfWire::Bf16 => bf16::from_bits(word).to_f32(),
            HalfWire::F16 => f16::from_bits(word).to_f32(),
        }
    }

    /// Encodes every value.
    pub fn encode_all(self, values: &[f32]) -> Vec<u16> {
        let mut words = vec![0u16; values.len()];
        self.encode_into(values, &mut words);
        words
    }

    /// Encodes `values` into `words` (same length), with amp's SIMD conversion: bit for bit
    /// [`encode`](Self::encode) of each value.
    ///
    /// # Panics
    /// If the lengths differ.
    pub fn encode_into(self, values: &[f32], words: &mut [u16]) {
        match self {
            HalfWire::Bf16 => narrow(values, HalfSliceMut::Bf16(words.reinterpret_cast_mut::<bf16>())),
            HalfWire::F16 => narrow(values, HalfSliceMut::F16(words.reinterpret_cast_mut::<f16>())),
        }
    }

    /// Decodes `words` into `values` (same length), with amp's SIMD conversion (exact).
    ///
    /// # Panics
    /// If the lengths differ.
    pub fn decode_into(self, words: &[u16], values: &mut [f32]) {
        match self {
            HalfWire::Bf16 => widen(GradSlice::Bf16(words.reinterpret_cast::<bf16>()), values),
            HalfWire::F16 => widen(GradSlice::F16(words.reinterpret_cast::<f16>()), values),
        }
    }
}

/// The reduction op of a 16-bit wire: `inout[i] = round(decode(input[i]) + decode(inout[i]))`, the add
/// in f32 (exact for two values of 8 or 11 significant bits unless their exponents are far apart) and
/// one rounding to the wire type. Commutative; associative only as much as any floating-point sum.
pub fn sum_half_words(half: HalfWire, input: &[u16], inout: &mut [u16]) {
    let (mut a, mut b) = ([0f32; COMBINE_CHUNK], [0f32; COMBINE_CHUNK]);
    for (input, inout) in input.chunks(COMBINE_CHUNK).zip(inout.chunks_mut(COMBINE_CHUNK)) {
        let n = input.len().min(inout.len());
        let (a, b) = (&mut a[..n], &mut b[..n]);
        half.decode_into(&input[..n], a);
        half.decode_into(&inout[..n], b);
        a.iter_mut().zip(b.iter()).for_each(|(x, y)| *x += *y);
        half.encode_into(a, &mut inout[..n]);
    }
}

/// Rounds every value through the wire type and back: what a value is after travelling.
pub(crate) fn round_trip(wire: Wire, values: &mut [f32]) {
    if let Some(half) = wire.half() {
        let mut words = [0u16; COMBINE_CHUNK];
        for chunk in values.chunks_mut(COMBINE_CHUNK) {
            let words = &mut words[..chunk.len()];
            half.encode_into(chunk, words);
            half.decode_into(words, chunk);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codec_round_trips_every_bf16_and_f16_pattern_that_is_a_number() {
        for half in [HalfWire::Bf16, HalfWire::F16] {
            for word in 0..=u16::MAX {
                let value = half.decode(word);
                if value.is_nan() {
                    assert!(half.decode(half.encode(value)).is_nan());
                } else {
                    assert_eq!(half.encode(value), word, "{half:?} {word:#06x}");
                }
            }
        }
    }

    #[test]
    fn the_simd_codec_and_combine_are_the_scalar_rules_bit_for_bit() {
        // Every f32 class: normals around each type's range, subnormals of both, ties, inf, NaN; a
        // length that is no multiple of any vector width or of the combine's chunk.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let values: Vec<f32> = (0..5003)
            .map(|i| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                match i % 7 {
                    0 => f32::from_bits(state as u32),
                    1 => f32::from_bits(0x3f80_8000 | (state as u32 & 0x8000_7fff)), // bf16 ties
                    2 => (state as u32 >> 8) as f32 * 2f32.powi(-30),                // f16 subnormals
                    3 => [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 65520.0, -0.0][state as usize % 5],
                    _ => (state as i32) as f32 * 2f32.powi(-40),
                }
            })
            .collect();
        for half in [HalfWire::Bf16, HalfWire::F16] {
            let words = half.encode_all(&values);
            for (i, (&word, &value)) in words.iter().zip(&values).enumerate() {
                let want = half.encode(value);
                let same = word == want || (half.decode(word).is_nan() && half.decode(want).is_nan());
                assert!(same, "{half:?} value {i} = {value:e}: {word:#06x}, scalar {want:#06x}");
            }
            let mut decoded = vec![0f32; words.len()];
            half.decode_into(&words, &mut decoded);
            for (&word, &value) in words.iter().zip(&decoded) {
                assert!(value.to_bits() == half.decode(word).to_bits() || value.is_nan());
            }
            let (input, mut inout) = (words[..2500].to_vec(), words[2500..5000].to_vec());
            let want: Vec<u16> = input
                .iter()
                .zip(&inout)
                .map(|(&a, &b)| half.encode(half.decode(a) + half.decode(b)))
                .collect();
            sum_half_words(half, &input, &mut inout);
            for (i, (&got, &want)) in inout.iter().zip(&want).enumerate() {
                let same = got == want || (half.decode(got).is_nan() && half.decode(want).is_nan());
                assert!(same, "{half:?} combine {i}: {got:#06x}, scalar {want:#06x}");
            }
        }
    }

    #[test]
    fn half_sum_adds_in_f32_and_rounds_once() {
        // 1 + 2^-8 is not a bf16 (8 significant bits); the sum rounds to even: 1.0.
        let half = HalfWire::Bf16;
        let mut acc = vec![half.encode(1.0), half.encode(3.0), half.encode(f32::INFINITY)];
        let input = vec![half.encode(2f32.powi(-8)), half.encode(-1.5), half.encode(1.0)];
        sum_half_words(half, &input, &mut acc);
        let got: Vec<f32> = acc.iter().map(|&w| half.decode(w)).collect();
        assert_eq!(got, vec![1.0, 1.5, f32::INFINITY]);
        // fp16 overflows past 65504: 60000 + 60000 is infinite on the wire.
        let mut acc = vec![HalfWire::F16.encode(60000.0)];
        sum_half_words(HalfWire::F16, &[HalfWire::F16.encode(60000.0)], &mut acc);
        assert_eq!(HalfWire::F16.decode(acc[0]), f32::INFINITY);
    }

    #[test]
    fn wire_sizes_and_roundoff() {
        assert_eq!(Wire::default(), Wire::F32);
        assert_eq!((Wire::F32.bytes_per_value(), Wire::Bf16.bytes_per_value()), (4, 2));
        assert_eq!(Wire::Bf16.unit_roundoff(), 1.0 / 256.0);
        let mut values = [1.0 + 2f32.powi(-10), 3.0];
        round_trip(Wire::Bf16, &mut values);
        assert_eq!(values, [1.0, 3.0]);
    }
}
