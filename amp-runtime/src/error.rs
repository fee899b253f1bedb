//! The runtime's error type: one enum, grouped by concern, each message saying what to do.

use candle_core::DType;

/// Errors of the amp runtime.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // ---- precisions and policies ----
    /// A precision name that is not one of the accepted spellings.
    #[error("unknown precision `{given}`: expected one of {}", crate::PrecisionSpec::SPELLINGS)]
    UnknownPrecision {
        /// What was given.
        given: String,
    },
    /// `half` where a concrete precision is needed.
    #[error("`half` means the device's best half type and needs a device to resolve; write fp16 or bf16, or resolve it with `PrecisionSpec::resolve`")]
    HalfNeedsDevice,
    /// A dtype that has no mixed-precision meaning.
    #[error("dtype {dtype:?} is not a training precision: amp works with f32, f16 and bf16")]
    UnsupportedDType {
        /// The dtype found.
        dtype: DType,
    },
    /// A policy string that could not be parsed.
    #[error("invalid policy `{policy}`: {reason}")]
    InvalidPolicy {
        /// The whole policy string.
        policy: String,
        /// What is wrong, and where.
        reason: String,
    },
    /// An optimisation level name that is not O0..O3.
    #[error("unknown optimisation level `{given}`: expected O0, O1, O2 or O3")]
    UnknownOptLevel {
        /// What was given.
        given: String,
    },

    // ---- tensors ----
    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// The runtime's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<Error> for candle_core::Error {
    fn from(err: Error) -> Self {
        match err {
            Error::Candle(inner) => inner,
            other => candle_core::Error::wrap(other),
        }
    }
}
