//! Precision policies (`params=fp32,compute=bf16,output=fp32`) and Apex's O0-O3 presets.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::{Precision, PrecisionSpec};

/// Which precision parameters are stored in, computed in, and returned in (the jmp/Haiku policy triple).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Policy {
    /// Storage of the trainable parameters.
    pub params: PrecisionSpec,
    /// Precision of the layer's arithmetic (matmuls accumulate in f32 whatever this is).
    pub compute: PrecisionSpec,
    /// Precision of the layer's output.
    pub output: PrecisionSpec,
}

impl Policy {
    /// Everything fp32.
    pub const FP32: Policy = Policy::uniform(PrecisionSpec::Fp32);

    /// One precision for everything.
    pub const fn uniform(spec: PrecisionSpec) -> Self {
        Policy { params: spec, compute: spec, output: spec }
    }

    /// Parses a policy string.
    ///
    /// Accepted: a comma-separated list of `key=precision` with keys `params`/`p`, `compute`/`c`,
    /// `output`/`o` (missing keys are fp32), or a single precision name that applies to all three.
    ///
    /// ```
    /// use amp_runtime::{Policy, PrecisionSpec};
    /// let policy: Policy = "p=f32,c=bf16,o=f32".parse()?;
    /// assert_eq!(policy.compute, PrecisionSpec::Bf16);
    /// assert_eq!("half".parse::<Policy>()?, Policy::uniform(PrecisionSpec::Half));
    /// # Ok::<(), amp_runtime::Error>(())
    /// ```
    pub fn parse(policy: &str) -> Result<Self> {
        let invalid = |reason: String| Error::InvalidPolicy { policy: policy.to_string(), reason };
        let trimmed = policy.trim();
        if trimmed.is_empty() {
            return Err(invalid("it is empty; write e.g. `params=fp32,compute=bf16,output=fp32`".into()));
        }
        if !trimmed.contains('=') {
            let spec = trimmed.parse::<PrecisionSpec>().map_err(|e| invalid(e.to_string()))?;
            return Ok(Policy::uniform(spec));
        }
        let mut slots: [Option<PrecisionSpec>; 3] = [None; 3];
        for (index, item) in trimmed.split(',').enumerate() {
            let item = item.trim();
            let (key, value) = item.split_once('=').ok_or_else(|| {
                invalid(format!("item {} (`{item}`) is not of the form key=precision", index + 1))
            })?;
            let slot = match key.trim() {
                "params" | "param" | "p" => 0,
                "compute" | "c" => 1,
                "output" | "o" => 2,
                other => {
                    return Err(invalid(format!(
                        "unknown key `{other}` in item {}: expected params (p), compute (c) or output (o)",
                        index + 1
                    )))
                }
            };
            if slots[slot].is_some() {
                return Err(invalid(format!("`{}` is given twice", ["params", "compute", "output"][slot])));
            }
            let spec = value.parse::<PrecisionSpec>().map_err(|e| invalid(format!("in `{item}`: {e}")))?;
            slots[slot] = Some(spec);
        }
        let [params, compute, output] = slots.map(|s| s.unwrap_or(PrecisionSpec::Fp32));
        Ok(Policy { params, compute, output })
    }
}

impl FromStr for Policy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Policy::parse(s)
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "params={},compute={},output={}", self.params, self.compute, self.output)
    }
}

/// Apex's optimisation levels.
///
/// | level | parameters | compute of half-safe layers | layer outputs | fp32 masters | norms | loss scale |
/// |---|---|---|---|---|---|---|
/// | O0 | fp32 | fp32 (attributes ignored: the baseline) | fp32 | no | fp32 | none |
/// | O1 | fp32 | half, weights cast at use | fp32 | (params are fp32) | fp32 | dynamic |
/// | O2 | half working copies | half | fp32 | yes | fp32 | dynamic |
/// | O3 | half | half | half | no | fp32 (amp never runs norms in half) | static 1.0 |
///
/// Unlike Apex O2, which keeps activations half between layers and casts only the model's output, O1
/// and O2 hand each half layer's output on in fp32 (the policy's `output`): elementwise ops and
/// activation gradients stay f32, and only the products run in half.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum OptLevel {
    /// Pure fp32: the accuracy baseline.
    O0,
    /// Mixed precision by casting at each op: parameters stay fp32.
    O1,
    /// "Almost fp16": half model, fp32 master weights, fp32 norms.
    O2,
    /// Pure half: fastest, least safe; for speed baselines.
    O3,
}

/// How a level wants the loss scaled (the scaler itself is `amp::scaler`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossScaling {
    /// No scaling (fp32, or a scale of 1.0).
    None,
    /// Dynamic scaling, needed only where fp16 appears.
    Dynamic,
}

impl OptLevel {
    /// Every level.
    pub const ALL: [OptLevel; 4] = [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3];

