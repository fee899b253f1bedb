//! Optimizer states whose buffers are kept in bf16, for the bf16-state kernels' tests.

use half::bf16;

use super::{assert_same, assert_same_owned, State};

/// A [`State`] with its buffers `a` and `b` rounded to bf16 (nearest), as an optimizer that has run a
/// while holds them: Adam's and LAMB's moments `m` = `a`, `v` = `b`; SGD's momentum buffer `a`.
#[derive(Clone)]
pub struct Bf16State {
    pub state: State,
    pub a: Vec<bf16>,
    pub b: Vec<bf16>,
}

/// `states` with their buffers rounded to bf16.
pub fn bf16_states(states: Vec<State>) -> Vec<Bf16State> {
    let round = |x: &[f32]| x.iter().map(|&x| bf16::from_f32(x)).collect();
    states.into_iter().map(|s| Bf16State { a: round(&s.a), b: round(&s.b), state: s }).collect()
}

/// Asserts masters, both bf16 buffers (named `names` in messages) and working copies bit-identical.
#[track_caller]
pub fn assert_same_bf16_states(what: &str, names: [&str; 2], x: &[Bf16State], y: &[Bf16State]) {
    let bits = |v: &[bf16]| v.iter().map(|b| b.to_bits()).collect::<Vec<u16>>();
    for (i, (s, t)) in x.iter().zip(y).enumerate() {
        assert_same(&format!("{what} t{i} master"), &s.state.master, &t.state.master);
        assert_eq!(bits(&s.a), bits(&t.a), "{what} t{i} {}", names[0]);
        assert_eq!(bits(&s.b), bits(&t.b), "{what} t{i} {}", names[1]);
        if let (Some(w), Some(v)) = (&s.state.working, &t.state.working) {
            assert_same_owned(&format!("{what} t{i} working"), w, v);
        }
    }
}
