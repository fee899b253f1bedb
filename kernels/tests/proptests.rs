//! Property tests: random tensor lists (lengths, dtypes, any f32 bit pattern incl. NaN, inf and
//! subnormals) and random hyper-parameters; every code path must equal the scalar reference.

mod common;

use amp_kernels::optim::{adam_step_with, lamb_step_with, AdamParams, AdamTensor, LambParams, LambTensor};
use amp_kernels::optim::{sgd_step_with, SgdParams, SgdTensor, TensorNorms};
use amp_kernels::unscale::{find_non_finite_with, unscale_and_check_with};
use amp_kernels::{norm, reference, Dtype, Isa};
use common::{assert_same_owned, assert_same_state, views, views_mut, Owned, State};
use proptest::prelude::*;

fn dtype() -> impl Strategy<Value = Dtype> {
    prop_oneof![Just(Dtype::F32), Just(Dtype::F16), Just(Dtype::Bf16)]
}

/// Mostly ordinary magnitudes, sometimes any bit pattern (NaN, inf, subnormal, huge).
fn value() -> impl Strategy<Value = f32> {
    prop_oneof![8 => -1e3f32..1e3, 1 => any::<f32>(), 1 => Just(f32::NAN), 1 => Just(0.0)]
}

fn tensor() -> impl Strategy<Value = Owned> {
    (dtype(), prop::collection::vec(value(), 0..80)).prop_map(|(d, v)| Owned::new(d, &v))
}

fn tensors() -> impl Strategy<Value = Vec<Owned>> {
    prop::collection::vec(tensor(), 0..6)
}

/// Optimizer states with finite, moderate values (the optimizers run only on non-skipped steps).
fn states(moments: bool) -> impl Strategy<Value = Vec<State>> {
    let one = (
        dtype(),
        prop::option::of(prop_oneof![Just(Dtype::F16), Just(Dtype::Bf16)]),
        0usize..70,
        any::<u64>(),
    );
    prop::collection::vec(one, 0..5).prop_map(move |specs| {
        specs
            .into_iter()
            .map(|(g, w, n, seed)| State::random(&mut common::Rng(seed), n, g, w, moments, 64.0))
            .collect()
    })
}