    /// The policy of layers that carry no attribute of their own.
    pub const fn policy(self) -> Policy {
        let half = PrecisionSpec::Half;
        let fp32 = PrecisionSpec::Fp32;
        match self {
            OptLevel::O0 => Policy::FP32,
            OptLevel::O1 => Policy { params: fp32, compute: half, output: fp32 },
            OptLevel::O2 => Policy { params: half, compute: half, output: fp32 },
            OptLevel::O3 => Policy::uniform(half),
        }
    }

    /// True where half layers keep an fp32 master copy that the optimizer updates.
    pub const fn master_weights(self) -> bool {
        matches!(self, OptLevel::O2)
    }

    /// True where parameters of half layers are stored in half.
    pub const fn half_parameters(self) -> bool {
        matches!(self, OptLevel::O2 | OptLevel::O3)
    }

    /// True where attributes are honoured (every level but the fp32 baseline).
    pub const fn mixed(self) -> bool {
        !matches!(self, OptLevel::O0)
    }

    /// The loss scaling this level uses when fp16 is present.
    pub const fn loss_scaling(self) -> LossScaling {
        match self {
            OptLevel::O1 | OptLevel::O2 => LossScaling::Dynamic,
            OptLevel::O0 | OptLevel::O3 => LossScaling::None,
        }
    }
}

impl fmt::Display for OptLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            OptLevel::O0 => "O0",
            OptLevel::O1 => "O1",
            OptLevel::O2 => "O2",
            OptLevel::O3 => "O3",
        })
    }
}

impl FromStr for OptLevel {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "O0" | "o0" | "0" => Ok(OptLevel::O0),
            "O1" | "o1" | "1" => Ok(OptLevel::O1),
            "O2" | "o2" | "2" => Ok(OptLevel::O2),
            "O3" | "o3" | "3" => Ok(OptLevel::O3),
            other => Err(Error::UnknownOptLevel { given: other.to_string() }),
        }
    }
}

/// An optimisation level with the half type it resolves `half` to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AmpConfig {
    /// The Apex level.
    pub opt_level: OptLevel,
    /// What `half` means here: bf16 on CPU, fp16 on CUDA by default.
    pub half: Precision,
}

impl AmpConfig {
    /// The level with the device's best half type.
    pub fn new(opt_level: OptLevel, device: &candle_core::Device) -> Self {
        AmpConfig { opt_level, half: Precision::best_half_for(device) }
    }

    /// The same level with `half` meaning `half`.
    pub fn with_half(self, half: Precision) -> Self {
        AmpConfig { half, ..self }
    }

    /// The precision activations leave layers in (the policy's output).
    pub fn activation_precision(&self) -> Precision {
        self.opt_level.policy().output.resolve(self.half)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_and_short_forms_parse_to_the_same_policy() {
        let long: Policy = "params=fp32,compute=bf16,output=fp32".parse().unwrap();
        let short: Policy = "p=f32,c=bf16,o=f32".parse().unwrap();
        assert_eq!(long, short);
        assert_eq!(long.to_string(), "params=fp32,compute=bf16,output=fp32");
        assert_eq!(long.to_string().parse::<Policy>().unwrap(), long);
        assert_eq!("float16".parse::<Policy>().unwrap(), Policy::uniform(PrecisionSpec::Fp16));
        assert_eq!("c=half".parse::<Policy>().unwrap().params, PrecisionSpec::Fp32);
    }

    #[test]
    fn policy_errors_say_which_part_is_wrong() {
        let cases = [
            ("", "empty"),
            ("p=f32,c=fp61", "`c=fp61`: unknown precision `fp61`"),
            ("p=f32,x=bf16", "unknown key `x` in item 2"),
            ("p=f32,p=bf16", "`params` is given twice"),
            ("p=f32,bf16", "item 2 (`bf16`) is not of the form key=precision"),
            ("fp8", "unknown precision `fp8`"),
        ];
        for (input, expected) in cases {
            let err = input.parse::<Policy>().unwrap_err().to_string();
            assert!(err.contains(expected), "{input:?} gave {err:?}, expected it to contain {expected:?}");
        }
    }

    #[test]
    fn presets_follow_apex() {
        assert_eq!(OptLevel::O0.policy(), Policy::FP32);
        assert_eq!(OptLevel::O1.policy().to_string(), "params=fp32,compute=half,output=fp32");
        assert!(OptLevel::O2.master_weights() && !OptLevel::O3.master_weights());
        assert_eq!(OptLevel::O3.policy(), Policy::uniform(PrecisionSpec::Half));
        assert_eq!(OptLevel::O2.loss_scaling(), LossScaling::Dynamic);
        assert_eq!("o2".parse::<OptLevel>().unwrap(), OptLevel::O2);
        assert!("O4".parse::<OptLevel>().unwrap_err().to_string().contains("O0, O1, O2 or O3"));
        let cpu = AmpConfig::new(OptLevel::O2, &candle_core::Device::Cpu);
        assert_eq!(cpu.half, Precision::Bf16);
        assert_eq!(cpu.activation_precision(), Precision::Fp32);
    }
}
