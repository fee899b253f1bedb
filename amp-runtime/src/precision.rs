//! Floating-point formats and the facts about them that mixed precision depends on.

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Device};

use crate::error::{Error, Result};

/// A concrete floating-point format that parameters, activations and gradients can be stored in.
///
/// | format | bits | max finite | smallest normal | epsilon |
/// |---|---|---|---|---|
/// | `Fp32` | 32 | 3.4e38 | 1.2e-38 | 2^-23 |
/// | `Fp16` | 16 | 65504 | 6.1e-5 | 2^-10 |
/// | `Bf16` | 16 | 3.4e38 | 1.2e-38 | 2^-7 |
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// IEEE 754 binary32.
    Fp32,
    /// IEEE 754 binary16: 5 exponent bits, narrow range. Needs loss scaling for training.
    Fp16,
    /// bfloat16: fp32's 8 exponent bits with 7 mantissa bits. Range of fp32, no loss scaling needed.
    Bf16,
}

impl Precision {
    /// Every precision, widest first.
    pub const ALL: [Precision; 3] = [Precision::Fp32, Precision::Bf16, Precision::Fp16];

    /// The candle dtype that stores this precision.
    pub const fn dtype(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Fp16 => DType::F16,
            Precision::Bf16 => DType::BF16,
        }
    }

    /// The precision of a candle dtype, or an error for non-float dtypes and f64.
    pub fn from_dtype(dtype: DType) -> Result<Self> {
        match dtype {
            DType::F32 => Ok(Precision::Fp32),
            DType::F16 => Ok(Precision::Fp16),
            DType::BF16 => Ok(Precision::Bf16),
            other => Err(Error::UnsupportedDType { dtype: other }),
        }
    }

    /// Bytes per element.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            Precision::Fp32 => 4,
            Precision::Fp16 | Precision::Bf16 => 2,
        }
    }

    /// Largest finite value.
    pub const fn max_finite(self) -> f64 {
        match self {
            Precision::Fp32 => f32::MAX as f64,
            Precision::Fp16 => 65504.0,
            // (2 - 2^-7) * 2^127
            Precision::Bf16 => 3.389_531_389_251_535_5e38,
        }
    }

    /// Smallest positive normal value; below it values lose precision (subnormals) and then flush to 0.
    pub const fn min_positive_normal(self) -> f64 {
        match self {
            Precision::Fp32 | Precision::Bf16 => f32::MIN_POSITIVE as f64,
            Precision::Fp16 => 6.103_515_625e-5,
        }
    }

    /// Distance from 1.0 to the next representable value: the unit of relative rounding error is half of it.
    pub const fn epsilon(self) -> f64 {
        match self {
            Precision::Fp32 => f32::EPSILON as f64,
            Precision::Fp16 => 9.765_625e-4,
            Precision::Bf16 => 7.812_5e-3,
        }
    }

    /// Bits of mantissa stored explicitly.
    pub const fn mantissa_bits(self) -> u32 {
        match self {
            Precision::Fp32 => 23,
            Precision::Fp16 => 10,
            Precision::Bf16 => 7,
        }
    }

    /// True for the 16-bit formats.
    pub const fn is_half(self) -> bool {
        !matches!(self, Precision::Fp32)
    }

    /// True where gradients underflow without loss scaling (fp16's narrow exponent range).
    pub const fn needs_loss_scaling(self) -> bool {
        matches!(self, Precision::Fp16)
    }

    /// The canonical name, as written in `#[amp(...)]` attributes and policy strings.
    pub const fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
        }
    }

    /// The half type a device computes fastest: bf16 on CPU (AVX512-BF16 and f32-range safety),
    /// fp16 on CUDA (tensor cores on every generation; ask for bf16 explicitly on sm_80+).
    pub fn best_half_for(device: &Device) -> Precision {
        if device.is_cuda() {
            Precision::Fp16
        } else {
            Precision::Bf16
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

/// A precision as a user writes it: a concrete format, or `half`, "the half type this device is best at".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrecisionSpec {
    /// fp32.
    Fp32,
    /// fp16.
    Fp16,
    /// bf16.
    Bf16,
    /// The device's best half type: bf16 on CPU, fp16 on CUDA.
    Half,
}

impl PrecisionSpec {
    /// The accepted spellings, for error messages.
    pub const SPELLINGS: &'static str =
        "fp32 (f32, float32), fp16 (f16, float16), bf16 (bfloat16), half (the device's best half type)";

    /// The concrete precision, given the half type chosen for the device.
    pub const fn resolve(self, half: Precision) -> Precision {
        match self {
            PrecisionSpec::Fp32 => Precision::Fp32,
            PrecisionSpec::Fp16 => Precision::Fp16,
            PrecisionSpec::Bf16 => Precision::Bf16,
            PrecisionSpec::Half => half,
        }
    }

    /// True when this spec can resolve to fp16 on some device (`fp16` itself and `half`).
    pub const fn may_be_fp16(self) -> bool {
        matches!(self, PrecisionSpec::Fp16 | PrecisionSpec::Half)
    }

    /// True for every spec but `fp32`.
    pub const fn is_half(self) -> bool {
        !matches!(self, PrecisionSpec::Fp32)
    }

    /// The name as written in attributes.
    pub const fn name(self) -> &'static str {
        match self {
            PrecisionSpec::Fp32 => "fp32",
            PrecisionSpec::Fp16 => "fp16",
            PrecisionSpec::Bf16 => "bf16",
            PrecisionSpec::Half => "half",
        }
    }
}