proptest! {
    #[test]
    fn unscale_and_find_match_the_reference(ts in tensors(), inv in prop_oneof![Just(1.0f32 / 65536.0), 1e-3f32..4.0]) {
        let mut expect = ts.clone();
        let e = reference::unscale_and_check(&mut views_mut(&mut expect), inv);
        for isa in Isa::supported() {
            prop_assert_eq!(find_non_finite_with(isa, &views(&ts)), reference::find_non_finite(&views(&ts)));
            let mut got = ts.clone();
            prop_assert_eq!(unscale_and_check_with(isa, &mut views_mut(&mut got), inv), e);
            for (a, b) in got.iter().zip(&expect) {
                assert_same_owned("unscale", a, b);
            }
        }
    }

    #[test]
    fn norms_agree_across_paths_and_with_the_reference(ts in tensors()) {
        let mut expect = vec![0f32; ts.len()];
        let eg = reference::l2_norms(&views(&ts), 1.0, &mut expect);
        let results: Vec<(u32, Vec<f32>)> = Isa::supported().map(|isa| {
            let mut per = vec![0f32; ts.len()];
            (norm::l2_norms_with(isa, &views(&ts), 1.0, &mut per).to_bits(), per)
        }).collect();
        for (g, per) in &results {
            prop_assert_eq!((g, per.iter().map(|x| x.to_bits()).collect::<Vec<_>>()),
                (&results[0].0, results[0].1.iter().map(|x| x.to_bits()).collect()));
            // Same value up to the f64 summation order: 1 ulp (NaN and inf are order-independent).
            for (&a, &b) in per.iter().chain([&f32::from_bits(*g)]).zip(expect.iter().chain([&eg])) {
                prop_assert!(a.is_nan() && b.is_nan() || a.to_bits().abs_diff(b.to_bits()) <= 1, "{} vs {}", a, b);
            }
        }
    }

    #[test]
    fn adam_matches_the_reference(
        st in states(true), lr in 1e-4f64..0.1, b1 in 0.0f64..0.99, b2 in 0.9f64..0.9999,
        wd in prop_oneof![Just(0.0), 1e-4f64..0.1], decoupled: bool, amsgrad: bool, bias: bool, step in 1u64..1000,
    ) {
        let hp = AdamParams { lr, beta1: b1, beta2: b2, eps: 1e-8, weight_decay: wd,
            decoupled_weight_decay: decoupled, amsgrad, bias_correction: bias, step };
        let run = |isa: Option<Isa>| {
            let mut s = st.clone();
            let mut t: Vec<AdamTensor<'_>> = s.iter_mut().map(|s| AdamTensor { master: &mut s.master,
                grad: s.grad.view(), exp_avg: &mut s.a, exp_avg_sq: &mut s.b,
                max_exp_avg_sq: if amsgrad { s.c.as_deref_mut() } else { None },
                working: s.working.as_mut().map(Owned::half_mut) }).collect();
            match isa {
                Some(isa) => adam_step_with(isa, &mut t, &hp, 1.0 / 64.0),
                None => reference::adam_step(&mut t, &hp, 1.0 / 64.0),
            }
            drop(t);
            s
        };
        let expect = run(None);
        for isa in Isa::supported() {
            assert_same_state(&format!("{isa:?}"), &run(Some(isa)), &expect);
        }
    }

    #[test]
    fn sgd_matches_the_reference(
        st in states(false), lr in 1e-4f64..0.5, momentum in prop_oneof![Just(0.0), 0.1f64..0.99],
        dampening in prop_oneof![Just(0.0), 0.0f64..0.5], wd in prop_oneof![Just(0.0), 1e-4f64..0.1],
        nesterov: bool, first: bool,
    ) {
        let nesterov = nesterov && momentum > 0.0 && dampening == 0.0;
        let hp = SgdParams { lr, momentum, dampening, weight_decay: wd, nesterov, first_step: first };
        let run = |isa: Option<Isa>| {
            let mut s = st.clone();
            let mut t: Vec<SgdTensor<'_>> = s.iter_mut().map(|s| SgdTensor { master: &mut s.master,
                grad: s.grad.view(), momentum_buffer: (momentum != 0.0).then_some(&mut s.a[..]),
                working: s.working.as_mut().map(Owned::half_mut) }).collect();
            match isa {
                Some(isa) => sgd_step_with(isa, &mut t, &hp, 1.0 / 64.0),
                None => reference::sgd_step(&mut t, &hp, 1.0 / 64.0),
            }
            drop(t);
            s
        };
        let expect = run(None);
        for isa in Isa::supported() {
            assert_same_state(&format!("{isa:?}"), &run(Some(isa)), &expect);
        }
    }

    #[test]
    fn lamb_paths_are_identical_and_match_the_reference_when_norms_do(
        st in states(false), lr in 1e-4f64..0.1, wd in prop_oneof![Just(0.0), 1e-4f64..0.1],
        decoupled: bool, bias: bool, averaging: bool, adapt: bool, step in 1u64..100,
    ) {
        let hp = LambParams { lr, weight_decay: wd, decoupled_weight_decay: decoupled, bias_correction: bias,
            grad_averaging: averaging, always_adapt: adapt, step, ..LambParams::default() };
        let run = |isa: Option<Isa>| {
            let mut s = st.clone();
            let mut norms = vec![TensorNorms::default(); s.len()];
            let mut t: Vec<LambTensor<'_>> = s.iter_mut().map(|s| LambTensor { master: &mut s.master,
                grad: s.grad.view(), exp_avg: &mut s.a, exp_avg_sq: &mut s.b,
                working: s.working.as_mut().map(Owned::half_mut) }).collect();
            match isa {
                Some(isa) => lamb_step_with(isa, &mut t, &hp, 1.0 / 64.0, &mut norms),
                None => reference::lamb_step(&mut t, &hp, 1.0 / 64.0, &mut norms),
            }
            drop(t);
            (s, norms)
        };
        let (expect, en) = run(None);
        let (first, fnorms) = run(Some(Isa::Portable));
        for isa in Isa::supported() {
            let (got, gn) = run(Some(isa));
            prop_assert_eq!(&gn, &fnorms);
            assert_same_state(&format!("{isa:?} vs portable"), &got, &first);
        }
        for (a, b) in fnorms.iter().zip(&en) {
            prop_assert!(a.param.to_bits().abs_diff(b.param.to_bits()) <= 1);
            prop_assert!(a.update.to_bits().abs_diff(b.update.to_bits()) <= 1);
        }
        if fnorms == en {
            assert_same_state("vs reference", &first, &expect);
        }
    }
}
