//! `amp_sum_squares` and `amp_norm_finish` (norm.cu): norms within 1 ulp of the reference (f64 sums in
//! another order), the clip factor and the bad-tensor flag bit for bit.

use amp_kernels::clip::clip_coefficient;
use amp_kernels::cuda::{BLOCK_THREADS, NO_BAD_TENSOR};
use amp_kernels::{reference, Dtype};

use crate::common::{views, Owned, Rng};
use crate::data::{gradients, ulps};
use crate::harness::{emulator, Emulator};
use crate::launch::Shared;
use crate::tables::grads_table;

/// What `amp_norm_finish` writes.
struct Norms {
    per_tensor: Vec<f32>,
    norm: f32,
    factor: f32,
}

fn global_norm(
    emu: &Emulator,
    grads: &mut [Owned],
    lists: usize,
    inv_scale: f32,
    max_norm: f32,
    with_per_tensor: bool,
    bad: &mut i32,
) -> Norms {
    type SumSquares = unsafe extern "C" fn(*const u64, i32, i32, *mut f64, *mut i32);
    type Finish =
        unsafe extern "C" fn(*const u64, i32, *const f64, *const f32, f32, *mut f32, *mut f32, *mut i32);
    let m = emu.module("norm");
    // SAFETY: the signatures in norm.cu.
    let (sum_squares, finish): (SumSquares, Finish) =
        unsafe { (m.kernel("amp_sum_squares"), m.kernel("amp_norm_finish")) };
    let table = grads_table(grads, lists);
    let mut partials = vec![f64::NAN; table.blocks()];
    let mut per_tensor = vec![f32::NAN; table.tensors()];
    let mut out = [f32::NAN; 2];
    let (words, first_block, n, lists) = (table.words(), table.first_block(), table.n(), table.lists());
    let (partials_p, bad) = (Shared::new(partials.as_mut_ptr()), Shared::new(bad));
    m.launch(table.blocks(), BLOCK_THREADS, &|| {
        // SAFETY: the table holds the addresses, lengths and types of `grads` (read only); `partials` has
        // a slot per block; `bad` is a live borrow.
        unsafe { sum_squares(words.get(), n, lists, partials_p.get(), bad.get()) }
    });
    // The per-tensor output may be null.
    let per = if with_per_tensor { Shared::new(per_tensor.as_mut_ptr()) } else { Shared::null() };
    let (inv, out_p) = (Shared::new(&inv_scale), Shared::new(out.as_mut_ptr()));
    m.launch(1, BLOCK_THREADS, &|| {
        // SAFETY: `first_block` has n + 1 entries, `partials` one per block, `per_tensor` n, `out` 2.
        unsafe {
            finish(
                first_block.get(),
                n,
                partials_p.get(),
                inv.get(),
                max_norm,
                per.get(),
                out_p.get(),
                bad.get(),
            )
        }
    });
    Norms { per_tensor, norm: out[0], factor: out[1] }
}

#[test]
fn norms_and_clip_factor_match_the_reference() {
    let Some(emu) = emulator() else { return };
    let mut rng = Rng(3);
    let mut grads = gradients(&mut rng, -6, 6, 256.0);
    let inv_scale = 1.0 / 300.0;
    let mut per = vec![0.0; grads.len()];
    let want = reference::l2_norms(&views(&grads), inv_scale, &mut per);

    let mut bad = NO_BAD_TENSOR;
    let got = global_norm(emu, &mut grads, 3, inv_scale, 0.0, true, &mut bad);
    assert_eq!(bad, NO_BAD_TENSOR);
    let mut exact = 0;
    for (t, (&g, &w)) in got.per_tensor.iter().zip(&per).enumerate() {
        assert!(ulps(g, w) <= 1, "tensor {t}: norm {g:e} vs reference {w:e}");
        exact += usize::from(g == w);
    }
    assert!(ulps(got.norm, want) <= 1, "global norm {:e} vs reference {want:e}", got.norm);
    eprintln!("norms: {exact} of {} per-tensor norms bit-identical, global: {}", per.len(), got.norm == want);
    assert_eq!(per[3], 0.0, "the empty tensor");
    assert_eq!(got.per_tensor[3], 0.0, "the empty tensor");
    assert_eq!(got.factor.to_bits(), inv_scale.to_bits(), "no clipping: the factor is inv_scale");

    // Clipping: the factor is inv_scale times the CPU's coefficient of the kernel's own norm.
    let norm = got.norm;
    for max_norm in [norm * 0.999, norm * 4.0] {
        let clipped = global_norm(emu, &mut grads, 1, inv_scale, max_norm, false, &mut bad);
        assert_eq!(clipped.norm.to_bits(), norm.to_bits(), "deterministic");
        assert!(clipped.per_tensor.iter().all(|x| x.is_nan()), "a null per_tensor is not written");
        let want = inv_scale * clip_coefficient(norm, max_norm);
        assert_eq!(clipped.factor.to_bits(), want.to_bits(), "factor for max_norm {max_norm}");
    }
    assert_eq!(bad, NO_BAD_TENSOR);

    // A norm that overflows f32 while every element is finite marks n (stage 2), unless a smaller index
    // is already marked. A small table: three tensors, two blocks.
    let mut grads = vec![
        Owned::new(Dtype::Bf16, &rng.vec(10, -6, 6)),
        Owned::new(Dtype::F32, &rng.vec(20, -6, 6)),
        Owned::new(Dtype::F16, &[]),
    ];
    grads[1].set(10, 3e38);
    grads[1].set(19, -3e38);
    assert_eq!(reference::find_non_finite(&views(&grads)), None);
    let mut bad = NO_BAD_TENSOR;
    let got = global_norm(emu, &mut grads, 1, 1.0, 1.0, true, &mut bad);
    assert_eq!(got.norm, f32::INFINITY);
    assert_eq!(bad, 3, "an overflowing norm sets bad_tensor = n");
    let mut bad = 2;
    let _ = global_norm(emu, &mut grads, 1, 1.0, 1.0, true, &mut bad);
    assert_eq!(bad, 2, "the smallest index wins");

    // A non-finite element marks its tensor (stage 1).
    grads[0].set(9, f32::NAN);
    let mut bad = NO_BAD_TENSOR;
    let got = global_norm(emu, &mut grads, 2, 1.0, 1.0, true, &mut bad);
    assert!(got.norm.is_nan() && got.per_tensor[0].is_nan());
    assert_eq!(bad, 0);
}