impl From<Precision> for PrecisionSpec {
    fn from(p: Precision) -> Self {
        match p {
            Precision::Fp32 => PrecisionSpec::Fp32,
            Precision::Fp16 => PrecisionSpec::Fp16,
            Precision::Bf16 => PrecisionSpec::Bf16,
        }
    }
}

impl fmt::Display for PrecisionSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

impl FromStr for PrecisionSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "fp32" | "f32" | "float32" => Ok(PrecisionSpec::Fp32),
            "fp16" | "f16" | "float16" => Ok(PrecisionSpec::Fp16),
            "bf16" | "bfloat16" => Ok(PrecisionSpec::Bf16),
            "half" => Ok(PrecisionSpec::Half),
            _ => Err(Error::UnknownPrecision { given: s.to_string() }),
        }
    }
}

impl FromStr for Precision {
    type Err = Error;

    /// Parses a concrete precision; `half` is refused because it depends on the device.
    fn from_str(s: &str) -> Result<Self> {
        match s.parse::<PrecisionSpec>()? {
            PrecisionSpec::Fp32 => Ok(Precision::Fp32),
            PrecisionSpec::Fp16 => Ok(Precision::Fp16),
            PrecisionSpec::Bf16 => Ok(Precision::Bf16),
            PrecisionSpec::Half => Err(Error::HalfNeedsDevice),
        }
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;

    #[test]
    fn format_facts_match_the_half_crate() {
        assert_eq!(Precision::Fp16.max_finite(), f16::MAX.to_f64());
        assert_eq!(Precision::Bf16.max_finite(), bf16::MAX.to_f64());
        assert_eq!(Precision::Fp16.min_positive_normal(), f16::MIN_POSITIVE.to_f64());
        assert_eq!(Precision::Bf16.min_positive_normal(), bf16::MIN_POSITIVE.to_f64());
        assert_eq!(Precision::Fp16.epsilon(), f16::EPSILON.to_f64());
        assert_eq!(Precision::Bf16.epsilon(), bf16::EPSILON.to_f64());
        for p in Precision::ALL {
            assert_eq!(p.epsilon(), 2f64.powi(-(p.mantissa_bits() as i32)));
            assert_eq!(p.size_in_bytes(), p.dtype().size_in_bytes());
            assert_eq!(Precision::from_dtype(p.dtype()).unwrap(), p);
        }
    }

    #[test]
    fn spellings_parse_and_unknown_names_list_the_valid_ones() {
        assert_eq!("float16".parse::<PrecisionSpec>().unwrap(), PrecisionSpec::Fp16);
        assert_eq!("F32".parse::<PrecisionSpec>().unwrap(), PrecisionSpec::Fp32);
        assert_eq!("bfloat16".parse::<Precision>().unwrap(), Precision::Bf16);
        let err = "fp61".parse::<PrecisionSpec>().unwrap_err().to_string();
        assert!(err.contains("fp61") && err.contains("bf16 (bfloat16)"), "{err}");
        let err = "half".parse::<Precision>().unwrap_err().to_string();
        assert!(err.contains("device"), "{err}");
    }
}
