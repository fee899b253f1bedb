//! The dtype a fused optimizer keeps its state in, and what bf16 state needs: a random stream per
//! parameter for its stochastic rounding.

use super::params::OptimParam;
use crate::error::{Error, Result};

/// The dtype of a fused optimizer's state: Adam's moments ([`AdamConfig`](super::AdamConfig)), LAMB's
/// ([`LambConfig`](super::LambConfig)), SGD's momentum buffer ([`SgdConfig`](super::SgdConfig)).
///
/// `Bf16` keeps that state in bf16: half its bytes (Adam, LAMB: 4 a parameter instead of 8; SGD: 2
/// instead of 4) and a step that moves fewer. The step computes in f32 as with f32 state, on the state widened
/// exactly, and rounds it back **stochastically** (`amp_kernels::stochastic`): the small change a step
/// makes to a running average (0.1% of Adam's `v` with the default `beta2`) is below half a bf16 step,
/// so rounding to nearest would drop it and the average would stop following the gradients.
/// Stochastic rounding keeps every change in expectation, at the price of some noise per element. The
/// random bits depend on the parameter's path, the step and the element only: a run is reproducible,
/// a resumed run continues exactly, and ZeRO-1's shards draw what one optimizer would. The masters stay
/// f32. CPU only: a step on CUDA gradients is refused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum StateDtype {
    /// f32 state, as PyTorch and Apex keep it (the default).
    #[default]
    F32,
    /// bf16 state, rounded stochastically.
    Bf16,
}

impl StateDtype {
    /// Refuses bf16 state on a CUDA device (the device optimizer's tables hold f32 state).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn refuse_on_cuda(self) -> Result<()> {
        match self {
            StateDtype::F32 => Ok(()),
            StateDtype::Bf16 => Err(Error::InvalidOptimizerConfig {
                reason: "bf16 optimizer state (`state_dtype: StateDtype::Bf16`) is stepped on the CPU only; \
                         these gradients are on a CUDA device: use `StateDtype::F32` there"
                    .into(),
            }),
        }
    }
}

/// Each parameter's random stream for stochastic rounding: FNV-1a of its path, the same in every run
/// and on every rank (ZeRO-1 shards whole parameters).
pub(crate) fn streams(params: &[OptimParam]) -> Vec<u64> {
    let fnv = |path: &str| {
        path.bytes().fold(0xCBF2_9CE4_8422_2325u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01B3)
        })
    };
    params.iter().map(|p| fnv(&p.path)).collect()
}
