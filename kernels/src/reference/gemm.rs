//! The f64 reference of [`crate::gemm`], with the error bound a correct f32-accumulating kernel meets.

use half::{bf16, f16};

use super::get;
use crate::gemm::{Compute, Dims, MatRef};
use crate::Dtype;

/// The exact product of the operands rounded to the compute precision (summed in f64), and the data
/// of the error bound.
#[derive(Clone, Debug)]
pub struct GemmReference {
    /// `batch x m x n`, row-major: `sum_k round(a) * round(b)` in f64.
    pub c: Vec<f64>,
    /// `batch x m x n`: `sum_k |round(a) * round(b)|`.
    pub abs: Vec<f64>,
    /// The summed dimension.
    pub k: usize,
}

impl GemmReference {
    /// The bound on `|C - (initial + C_ref)|` for element `i` of a kernel that starts from `initial` (C
    /// itself when accumulating, else 0) and adds `k` exact products in f32, one rounding per addition
    /// (an FMA chain, `vdpbf16ps` included): `gamma_k (|initial| + sum|a b|)` with
    /// `gamma_k = k u / (1 - k u)`, `u = 2^-24` (Higham, Accuracy and Stability of Numerical Algorithms,
    /// eq. 3.5), plus `k * 2^-126` for partial sums flushed to zero, plus the final rounding to the
    /// output dtype `out`: its unit roundoff relative to the result (2^-24 f32, 2^-11 f16, 2^-8 bf16), or
    /// half its smallest subnormal step where the result is subnormal there (2^-150, 2^-25, 2^-134).
    #[must_use]
    pub fn bound(&self, i: usize, initial: f64, out: Dtype) -> f64 {
        let u = 2f64.powi(-24);
        let k = self.k as f64;
        let gamma = k * u / (1.0 - k * u);
        let sum_bound = gamma * (initial.abs() + self.abs[i]) + k * 2f64.powi(-126);
        let (unit, tiny) = match out {
            Dtype::F32 => (2f64.powi(-24), 2f64.powi(-150)),
            Dtype::F16 => (2f64.powi(-11), 2f64.powi(-25)),
            Dtype::Bf16 => (2f64.powi(-8), 2f64.powi(-134)),
        };
        sum_bound + unit * ((initial + self.c[i]).abs() + sum_bound) + tiny
    }
}

/// Element `(b, i, j)` of an operand, rounded to `compute`.
fn element(x: &MatRef<'_>, (b, i, j): (usize, usize, usize), compute: Compute) -> f64 {
    let v = get(x.data, b * x.batch_stride + i * x.row_stride + j * x.col_stride);
    f64::from(match compute {
        Compute::F32 => v,
        Compute::F16 => f16::from_f32(v).to_f32(),
        Compute::Bf16 => bf16::from_f32(v).to_f32(),
    })
}

/// `A·B` of operands rounded to `compute`, in f64, one element at a time.
#[must_use]
pub fn gemm(dims: Dims, a: MatRef<'_>, b: MatRef<'_>, compute: Compute) -> GemmReference {
    let Dims { batch, m, n, k } = dims;
    let mut c = Vec::with_capacity(batch * m * n);
    let mut abs = Vec::with_capacity(batch * m * n);
    for bi in 0..batch {
        for i in 0..m {
            for j in 0..n {
                let (mut sum, mut sum_abs) = (0.0f64, 0.0f64);
                for kk in 0..k {
                    let p = element(&a, (bi, i, kk), compute) * element(&b, (bi, kk, j), compute);
                    sum += p;
                    sum_abs += p.abs();
                }
                c.push(sum);
                abs.push(sum_abs);
            }
        }
    }
    GemmReference { c, abs, k }
}
