//! Fused SGD with a bf16 momentum buffer: every code path bit-identical to the element-by-element
//! reference over three steps (the first step's buffer initialisation included, across a 64 Ki split),
//! independent of the thread count; the buffer follows f64's where round-to-nearest bf16 stalls.

mod common;

use amp_kernels::optim::{sgd_step, sgd_step_bf16_state_with, SgdBf16Tensor, SgdParams, SgdTensor};
use amp_kernels::{reference, Dtype, GradSlice, Isa};
use common::bf16_state::{assert_same_bf16_states, bf16_states, Bf16State};
use common::{state_set, Owned, Rng, DTYPES, WORKING};
use half::bf16;

fn tensors(states: &mut [Bf16State]) -> Vec<SgdBf16Tensor<'_>> {
    states
        .iter_mut()
        .enumerate()
        .map(|(i, s)| SgdBf16Tensor {
            master: &mut s.state.master,
            grad: s.state.grad.view(),
            momentum_buffer: &mut s.a,
            working: s.state.working.as_mut().map(Owned::half_mut),
            stream: 77 + i as u64,
        })
        .collect()
}

/// The bf16 buffers' names in messages (`b` is not used by SGD).
const BUFFER: [&str; 2] = ["momentum_buffer", "unused"];

#[test]
fn every_path_matches_the_reference_bit_for_bit_over_three_steps() {
    let mut rng = Rng(41);
    let base = SgdParams { lr: 0.05, momentum: 0.9, ..SgdParams::default() };
    let variants = [
        base,
        SgdParams { dampening: 0.1, weight_decay: 1e-3, ..base },
        SgdParams { nesterov: true, ..base },
    ];
    for hp in variants {
        for grad in DTYPES {
            for working in WORKING {
                let start = bf16_states(state_set(&mut rng, grad, working, false, 1024.0));
                let mut expect = start.clone();
                let mut got: Vec<Vec<Bf16State>> = Isa::supported().map(|_| start.clone()).collect();
                for step in 1..=3 {
                    let hp = SgdParams { first_step: step == 1, ..hp };
                    reference::sgd_step_bf16_state(&mut tensors(&mut expect), &hp, step, 1.0 / 1024.0);
                    for (isa, g) in Isa::supported().zip(&mut got) {
                        sgd_step_bf16_state_with(isa, &mut tensors(g), &hp, step, 1.0 / 1024.0);
                        assert_same_bf16_states(
                            &format!("{isa:?} {hp:?} {grad:?} {working:?}"),
                            BUFFER,
                            g,
                            &expect,
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn the_result_does_not_depend_on_the_thread_count() {
    let mut rng = Rng(42);
    let start = bf16_states(state_set(&mut rng, Dtype::Bf16, Some(Dtype::Bf16), false, 1.0));
    let hp = SgdParams { lr: 0.01, momentum: 0.9, first_step: false, ..SgdParams::default() };
    let run = |threads: usize| {
        let mut s = start.clone();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| sgd_step_bf16_state_with(Isa::detect(), &mut tensors(&mut s), &hp, 9, 1.0));
        s
    };
    let one = run(1);
    for threads in [2, 3, 8] {
        assert_same_bf16_states(&format!("{threads} threads"), BUFFER, &run(threads), &one);
    }
}

#[test]
fn the_buffer_follows_f64_where_rounding_to_nearest_stalls() {
    // Momentum 0.999 (a long average): the gradient steps from 1 down to 0.3 at step 300. f64's buffer
    // decays toward 0.3 by 0.1% of the gap a step, below half a bf16 step: a nearest-rounded buffer
    // stays at 1. 4,096 elements, 1,300 steps.
    let n = 4096;
    let hp = SgdParams { lr: 1e-4, momentum: 0.999, dampening: 0.999, ..SgdParams::default() };
    let grad = |t: u64, i: usize| if t <= 300 { 1.0 + 0.01 * ((i % 7) as f32) } else { 0.3 };
    let (mut p, mut buf) = (vec![1.0f32; n], vec![bf16::ZERO; n]);
    let (mut p_near, mut b_near) = (vec![1.0f32; n], vec![0f32; n]);
    let mut b64 = vec![0f64; n];
    for t in 1..=1300u64 {
        let hp = SgdParams { first_step: t == 1, ..hp };
        let g: Vec<f32> = (0..n).map(|i| grad(t, i)).collect();
        let mut bf = [SgdBf16Tensor {
            master: &mut p,
            grad: GradSlice::F32(&g),
            momentum_buffer: &mut buf,
            working: None,
            stream: 3,
        }];
        sgd_step_bf16_state_with(Isa::detect(), &mut bf, &hp, t, 1.0);
        let mut near = [SgdTensor {
            master: &mut p_near,
            grad: GradSlice::F32(&g),
            momentum_buffer: Some(&mut b_near),
            working: None,
        }];
        sgd_step(&mut near, &hp, 1.0);
        for x in &mut b_near {
            *x = bf16::from_f32(*x).to_f32();
        }
        for (b, &gi) in b64.iter_mut().zip(&g) {
            *b = if t == 1 { f64::from(gi) } else { 0.999 * *b + 0.001 * f64::from(gi) };
        }
    }
    let relative = |got: &dyn Fn(usize) -> f64| -> f64 {
        (0..n).map(|i| (got(i) - b64[i]) / b64[i]).sum::<f64>() / n as f64
    };
    let stochastic = relative(&|i| f64::from(buf[i].to_f32()));
    let nearest = relative(&|i| f64::from(b_near[i]));
    eprintln!("mean relative error of the buffer: stochastic {stochastic:.5}, nearest {nearest:.5}");
    // Each element's buffer carries the random walk of its rounding errors (about 5% for a 0.999
    // average, as Adam's `v`); over 4,096 elements their mean has a standard error near 0.1%.
    assert!(stochastic.abs() < 0.005, "stochastic rounding: buffer biased by {stochastic}");
    assert!(nearest > 0.2, "round to nearest should stall here (what the test guards against): {nearest}");
}

#[test]
#[should_panic(expected = "a momentum buffer needs momentum != 0")]
fn no_momentum_panics() {
    let (mut p, mut b) = ([0f32; 2], [bf16::ZERO; 2]);
    let t = SgdBf16Tensor {
        master: &mut p,
        grad: GradSlice::F32(&[1.0, 2.0]),
        momentum_buffer: &mut b,
        working: None,
        stream: 0,
    };
    sgd_step_bf16_state_with(Isa::Portable, &mut [t], &SgdParams::default(), 1, 1.0);
}
