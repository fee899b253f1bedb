//! The optimizers with bf16 state (the table's state kind bf16): `amp_adam`, `amp_sgd` and LAMB's three
//! launches against `reference::*_bf16_state`, step after step with a skipped step between. The
//! stochastic rounding (hash, stream key from the device's step counter, NaN rule) is bit for bit, so
//! are the moments, buffers, masters and working copies; LAMB's masters as in [`crate::lamb`] where a
//! norm is an ulp off.

use std::cell::RefCell;

use amp_kernels::cuda::NO_BAD_TENSOR;
use amp_kernels::optim::{
    AdamBf16Tensor, AdamParams, LambBf16Tensor, LambParams, SgdBf16Tensor, SgdParams, TensorNorms,
};
use amp_kernels::reference;

use crate::adam::adam;
use crate::common::bf16_state::{assert_same_bf16_states, bf16_states, Bf16State};
use crate::common::{Owned, Rng};
use crate::data::{dtype, states};
use crate::harness::emulator;
use crate::lamb::{lamb, LambScratch, Tally};
use crate::scale::count_step;
use crate::sgd::sgd;
use crate::tables::stream;

/// Optimizer states of every gradient and working-copy type, their buffers in bf16.
fn rows(rng: &mut Rng, scale: f32) -> Vec<Bf16State> {
    bf16_states(states(rng, false, scale))
}

/// New gradients for both copies (`crate::data::regrade` on the states inside).
fn regrade(rng: &mut Rng, got: &mut [Bf16State], want: &mut [Bf16State], scale: f32) {
    for (g, w) in got.iter_mut().zip(want) {
        let values: Vec<f32> = rng.vec(g.state.master.len(), -6, 6).iter().map(|x| x * scale).collect();
        g.state.grad = Owned::new(dtype(&g.state.grad), &values);
        w.state.grad = g.state.grad.clone();
    }
}

/// Runs `rounds` rounds of `device` on `got` and of `reference` (given the step number, from 1) on
/// `want`; round 1 is skipped on the device (its flag set) and not run on the reference. Checks after
/// each round with `check`.
fn rounds(
    seed: u64,
    scale: f32,
    mut device: impl FnMut(&mut [Bf16State], &i64, &i32),
    mut reference: impl FnMut(&mut [Bf16State], u64),
    mut check: impl FnMut(&str, &[Bf16State], &[Bf16State]),
) {
    let Some(emu) = emulator() else { return };
    let mut rng = Rng(seed);
    let mut got = rows(&mut rng, scale);
    let mut want = got.clone();
    let (mut steps, mut applied) = (0i64, 0u64);
    for round in 0..4 {
        let skipped = round == 1;
        regrade(&mut rng, &mut got, &mut want, scale);
        let bad = if skipped { 2 } else { NO_BAD_TENSOR };
        device(&mut got, &steps, &bad);
        count_step(emu, &mut steps, &bad);
        if !skipped {
            applied += 1;
            reference(&mut want, applied);
        }
        check(&format!("round {round}"), &got, &want);
    }
    assert_eq!(steps, 3, "the device step counter");
}

const MOMENTS: [&str; 2] = ["exp_avg", "exp_avg_sq"];

#[test]
fn adam_with_bf16_moments_matches_the_reference_bit_for_bit() {
    let Some(emu) = emulator() else { return };
    let scale = 1024.0;
    let factor = 1.0 / scale;
    let base = AdamParams { lr: 1e-2, weight_decay: 0.05, ..AdamParams::default() };
    for hp in [base, AdamParams { decoupled_weight_decay: false, bias_correction: false, ..base }] {
        rounds(
            7,
            scale,
            |got, steps, bad| adam(emu, got, steps, bad, factor, &hp),
            |want, step| {
                let mut tensors: Vec<AdamBf16Tensor<'_>> = want
                    .iter_mut()
                    .enumerate()
                    .map(|(t, s)| AdamBf16Tensor {
                        master: &mut s.state.master,
                        grad: s.state.grad.view(),
                        exp_avg: &mut s.a,
                        exp_avg_sq: &mut s.b,
                        working: s.state.working.as_mut().map(Owned::half_mut),
                        stream: stream(t),
                    })
                    .collect();
                reference::adam_step_bf16_state(&mut tensors, &AdamParams { step, ..hp }, factor);
            },
            |what, got, want| assert_same_bf16_states(&format!("{hp:?} {what}"), MOMENTS, got, want),
        );
    }
}

