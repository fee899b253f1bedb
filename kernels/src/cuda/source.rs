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
/// Each multi-tensor kernel handles f32, f16 and bf16 gradients (and f16 / bf16 working copies) in one
/// launch, switching per block on the types the table records.
pub const FAMILIES: [Family; 6] = [
    family!("unscale", ["amp_unscale", "amp_find_non_finite"]),
    family!("norm", ["amp_sum_squares", "amp_norm_finish"]),
    family!("adam", ["amp_adam"]),
    family!("sgd", ["amp_sgd"]),
    family!("lamb", ["amp_lamb_moments", "amp_lamb_ratios", "amp_lamb_apply"]),
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

    /// An `extern "C"` definition of `kernel`: its name, then `(`, within a few lines of `extern "C"`.
    fn defines(source: &str, kernel: &str) -> bool {
        source.match_indices(&format!("{kernel}(")).any(|(at, _)| {
            let boundary = source[..at].ends_with(|c: char| c.is_whitespace());
            let window = &source[at.saturating_sub(120)..at];
            boundary && window.contains("extern \"C\"")
        })
    }
}
