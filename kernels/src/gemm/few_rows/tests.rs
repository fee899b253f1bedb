use half::{bf16, f16};

use super::*;
use crate::gemm::MatRef;

/// xorshift64*: values for the kernels, with specials among them when asked.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn value(&mut self, special: bool) -> f32 {
        let unit = (self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        if !special {
            return unit * 8.0;
        }
        match self.next() % 16 {
            0 => f32::INFINITY,
            1 => f32::NEG_INFINITY,
            2 => f32::NAN,
            3 => -0.0,
            4 => f32::from_bits(0x0000_0001 + (self.next() as u32 & 0xFFFF)),
            5 => f32::MAX / 2.0,
            6 => unit * 2f32.powi(-120),
            _ => unit * 8.0,
        }
    }
}

fn same(x: f32, y: f32) -> bool {
    x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan())
}

/// Every tile shape of `kernel`, every `k` tail, B in `E`: the kernel's sums are the portable ones.
fn assert_tiles_match_portable<K: RowFma, E: Element>(kernel: K, name: &str, from_f32: fn(f32) -> E) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for left in 1..=MAX_ROWS {
        let shape = kernel.shape(left);
        for k in [32, 33, 40, 47, 48, 63, 100, 257] {
            for special in [false, true] {
                let a: Vec<Vec<f32>> =
                    (0..shape.rows).map(|_| (0..k).map(|_| rng.value(special)).collect()).collect();
                let b: Vec<Vec<E>> =
                    (0..shape.cols).map(|_| (0..k).map(|_| from_f32(rng.value(special))).collect()).collect();
                let a_ptr: Vec<*const f32> = a.iter().map(|row| row.as_ptr()).collect();
                let b_ptr: Vec<*const E> = b.iter().map(|col| col.as_ptr()).collect();
                // SAFETY: the shape is the kernel's, every row and column holds `k` values.
                let sums = unsafe { kernel.tile(shape, k, &a_ptr, &b_ptr) };
                for (r, row) in a.iter().enumerate() {
                    for (c, col) in b.iter().enumerate() {
                        let (got, want) = (sums[r * shape.cols + c], dot(row, col));
                        assert!(
                            same(got, want),
                            "{name} {shape:?} k {k} special {special} ({r}, {c}): {got:e} ({:#010x}), \
                             portable {want:e} ({:#010x})",
                            got.to_bits(),
                            want.to_bits()
                        );
                    }
                }
            }
        }
    }
}

fn check_kernel<K: RowFma>(kernel: K, name: &str) {
    assert_tiles_match_portable(kernel, name, |x| x);
    assert_tiles_match_portable(kernel, name, bf16::from_f32);
    assert_tiles_match_portable(kernel, name, f16::from_f32);
}

#[test]
fn the_x86_kernels_sum_as_the_portable_one_bit_for_bit() {
    #[cfg(target_arch = "x86_64")]
    {
        match RowFmaAvx512::new() {
            Some(kernel) => check_kernel(kernel, "zmm"),
            None => eprintln!("skipped zmm: this CPU has no avx512f; the portable kernel's tests still run"),
        }
        match RowFmaAvx2::new() {
            Some(kernel) => check_kernel(kernel, "ymm"),
            None => eprintln!("skipped ymm: this CPU has no avx2"),
        }
    }
    // The portable kernel against itself through its own tiles (it sums an element at a time).
    check_kernel(RowFmaPortable, "portable");
}

#[test]
fn the_sums_run_in_sixteen_lanes_added_pairwise() {
    // k = 0 and k = 1 in lanes 0 and 1; k = 16 back in lane 0. In `k` order, 2^24 + 1 rounds back to
    // 2^24 and the sum is 0; in lanes, lane 0 cancels to 0 and lane 1 holds the 1.
    let mut b = vec![0.0f32; 32];
    (b[0], b[1], b[16]) = (2f32.powi(24), 1.0, -(2f32.powi(24)));
    assert_eq!(dot(&[1.0; 32], &b), 1.0);
    // Lanes 0, 4 and 8: pairwise, lane 0 meets lane 8 first (2^24 + 1 rounds to 2^24), then lane 4's
    // -2^24: 0. Lane by lane in order it would be 1 - 2^24 + 2^24 = 1.
    let mut b = vec![0.0f32; 32];
    (b[0], b[4], b[8]) = (1.0, -(2f32.powi(24)), 2f32.powi(24));
    assert_eq!(dot(&[1.0; 32], &b), 0.0);
    // The kernels sum as `dot` does: the test above.
}

#[test]
fn only_operands_b_of_an_exact_type_along_k_and_few_rows_of_a_long_enough_k_are_read_in_place() {
    let len = 64 * 1024;
    let (w32, w16, wh) = (vec![0.0f32; len], vec![bf16::ZERO; len], vec![f16::ZERO; len]);
    let dims = |m, k| Dims::new(m, 64, k);
    fn along_k<'a>(data: impl Into<GradSlice<'a>>, k: usize) -> MatRef<'a> {
        MatRef::transposed(data, k)
    }
    let k = 1024;
    assert!(reads(Compute::F32, dims(1, k), &along_k(&w32[..], k)));
    assert!(reads(Compute::F32, dims(MAX_ROWS_F32, k), &along_k(&w32[..], k)));
    assert!(reads(Compute::F32, dims(MAX_ROWS, k), &along_k(&w16[..], k)));
    assert!(reads(Compute::Bf16, dims(4, k), &along_k(&w16[..], k)));
    assert!(reads(Compute::F16, dims(4, k), &along_k(&wh[..], k)));
    // B that would need rounding: f32 for a half product, one half type for the other.
    assert!(!reads(Compute::Bf16, dims(4, k), &along_k(&w32[..], k)));
    assert!(!reads(Compute::F16, dims(4, k), &along_k(&w16[..], k)));
    assert!(!reads(Compute::Bf16, dims(4, k), &along_k(&wh[..], k)));
    // Too many rows, B along `n`.
    assert!(!reads(Compute::F32, dims(MAX_ROWS_F32 + 1, k), &along_k(&w32[..], k)));
    assert!(!reads(Compute::Bf16, dims(MAX_ROWS + 1, k), &along_k(&w16[..], k)));
    assert!(!reads(Compute::F32, dims(4, k), &MatRef::row_major(&w32[..], 64)));
    // `k` of K_PER_ROW for each row.
    for m in [1, 2, 4, 8] {
        let (enough, short) = (K_PER_ROW * m, K_PER_ROW * m - 1);
        assert!(reads(Compute::F32, dims(m, enough), &along_k(&w32[..], enough)), "{m} rows");
        assert!(!reads(Compute::F32, dims(m, short), &along_k(&w32[..], short)), "{m} rows");
    }
}
