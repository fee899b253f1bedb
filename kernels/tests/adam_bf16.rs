//! Fused Adam / AdamW with bf16 moments: every code path bit-identical to the element-by-element
//! reference (across a 64 Ki split, so each piece draws its elements' own random bits); the moments
//! follow f64's running averages where round-to-nearest bf16 stalls.

mod common;

use amp_kernels::optim::{adam_step_bf16_state_with, AdamBf16Tensor, AdamParams};
use amp_kernels::{reference, Dtype, GradSlice, Isa};
use common::bf16_state::{assert_same_bf16_states, bf16_states, Bf16State};
use common::{state_set, Owned, Rng, DTYPES, WORKING};
use half::bf16;

fn tensors(states: &mut [Bf16State]) -> Vec<AdamBf16Tensor<'_>> {
    states
        .iter_mut()
        .enumerate()
        .map(|(i, s)| AdamBf16Tensor {
            master: &mut s.state.master,
            grad: s.state.grad.view(),
            exp_avg: &mut s.a,
            exp_avg_sq: &mut s.b,
            working: s.state.working.as_mut().map(Owned::half_mut),
            stream: 1000 + i as u64,
        })
        .collect()
}

/// The bf16 buffers' names in messages.
const MOMENTS: [&str; 2] = ["exp_avg", "exp_avg_sq"];

