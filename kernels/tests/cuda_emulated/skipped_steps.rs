//! A step whose flag is set (a non-finite gradient somewhere) changes nothing: not the optimizers'
//! states, not LAMB's scratch, not the step counter.

use amp_kernels::optim::{AdamParams, LambParams, SgdParams};

use crate::adam::adam;
use crate::common::{assert_same_state, Rng};
use crate::data::states;
use crate::harness::emulator;
use crate::lamb::{lamb, LambScratch};
use crate::scale::count_step;
use crate::sgd::sgd;

#[test]
fn skipped_steps_change_nothing() {
    let Some(emu) = emulator() else { return };
    let mut rng = Rng(8);
    let scale = 1024.0;
    // Any flag value but AMP_NO_BAD_TENSOR skips (here: tensor 3 held a non-finite value).
    let bad = 3;
    let mut steps = 5i64;

    let mut got = states(&mut rng, true, scale);
    let before = got.clone();
    adam(emu, &mut got, &steps, &bad, 1.0 / scale, &AdamParams { amsgrad: true, ..AdamParams::default() });
    assert_same_state("adam", &got, &before);

    let mut got = states(&mut rng, false, scale);
    let before = got.clone();
    let hp = SgdParams { lr: 0.1, momentum: 0.9, weight_decay: 0.1, ..SgdParams::default() };
    sgd(emu, &mut got, &steps, &bad, 1.0 / scale, &hp);
    assert_same_state("sgd", &got, &before);

    let mut got = states(&mut rng, false, scale);
    let before = got.clone();
    let mut scratch = LambScratch::for_states(&mut got, -7.0);
    lamb(emu, &mut got, &steps, &bad, 1.0 / scale, &LambParams::default(), &mut scratch);
    assert_same_state("lamb", &got, &before);
    assert!(scratch.partials.iter().all(|&x| x == -7.0), "lamb partials written");
    assert!(scratch.norms.iter().chain(&scratch.ratios).all(|&x| x == -7.0), "lamb norms written");

    count_step(emu, &mut steps, &bad);
    assert_eq!(steps, 5, "a skipped step is not counted");
}
