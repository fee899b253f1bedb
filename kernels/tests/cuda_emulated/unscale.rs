//! `amp_unscale` and `amp_find_non_finite` (unscale.cu): unscaled gradients and the bad-tensor flag, bit
//! for bit.

use amp_kernels::cuda::{BLOCK_THREADS, NO_BAD_TENSOR};
use amp_kernels::reference;

use crate::common::{assert_same_owned, views, views_mut, Owned, Rng};
use crate::data::gradients;
use crate::harness::{emulator, Emulator};
use crate::launch::Shared;
use crate::tables::grads_table;

fn unscale(emu: &Emulator, grads: &mut [Owned], lists: usize, inv_scale: f32, bad: &mut i32) {
    type Kernel = unsafe extern "C" fn(*const u64, i32, i32, *const f32, *mut i32);
    let m = emu.module("unscale");
    // SAFETY: amp_unscale's signature in unscale.cu.
    let kernel: Kernel = unsafe { m.kernel("amp_unscale") };
    let table = grads_table(grads, lists);
    let (words, n, lists) = (table.words(), table.n(), table.lists());
    let (inv, bad) = (Shared::new(&inv_scale), Shared::new(bad));
    m.launch(table.blocks(), BLOCK_THREADS, &|| {
        // SAFETY: the table holds the addresses, lengths and types of `grads`, borrowed mutably for the
        // launch; the other pointers are live borrows.
        unsafe { kernel(words.get(), n, lists, inv.get(), bad.get()) }
    });
}

fn find_non_finite(emu: &Emulator, grads: &mut [Owned], lists: usize, bad: &mut i32) {
    type Kernel = unsafe extern "C" fn(*const u64, i32, i32, *mut i32);
    let m = emu.module("unscale");
    // SAFETY: amp_find_non_finite's signature in unscale.cu.
    let kernel: Kernel = unsafe { m.kernel("amp_find_non_finite") };
    let table = grads_table(grads, lists);
    let (words, n, lists) = (table.words(), table.n(), table.lists());
    let bad = Shared::new(bad);
    m.launch(table.blocks(), BLOCK_THREADS, &|| {
        // SAFETY: as in `unscale`.
        unsafe { kernel(words.get(), n, lists, bad.get()) }
    });
}

/// The device flag's value for the reference's first non-finite tensor.
fn bad_of(tensor: Option<usize>) -> i32 {
    tensor.map_or(NO_BAD_TENSOR, |t| i32::try_from(t).expect("tensor index"))
}

fn check_unscale(emu: &Emulator, grads: &[Owned], inv_scale: f32, lists: usize, bad_before: i32, want: i32) {
    let what = format!("inv_scale {inv_scale:e}, {lists} lists, bad_tensor {bad_before} before");
    let mut expected = grads.to_vec();
    let reference = reference::unscale_and_check(&mut views_mut(&mut expected), inv_scale);
    assert_eq!(bad_of(reference).min(bad_before), want, "{what}: the scenario is not what it should be");
    let mut got = grads.to_vec();
    let mut bad = bad_before;
    unscale(emu, &mut got, lists, inv_scale, &mut bad);
    for (t, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert_same_owned(&format!("{what}: tensor {t}"), g, e);
    }
    assert_eq!(bad, want, "{what}: bad_tensor");
}

#[test]
fn unscale_matches_the_reference() {
    let Some(emu) = emulator() else { return };
    let mut rng = Rng(1);
    // Finite: 2^-30 .. 2^5 times 1024, with an inexact inverse scale; unscaling reaches f16 subnormals
    // and zeros. A 6-list table: the kernel finds the types after `lists` address lists.
    let grads = gradients(&mut rng, -30, 4, 1024.0);
    check_unscale(emu, &grads, 1.0 / 3000.0, 6, NO_BAD_TENSOR, NO_BAD_TENSOR);

    // Rounding to f16 overflows: 32752 * 2 = 65504 is the largest f16 (kept finite, tensor 2's
    // single-element second block), 32768 * 2 = 65536 rounds to infinity although finite in f32
    // (tensor 4). 1e38 * 2 stays finite in f32 and bf16.
    let mut grads = gradients(&mut rng, -30, 4, 1.0);
    grads[2].set(1000, 32752.0);
    grads[6].set(63, 1e38);
    grads[1].set(5, 1e38);
    grads[4].set(6, 32768.0);
    check_unscale(emu, &grads, 2.0, 1, NO_BAD_TENSOR, 4);

    // The smallest index wins, whatever was flagged before and in which block: an f32 overflow on
    // multiplying (tensor 0), an infinity in the last element of tensor 1 (bf16), a NaN in tensor 5,
    // with tensor 6 flagged by an earlier kernel.
    grads[0].set(799, 3e38);
    grads[1].set(999, f32::INFINITY);
    grads[5].set(200, f32::NAN);
    check_unscale(emu, &grads, 2.0, 3, 6, 0);
}

#[test]
fn find_non_finite_matches_the_reference() {
    let Some(emu) = emulator() else { return };
    let mut rng = Rng(2);
    let mut grads = gradients(&mut rng, -20, 10, 1.0);
    let mut cases = vec![(grads.clone(), None)];
    // A NaN in the last tensor and an infinity in tensor 2's single-element second block.
    grads[6].set(63, f32::NAN);
    grads[2].set(1000, f32::NEG_INFINITY);
    cases.push((grads.clone(), Some(2)));
    grads[0].set(799, f32::INFINITY);
    cases.push((grads.clone(), Some(0)));
    for (i, (case, want)) in cases.into_iter().enumerate() {
        assert_eq!(reference::find_non_finite(&views(&case)), want);
        let mut got = case.clone();
        let mut bad = NO_BAD_TENSOR;
        find_non_finite(emu, &mut got, 1 + i % 3, &mut bad);
        assert_eq!(bad, bad_of(want), "case {i}");
        for (t, (g, c)) in got.iter().zip(&case).enumerate() {
            assert_same_owned(&format!("case {i}: tensor {t} unchanged"), g, c);
        }
    }
}
