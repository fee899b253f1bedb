//! `amp_adam` (adam.cu): every state array bit for bit, step after step, with a skipped step between.

use amp_kernels::cuda::{BLOCK_THREADS, NO_BAD_TENSOR};
use amp_kernels::optim::{AdamParams, AdamTensor};
use amp_kernels::reference;

use crate::common::{assert_same_state, Rng, State};
use crate::data::{regrade, states};
use crate::harness::{emulator, Emulator};
use crate::launch::Shared;
use crate::scale::count_step;
use crate::tables::{states_table, Row, Slot};

const ADAM_SLOTS: [Slot; 7] =
    [Slot::Grad, Slot::Master, Slot::A, Slot::B, Slot::C, Slot::Working, Slot::Stream];

pub fn adam<R: Row>(emu: &Emulator, states: &mut [R], steps: &i64, bad: &i32, factor: f32, hp: &AdamParams) {
    type Kernel = unsafe extern "C" fn(
        *const u64,
        i32,
        *const i64,
        *const i32,
        *const f32,
        f64,
        f64,
        f64,
        f64,
        f64,
        i32,
        i32,
    );
    let m = emu.module("adam");
    // SAFETY: amp_adam's signature in adam.cu.
    let kernel: Kernel = unsafe { m.kernel("amp_adam") };
    let table = states_table(states, &ADAM_SLOTS);
    let (words, n) = (table.words(), table.n());
    let (steps, bad, factor) = (Shared::new(steps), Shared::new(bad), Shared::new(&factor));
    let (decoupled, bias_correction) = (i32::from(hp.decoupled_weight_decay), i32::from(hp.bias_correction));
    let hp = *hp;
    m.launch(table.blocks(), BLOCK_THREADS, &|| {
        // SAFETY: the table holds the addresses, lengths and types of `states`' buffers (f32 masters,
        // f32 or bf16 moments), borrowed mutably for the launch; the other pointers are live borrows.
        unsafe {
            kernel(
                words.get(),
                n,
                steps.get(),
                bad.get(),
                factor.get(),
                hp.lr,
                hp.beta1,
                hp.beta2,
                hp.eps,
                hp.weight_decay,
                decoupled,
                bias_correction,
            );
        }
    });
}

fn reference_adam(states: &mut [State], hp: &AdamParams, factor: f32) {
    let mut tensors: Vec<AdamTensor<'_>> = states
        .iter_mut()
        .map(|s| {
            let mut t = AdamTensor::new(&mut s.master, s.grad.view(), &mut s.a, &mut s.b);
            if let Some(c) = s.c.as_mut() {
                t = t.with_max_exp_avg_sq(c);
            }
            if let Some(w) = s.working.as_mut() {
                t = t.with_working(w.half_mut());
            }
            t
        })
        .collect();
    reference::adam_step(&mut tensors, hp, factor);
}

#[test]
fn adam_matches_the_reference_step_by_step() {
    let Some(emu) = emulator() else { return };
    let mut rng = Rng(4);
    let base = AdamParams { lr: 1e-2, weight_decay: 0.05, ..AdamParams::default() };
    let configs = [
        AdamParams { decoupled_weight_decay: true, amsgrad: false, ..base },
        AdamParams { decoupled_weight_decay: true, amsgrad: true, ..base },
        AdamParams { decoupled_weight_decay: false, amsgrad: true, bias_correction: false, ..base },
    ];
    let scale = 1024.0;
    // An inverse scale times a clip coefficient.
    let factor = (1.0 / scale) * 0.75;
    for (c, hp) in configs.iter().enumerate() {
        let mut got = states(&mut rng, hp.amsgrad, scale);
        let mut want = got.clone();
        let mut steps = 0i64;
        let mut applied = 0u64;
        // Applied, (skipped, for the first configuration), applied: bias corrections of steps 1 and 2
        // from the device counter.
        for round in 0..3 {
            let skipped = round == 1;
            if skipped && c > 0 {
                continue;
            }
            regrade(&mut rng, &mut got, &mut want, scale);
            let bad = if skipped { 3 } else { NO_BAD_TENSOR };
            adam(emu, &mut got, &steps, &bad, factor, hp);
            count_step(emu, &mut steps, &bad);
            if !skipped {
                applied += 1;
                reference_adam(&mut want, &AdamParams { step: applied, ..*hp }, factor);
            }
            assert_same_state(&format!("config {c} ({hp:?}) round {round}"), &got, &want);
            assert_eq!(steps, applied as i64, "the device step counter");
        }
    }
}
