//! Fused Adam / AdamW: both code paths bit-identical to the f32 reference over several steps, for every
//! gradient dtype, working-copy dtype, option and tail length; the formulas checked against f64.

mod common;

use amp_kernels::optim::{adam_step_with, AdamParams, AdamTensor};
use amp_kernels::{reference, Dtype, GradSlice, Isa};
use common::{assert_same_state, state_set, Owned, Rng, State, DTYPES, WORKING};

fn tensors(states: &mut [State]) -> Vec<AdamTensor<'_>> {
    states
        .iter_mut()
        .map(|s| AdamTensor {
            master: &mut s.master,
            grad: s.grad.view(),
            exp_avg: &mut s.a,
            exp_avg_sq: &mut s.b,
            max_exp_avg_sq: s.c.as_deref_mut(),
            working: s.working.as_mut().map(Owned::half_mut),
        })
        .collect()
}

fn variants() -> Vec<AdamParams> {
    let adamw = AdamParams { lr: 1e-2, ..AdamParams::default() };
    vec![
        adamw,
        AdamParams { decoupled_weight_decay: false, ..adamw },
        AdamParams { weight_decay: 0.0, ..adamw },
        AdamParams { amsgrad: true, ..adamw },
        AdamParams { bias_correction: false, amsgrad: true, decoupled_weight_decay: false, ..adamw },
    ]
}

#[test]
fn both_paths_match_the_reference_bit_for_bit_over_three_steps() {
    let mut rng = Rng(21);
    for hp in variants() {
        for grad in DTYPES {
            for working in WORKING {
                let start = state_set(&mut rng, grad, working, hp.amsgrad, 1024.0);
                let mut expect = start.clone();
                let mut got: Vec<Vec<State>> = Isa::supported().map(|_| start.clone()).collect();
                for step in 1..=3 {
                    let hp = AdamParams { step, ..hp };
                    reference::adam_step(&mut tensors(&mut expect), &hp, 1.0 / 1024.0);
                    for (isa, g) in Isa::supported().zip(&mut got) {
                        adam_step_with(isa, &mut tensors(g), &hp, 1.0 / 1024.0);
                        assert_same_state(&format!("{isa:?} {hp:?} {grad:?} {working:?}"), g, &expect);
                    }
                }
            }
        }
    }
}

#[test]
fn the_f32_step_is_within_rounding_of_an_f64_step() {
    let mut rng = Rng(22);
    for hp in variants() {
        let hp = AdamParams { step: 7, ..hp };
        let mut s = State::random(&mut rng, 4099, Dtype::F32, None, hp.amsgrad, 1.0);
        let f64s = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
        let (mut p, g, mut m, mut v) = (f64s(&s.master), f64s(&s.grad.to_f32()), f64s(&s.a), f64s(&s.b));
        let mut x = s.c.as_deref().map(f64s);
        let (m0, v0) = (m.clone(), v.clone());
        reference::adam_step_f64(&mut p, &g, &mut m, &mut v, x.as_deref_mut(), &hp, 1.0);
        adam_step_with(Isa::detect(), &mut tensors(std::slice::from_mut(&mut s)), &hp, 1.0);
        for i in 0..p.len() {
            // Each f32 operation rounds with relative error <= 2^-24; the element formula chains ~12 of
            // them, so the step, the moments and the weight decay term carry < 1e-6 relative error of the
            // magnitudes they combine. 4e-6 leaves margin; a wrong formula (eps placement, bias
            // correction, decay order) is off by far more.
            let tol = |scale: f64| 4e-6 * scale + f64::from(f32::EPSILON) * scale.abs();
            let step = (f64::from(s.master[i]) - p[i]).abs();
            let moved = (p[i] - f64::from(s.master[i])).abs().max(hp.lr);
            assert!(step <= tol(p[i].abs() + moved), "p[{i}]: {} vs {}", s.master[i], p[i]);
            assert!((f64::from(s.a[i]) - m[i]).abs() <= tol(m0[i].abs() + g[i].abs()), "m[{i}]");
            assert!((f64::from(s.b[i]) - v[i]).abs() <= tol(v0[i] + g[i] * g[i]), "v[{i}]");
        }
    }
}

#[test]
fn first_step_moves_each_weight_by_lr_against_the_gradient_and_decays_it() {
    for isa in Isa::supported() {
        let hp = AdamParams { lr: 0.1, weight_decay: 0.5, eps: 0.0, ..AdamParams::default() };
        let (mut p, g) = ([1.0f32, 1.0, 2.0], [3.0f32, -0.25, 0.0]);
        let (mut m, mut v) = ([0.0f32; 3], [0.0f32; 3]);
        let mut t = [AdamTensor::new(&mut p, GradSlice::F32(&g), &mut m, &mut v)];
        adam_step_with(isa, &mut t, &hp, 1.0);
        // m_hat = g, v_hat = g²: the step is lr * g / |g|; decay multiplies by 1 - 0.1 * 0.5 first.
        assert_eq!(p[0], 0.95 - 0.1);
        assert_eq!(p[1], 0.95 + 0.1);
        assert!(p[2].is_nan(), "0/0 with eps = 0, as PyTorch");
    }
}

#[test]
#[should_panic(expected = "max_exp_avg_sq must be given exactly when amsgrad")]
fn amsgrad_without_its_state_panics() {
    let (mut p, mut m, mut v) = ([0f32; 2], [0f32; 2], [0f32; 2]);
    let mut t = [AdamTensor::new(&mut p, GradSlice::F32(&[1.0, 2.0]), &mut m, &mut v)];
    adam_step_with(Isa::Portable, &mut t, &AdamParams { amsgrad: true, ..AdamParams::default() }, 1.0);
}

#[test]
#[should_panic(expected = "tensor 0: exp_avg_sq has 1 elements, the master has 2")]
fn mismatched_lengths_panic_naming_the_tensor_and_slice() {
    let (mut p, mut m, mut v) = ([0f32; 2], [0f32; 2], [0f32; 1]);
    let mut t = [AdamTensor::new(&mut p, GradSlice::F32(&[1.0, 2.0]), &mut m, &mut v)];
    adam_step_with(Isa::Portable, &mut t, &AdamParams::default(), 1.0);
}
