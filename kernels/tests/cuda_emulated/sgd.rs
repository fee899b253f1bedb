//! `amp_sgd` (sgd.cu): every state array bit for bit, step after step, with and without momentum,
//! Nesterov, and a skipped first step.

use amp_kernels::cuda::{BLOCK_THREADS, NO_BAD_TENSOR};
use amp_kernels::optim::{SgdParams, SgdTensor};
use amp_kernels::reference;

use crate::common::{assert_same_state, Owned, Rng, State};
use crate::data::{regrade, states};
use crate::harness::{emulator, Emulator};
use crate::launch::Shared;
use crate::scale::count_step;
use crate::tables::{states_table, Row, Slot};

pub fn sgd<R: Row>(emu: &Emulator, states: &mut [R], steps: &i64, bad: &i32, factor: f32, hp: &SgdParams) {
    type Kernel =
        unsafe extern "C" fn(*const u64, i32, *const i64, *const i32, *const f32, f64, f64, f64, f64, i32);
    let m = emu.module("sgd");
    // SAFETY: amp_sgd's signature in sgd.cu.
    let kernel: Kernel = unsafe { m.kernel("amp_sgd") };
    let buffer = if hp.momentum != 0.0 { Slot::A } else { Slot::Absent };
    let table = states_table(states, &[Slot::Grad, Slot::Master, buffer, Slot::Working, Slot::Stream]);
    let (words, n) = (table.words(), table.n());
    let (steps, bad, factor) = (Shared::new(steps), Shared::new(bad), Shared::new(&factor));
    let nesterov = i32::from(hp.nesterov);
    let hp = *hp;
    m.launch(table.blocks(), BLOCK_THREADS, &|| {
        // SAFETY: the table holds the addresses, lengths and types of `states`' buffers (f32 masters, f32
        // or bf16 momentum buffers), borrowed mutably for the launch; the other pointers are live borrows.
        unsafe {
            kernel(
                words.get(),
                n,
                steps.get(),
                bad.get(),
                factor.get(),
                hp.lr,
                hp.weight_decay,
                hp.momentum,
                hp.dampening,
                nesterov,
            );
        }
    });
}

fn reference_sgd(states: &mut [State], hp: &SgdParams, factor: f32) {
    let mut tensors: Vec<SgdTensor<'_>> = states
        .iter_mut()
        .map(|s| SgdTensor {
            master: &mut s.master,
            grad: s.grad.view(),
            momentum_buffer: (hp.momentum != 0.0).then_some(&mut s.a[..]),
            working: s.working.as_mut().map(Owned::half_mut),
        })
        .collect();
    reference::sgd_step(&mut tensors, hp, factor);
}

#[test]
fn sgd_matches_the_reference_step_by_step() {
    let Some(emu) = emulator() else { return };
    let mut rng = Rng(5);
    let configs = [
        SgdParams { lr: 0.05, weight_decay: 1e-2, ..SgdParams::default() },
        SgdParams { lr: 0.05, momentum: 0.9, dampening: 0.1, weight_decay: 1e-2, ..SgdParams::default() },
        SgdParams { lr: 0.05, momentum: 0.9, nesterov: true, weight_decay: 5e-3, ..SgdParams::default() },
    ];
    let scale = 512.0;
    let factor = 1.0 / scale;
    for (c, hp) in configs.iter().enumerate() {
        let mut got = states(&mut rng, false, scale);
        let mut want = got.clone();
        let mut steps = 0i64;
        for round in 0..3 {
            // The second configuration skips its first round: its momentum buffers must still take the
            // next gradient as is. The others start applied.
            let skipped = round == 0;
            if skipped && c != 1 {
                continue;
            }
            regrade(&mut rng, &mut got, &mut want, scale);
            let bad = if skipped { 0 } else { NO_BAD_TENSOR };
            let first_step = steps == 0;
            sgd(emu, &mut got, &steps, &bad, factor, hp);
            count_step(emu, &mut steps, &bad);
            if !skipped {
                reference_sgd(&mut want, &SgdParams { first_step, ..*hp }, factor);
            }
            assert_same_state(&format!("config {c} ({hp:?}) round {round}"), &got, &want);
        }
        assert_eq!(steps, 2);
    }
}