#[test]
fn every_path_matches_the_reference_bit_for_bit_over_three_steps() {
    let mut rng = Rng(31);
    let adamw = AdamParams { lr: 1e-2, ..AdamParams::default() };
    let variants = [
        adamw,
        AdamParams { decoupled_weight_decay: false, ..adamw },
        AdamParams { weight_decay: 0.0, bias_correction: false, ..adamw },
    ];
    for hp in variants {
        for grad in DTYPES {
            for working in WORKING {
                let start = bf16_states(state_set(&mut rng, grad, working, false, 1024.0));
                let mut expect = start.clone();
                let mut got: Vec<Vec<Bf16State>> = Isa::supported().map(|_| start.clone()).collect();
                for step in 1..=3 {
                    let hp = AdamParams { step, ..hp };
                    reference::adam_step_bf16_state(&mut tensors(&mut expect), &hp, 1.0 / 1024.0);
                    for (isa, g) in Isa::supported().zip(&mut got) {
                        adam_step_bf16_state_with(isa, &mut tensors(g), &hp, 1.0 / 1024.0);
                        assert_same_bf16_states(
                            &format!("{isa:?} {hp:?} {grad:?} {working:?}"),
                            MOMENTS,
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
    let mut rng = Rng(32);
    let start = bf16_states(state_set(&mut rng, Dtype::F16, Some(Dtype::F16), false, 1.0));
    let run = |threads: usize| {
        let mut s = start.clone();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            adam_step_bf16_state_with(Isa::detect(), &mut tensors(&mut s), &AdamParams::default(), 1.0)
        });
        s
    };
    let one = run(1);
    for threads in [2, 3, 8] {
        assert_same_bf16_states(&format!("{threads} threads"), MOMENTS, &run(threads), &one);
    }
}

/// `steps` Adam steps on one tensor of `n` elements whose gradient at step `t` is `grad(t, i)`: the
/// bf16-moment kernel, the same step with moments rounded to nearest instead, and f64 throughout.
/// Returns the second moments `v` of the three after the last step.
fn second_moments(n: usize, steps: u64, grad: impl Fn(u64, usize) -> f32) -> [Vec<f64>; 3] {
    let hp = AdamParams { lr: 1e-3, weight_decay: 0.0, ..AdamParams::default() };
    let mut p = vec![1.0f32; n];
    let (mut m, mut v) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
    let mut p_near = p.clone();
    let (mut m_near, mut v_near) = (vec![0f32; n], vec![0f32; n]);
    let mut p64 = vec![1.0f64; n];
    let (mut m64, mut v64) = (vec![0f64; n], vec![0f64; n]);
    for t in 1..=steps {
        let hp = AdamParams { step: t, ..hp };
        let g: Vec<f32> = (0..n).map(|i| grad(t, i)).collect();
        let mut bf = [AdamBf16Tensor {
            master: &mut p,
            grad: GradSlice::F32(&g),
            exp_avg: &mut m,
            exp_avg_sq: &mut v,
            working: None,
            stream: 5,
        }];
        adam_step_bf16_state_with(Isa::detect(), &mut bf, &hp, 1.0);
        // Round to nearest: the f32 step, then the moments rounded to bf16 and back.
        let mut near =
            [amp_kernels::optim::AdamTensor::new(&mut p_near, GradSlice::F32(&g), &mut m_near, &mut v_near)];
        amp_kernels::optim::adam_step(&mut near, &hp, 1.0);
        for x in m_near.iter_mut().chain(v_near.iter_mut()) {
            *x = bf16::from_f32(*x).to_f32();
        }
        let g64: Vec<f64> = g.iter().map(|&x| f64::from(x)).collect();
        reference::adam_step_f64(&mut p64, &g64, &mut m64, &mut v64, None, &hp, 1.0);
    }
    let wide = |v: &[bf16]| v.iter().map(|x| f64::from(x.to_f32())).collect::<Vec<f64>>();
    [wide(&v), v_near.iter().map(|&x| f64::from(x)).collect(), v64]
}

/// Mean over elements of `(a - b) / b`, and of its magnitude.
fn relative_errors(a: &[f64], b: &[f64]) -> (f64, f64) {
    let errors: Vec<f64> = a.iter().zip(b).map(|(a, b)| (a - b) / b).collect();
    let n = errors.len() as f64;
    (errors.iter().sum::<f64>() / n, errors.iter().map(|e| e.abs()).sum::<f64>() / n)
}

#[test]
fn the_second_moment_decays_with_f64_where_rounding_to_nearest_stalls() {
    // 200 steps of gradients around 1, then 1,000 steps of gradients 10x smaller: f64's v decays by
    // 0.999 per step toward 0.01 (1 - 0.999^1000 = 63% of the way). Under round-to-nearest each
    // step's change (0.1% of v) is below half a bf16 step (0.2-0.4%): v never moves after the switch.
    let n = 4096;
    let grad = |t: u64, i: usize| {
        let wobble = 1.0 + 0.1 * ((t as f32 * 0.37 + i as f32 * 0.11).sin());
        if t <= 200 {
            wobble
        } else {
            0.1 * wobble
        }
    };
    let [stochastic, nearest, exact] = second_moments(n, 1200, grad);
    let ((sr_bias, sr_spread), (rn_bias, _)) =
        (relative_errors(&stochastic, &exact), relative_errors(&nearest, &exact));
    eprintln!("stochastic: bias {sr_bias:.5}, mean |error| {sr_spread:.5}; nearest: bias {rn_bias:.5}");
    // Stochastic rounding is unbiased: the elements' errors average out. Each element carries noise:
    // every step adds a rounding error of up to one bf16 step (relative 2^-8..2^-7, standard deviation
    // about 0.3% of v), and the running average keeps it with weight 0.999 per step, a random walk of
    // sqrt(1 / (1 - 0.999^2)) = 22 steps' errors: about 6% standard deviation, 5% mean magnitude.
    // Over 4,096 elements the mean of those errors has a standard error of 0.1%.
    assert!(sr_bias.abs() < 0.005, "stochastic rounding: v biased by {sr_bias}");
    assert!(sr_spread < 0.08, "stochastic rounding: v's noise {sr_spread} above the random walk's");
    // Nearest: stuck near the old value, far above f64's.
    assert!(rn_bias > 0.2, "round to nearest should stall here (what the test guards against): {rn_bias}");
}

#[test]
#[should_panic(expected = "AMSGrad needs f32 state")]
fn amsgrad_panics() {
    let (mut p, mut m, mut v) = ([0f32; 2], [bf16::ZERO; 2], [bf16::ZERO; 2]);
    let t = AdamBf16Tensor {
        master: &mut p,
        grad: GradSlice::F32(&[1.0, 2.0]),
        exp_avg: &mut m,
        exp_avg_sq: &mut v,
        working: None,
        stream: 0,
    };
    adam_step_bf16_state_with(
        Isa::Portable,
        &mut [t],
        &AdamParams { amsgrad: true, ..AdamParams::default() },
        1.0,
    );
}
