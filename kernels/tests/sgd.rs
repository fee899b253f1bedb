//! Fused SGD: both code paths bit-identical to the f32 reference over several steps (first-step buffer
//! initialisation included) for every gradient dtype, working copy, option and tail length; and small
//! hand-computed trajectories.

mod common;

use amp_kernels::optim::{sgd_step_with, SgdParams, SgdTensor};
use amp_kernels::{reference, GradSlice, Isa};
use common::{assert_same_state, state_set, Owned, Rng, State, DTYPES, WORKING};

fn tensors(states: &mut [State], momentum: bool) -> Vec<SgdTensor<'_>> {
    states
        .iter_mut()
        .map(|s| SgdTensor {
            master: &mut s.master,
            grad: s.grad.view(),
            momentum_buffer: momentum.then_some(&mut s.a[..]),
            working: s.working.as_mut().map(Owned::half_mut),
        })
        .collect()
}

fn variants() -> Vec<SgdParams> {
    let base = SgdParams { lr: 0.05, ..SgdParams::default() };
    vec![
        base,
        SgdParams { weight_decay: 1e-3, ..base },
        SgdParams { momentum: 0.9, ..base },
        SgdParams { momentum: 0.9, dampening: 0.1, weight_decay: 1e-3, ..base },
        SgdParams { momentum: 0.9, nesterov: true, ..base },
    ]
}

#[test]
fn both_paths_match_the_reference_bit_for_bit_over_three_steps() {
    let mut rng = Rng(31);
    for hp in variants() {
        let momentum = hp.momentum != 0.0;
        for grad in DTYPES {
            for working in WORKING {
                let start = state_set(&mut rng, grad, working, false, 512.0);
                let mut expect = start.clone();
                let mut got: Vec<Vec<State>> = Isa::supported().map(|_| start.clone()).collect();
                for step in 0..3 {
                    let hp = SgdParams { first_step: step == 0, ..hp };
                    reference::sgd_step(&mut tensors(&mut expect, momentum), &hp, 1.0 / 512.0);
                    for (isa, g) in Isa::supported().zip(&mut got) {
                        sgd_step_with(isa, &mut tensors(g, momentum), &hp, 1.0 / 512.0);
                        assert_same_state(&format!("{isa:?} {hp:?} {grad:?} {working:?}"), g, &expect);
                    }
                }
            }
        }
    }
}

/// Two steps on one weight with gradient 1 (exact binary fractions where possible).
fn two_steps(isa: Isa, hp: SgdParams) -> (f32, f32) {
    let (mut p, mut buf) = ([1.0f32], [123.0f32]);
    let g = [1.0f32];
    for first in [true, false] {
        let hp = SgdParams { first_step: first, ..hp };
        let mb = (hp.momentum != 0.0).then_some(&mut buf[..]);
        let mut t =
            [SgdTensor { master: &mut p, grad: GradSlice::F32(&g), momentum_buffer: mb, working: None }];
        sgd_step_with(isa, &mut t, &hp, 1.0);
    }
    (p[0], buf[0])
}

#[test]
fn momentum_starts_from_the_gradient_then_blends_as_pytorch() {
    for isa in Isa::supported() {
        let hp = SgdParams { lr: 0.25, momentum: 0.5, ..SgdParams::default() };
        // buf: 1 (first step, not 0.5 * 123 + 1), then 0.5 * 1 + 1 = 1.5. p: 1 - 0.25 - 0.375.
        assert_eq!(two_steps(isa, hp), (0.375, 1.5));
        // Nesterov: d = g + m * buf: 1.5 then 1.75.
        let hp = SgdParams { nesterov: true, ..hp };
        assert_eq!(two_steps(isa, hp), (1.0 - 0.25 * 1.5 - 0.25 * 1.75, 1.5));
        // Dampening 0.5: buf = 1, then 0.5 + 0.5.
        let hp = SgdParams { lr: 0.25, momentum: 0.5, dampening: 0.5, ..SgdParams::default() };
        assert_eq!(two_steps(isa, hp), (0.5, 1.0));
        // Plain SGD leaves the (absent) buffer alone.
        assert_eq!(two_steps(isa, SgdParams { lr: 0.25, ..SgdParams::default() }), (0.5, 123.0));
    }
}

#[test]
#[should_panic(expected = "nesterov momentum requires momentum > 0 and zero dampening")]
fn nesterov_with_dampening_is_rejected() {
    let hp = SgdParams { momentum: 0.9, dampening: 0.1, nesterov: true, ..SgdParams::default() };
    sgd_step_with(Isa::Portable, &mut [], &hp, 1.0);
}
