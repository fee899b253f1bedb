//! The embedded CUDA sources and the names of their kernels.

/// Threads per block of every multi-tensor kernel (`AMP_THREADS` in `common.cuh`): block reductions are
/// fixed trees over this many lanes, so it is part of what makes sums deterministic.
pub const BLOCK_THREADS: u32 = 512;

/// The value of the device flag when every value of the step was finite (`AMP_NO_BAD_TENSOR`).
pub const NO_BAD_TENSOR: i32 = i32::MAX;

const COMMON: &str = include_str!("source/common.cuh");

/// One family of kernels: one `.cu` file, compiled as one NVRTC program.
#[derive(Clone, Copy, Debug)]
pub struct Family {
    /// The file's stem, e.g. `"adam"`.
    pub name: &'static str,
    body: &'static str,
    /// Every `extern "C"` kernel the family defines.
    pub kernels: &'static [&'static str],
}

impl Family {
    /// The complete program NVRTC compiles: the shared definitions, then the family's file.
    #[must_use]
    pub fn source(&self) -> String {
        format!("{COMMON}\n// ---- {}.cu ----\n{}", self.name, self.body)
    }
}

macro_rules! family {
    ($name:literal, [$($kernel:literal),* $(,)?]) => {
        Family {
            name: $name,
            body: include_str!(concat!("source/", $name, ".cu")),
            kernels: &[$($kernel),*],
        }
    };
}

/// Every kernel family, in dependency order of a step: unscale / check, norms, optimizers, scale update.
pub const FAMILIES: [Family; 6] = [
    family!(
        "unscale",
        [
            "amp_unscale_f32",
            "amp_unscale_f16",
            "amp_unscale_bf16",
            "amp_find_non_finite_f32",
            "amp_find_non_finite_f16",
            "amp_find_non_finite_bf16",
        ]
    ),
    family!(
        "norm",
        ["amp_sum_squares_f32", "amp_sum_squares_f16", "amp_sum_squares_bf16", "amp_norm_finish"]
    ),
    family!(
        "adam",
        [
            "amp_adam_f32_f16",
            "amp_adam_f32_bf16",
            "amp_adam_f16_f16",
            "amp_adam_f16_bf16",
            "amp_adam_bf16_f16",
            "amp_adam_bf16_bf16",
        ]
    ),
    family!(
        "sgd",
        [
            "amp_sgd_f32_f16",
            "amp_sgd_f32_bf16",
            "amp_sgd_f16_f16",
            "amp_sgd_f16_bf16",
            "amp_sgd_bf16_f16",
            "amp_sgd_bf16_bf16",
        ]
    ),
    family!(
        "lamb",
        [
            "amp_lamb_moments_f32",
            "amp_lamb_moments_f16",
            "amp_lamb_moments_bf16",
            "amp_lamb_ratios",
            "amp_lamb_apply_f16",
            "amp_lamb_apply_bf16",
        ]
    ),
    family!("scale", ["amp_scale_update", "amp_count_step", "amp_mark_skipped"]),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_constants_match_the_device_definitions() {
        assert!(COMMON.contains(&format!("#define AMP_THREADS {BLOCK_THREADS}\n")));
        assert!(COMMON.contains(&format!("#define AMP_NO_BAD_TENSOR {NO_BAD_TENSOR:#x}\n")));
        assert!(BLOCK_THREADS.is_power_of_two(), "the block reductions halve the lanes");
    }

    #[test]
    fn every_listed_kernel_is_defined_by_its_family() {
        for family in FAMILIES {
            let source = family.source();
            for kernel in family.kernels {
                assert!(defines(&source, kernel), "{}.cu does not define {kernel}", family.name);
            }
        }
    }

    /// Written out, or stamped by a macro: `amp_adam_f16_bf16` from `amp_adam_##NAME` and `(f16_bf16, ...)`.
    fn defines(source: &str, kernel: &str) -> bool {
        source.contains(&format!("void {kernel}("))
            || source.contains(&format!("void __launch_bounds__(AMP_THREADS) {kernel}("))
            || source.match_indices("_##NAME").any(|(at, _)| {
                let start =
                    source[..at].rfind(|c: char| !(c.is_alphanumeric() || c == '_')).map_or(0, |i| i + 1);
                let prefix = &source[start..at];
                kernel
                    .strip_prefix(prefix)
                    .and_then(|rest| rest.strip_prefix('_'))
                    .is_some_and(|name| source.contains(&format!("\n{}({name}, ", family_macro(source, at))))
            })
    }

    /// The name of the macro whose body holds the `##NAME` at `at`: the last `#define X(` before it.
    fn family_macro(source: &str, at: usize) -> &str {
        let define = source[..at].rfind("#define ").map_or(0, |i| i + "#define ".len());
        let end = source[define..].find('(').map_or(define, |i| define + i);
        &source[define..end]
    }
}