#[test]
fn sgd_with_a_bf16_buffer_matches_the_reference_bit_for_bit() {
    let Some(emu) = emulator() else { return };
    let scale = 512.0;
    let factor = 1.0 / scale;
    let base =
        SgdParams { lr: 0.05, momentum: 0.9, dampening: 0.1, weight_decay: 1e-2, ..SgdParams::default() };
    for hp in [base, SgdParams { nesterov: true, dampening: 0.0, ..base }] {
        rounds(
            8,
            scale,
            |got, steps, bad| sgd(emu, got, steps, bad, factor, &hp),
            |want, step| {
                let mut tensors: Vec<SgdBf16Tensor<'_>> = want
                    .iter_mut()
                    .enumerate()
                    .map(|(t, s)| SgdBf16Tensor {
                        master: &mut s.state.master,
                        grad: s.state.grad.view(),
                        momentum_buffer: &mut s.a,
                        working: s.state.working.as_mut().map(Owned::half_mut),
                        stream: stream(t),
                    })
                    .collect();
                let hp = SgdParams { first_step: step == 1, ..hp };
                reference::sgd_step_bf16_state(&mut tensors, &hp, step, factor);
            },
            // `b` is not SGD's: it stays as it was on both sides.
            |what, got, want| {
                assert_same_bf16_states(&format!("{hp:?} {what}"), ["momentum_buffer", "unused"], got, want)
            },
        );
    }
}

#[test]
fn lamb_with_bf16_moments_matches_the_reference() {
    let Some(emu) = emulator() else { return };
    let scale = 256.0;
    let factor = 1.0 / scale;
    let base = LambParams { lr: 1e-2, ..LambParams::default() };
    let mut tally = Tally::default();
    for hp in [base, LambParams { decoupled_weight_decay: false, always_adapt: true, ..base }] {
        // Shared by the device run, the reference and the check.
        let scratch: RefCell<Option<LambScratch>> = RefCell::new(None);
        let norms = RefCell::new(Vec::new());
        rounds(
            9,
            scale,
            |got, steps, bad| {
                let mut scratch = scratch.borrow_mut();
                let scratch = scratch.get_or_insert_with(|| LambScratch::for_states(got, f32::NAN));
                lamb(emu, got, steps, bad, factor, &hp, scratch);
            },
            |want, step| {
                let mut norms = norms.borrow_mut();
                *norms = vec![TensorNorms::default(); want.len()];
                let mut tensors: Vec<LambBf16Tensor<'_>> = want
                    .iter_mut()
                    .enumerate()
                    .map(|(t, s)| LambBf16Tensor {
                        master: &mut s.state.master,
                        grad: s.state.grad.view(),
                        exp_avg: &mut s.a,
                        exp_avg_sq: &mut s.b,
                        working: s.state.working.as_mut().map(Owned::half_mut),
                        stream: stream(t),
                    })
                    .collect();
                reference::lamb_step_bf16_state(&mut tensors, &LambParams { step, ..hp }, factor, &mut norms);
            },
            |what, got, want| {
                // Moments come before the norms: bit for bit (the skipped round changes nothing).
                let bits = |v: &[half::bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
                for (t, (g, w)) in got.iter().zip(want).enumerate() {
                    assert_eq!(bits(&g.a), bits(&w.a), "{hp:?} {what} t{t} exp_avg");
                    assert_eq!(bits(&g.b), bits(&w.b), "{hp:?} {what} t{t} exp_avg_sq");
                }
                if what != "round 1" {
                    let scratch = scratch.borrow();
                    let scratch = scratch.as_ref().expect("the device ran");
                    let pairs = got.iter().map(|g| &g.state).zip(want.iter().map(|w| &w.state));
                    tally.check(&format!("{hp:?} {what}"), pairs, scratch, &norms.borrow());
                }
            },
        );
    }
    tally.report("lamb, bf16 moments");
}
