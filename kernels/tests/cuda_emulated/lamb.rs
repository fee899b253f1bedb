//! `amp_lamb_moments`, `amp_lamb_ratios` and `amp_lamb_apply` (lamb.cu): moments bit for bit, norms
//! within 1 ulp, masters bit for bit where the norms are, else within [`MASTER_ULPS`].

use amp_kernels::cuda::{BLOCK_THREADS, NO_BAD_TENSOR};
use amp_kernels::optim::{LambParams, LambTensor, TensorNorms};
use amp_kernels::reference;

use crate::common::{assert_same, assert_same_owned, Owned, Rng, State};
use crate::data::{dtype, states, ulps};
use crate::harness::{emulator, Emulator};
use crate::launch::Shared;
use crate::scale::count_step;
use crate::tables::{states_table, Row, Slot};

/// Masters may differ from the reference by this many ulps when a LAMB norm differs by one: the ratio
/// `lr * (||p|| / ||u||)` is then off by up to ~3 ulps, and `ratio * u` is far smaller than `p`.
const MASTER_ULPS: u64 = 4;

const LAMB_SLOTS: [Slot; 6] = [Slot::Grad, Slot::Master, Slot::A, Slot::B, Slot::Working, Slot::Stream];

/// Threads per block of `amp_lamb_ratios` (one per tensor), as launch.rs.
const RATIO_THREADS: u32 = 128;

/// LAMB's device scratch: two partial sums per block, two norms and a ratio per tensor.
pub struct LambScratch {
    pub partials: Vec<f64>,
    pub norms: Vec<f32>,
    pub ratios: Vec<f32>,
}

impl LambScratch {
    /// The scratch of a step on `states`, every value `fill`.
    pub fn for_states<R: Row>(states: &mut [R], fill: f32) -> Self {
        let blocks = states_table(states, &LAMB_SLOTS).blocks();
        LambScratch {
            partials: vec![f64::from(fill); 2 * blocks],
            norms: vec![fill; 2 * states.len()],
            ratios: vec![fill; states.len()],
        }
    }
}

pub fn lamb<R: Row>(
    emu: &Emulator,
    states: &mut [R],
    steps: &i64,
    bad: &i32,
    factor: f32,
    hp: &LambParams,
    scratch: &mut LambScratch,
) {
    type Moments = unsafe extern "C" fn(
        *const u64,
        i32,
        *const i64,
        *const i32,
        *const f32,
        f64,
        f64,
        f64,
        f64,
        i32,
        i32,
        i32,
        *mut f64,
    );
    type Ratios =
        unsafe extern "C" fn(*const u64, i32, *const i32, *const f64, f64, f64, i32, *mut f32, *mut f32);
    type Apply = unsafe extern "C" fn(
        *const u64,
        i32,
        *const i64,
        *const i32,
        f64,
        f64,
        f64,
        f64,
        i32,
        i32,
        *const f32,
    );
    let m = emu.module("lamb");
    // SAFETY: the signatures in lamb.cu.
    let (moments, ratios, apply): (Moments, Ratios, Apply) =
        unsafe { (m.kernel("amp_lamb_moments"), m.kernel("amp_lamb_ratios"), m.kernel("amp_lamb_apply")) };
    let table = states_table(states, &LAMB_SLOTS);
    assert!(scratch.partials.len() >= 2 * table.blocks() && scratch.ratios.len() >= table.tensors());
    assert!(scratch.norms.len() >= 2 * table.tensors());
    let (words, first_block, n) = (table.words(), table.first_block(), table.n());
    let (steps, bad, factor) = (Shared::new(steps), Shared::new(bad), Shared::new(&factor));
    let partials = Shared::new(scratch.partials.as_mut_ptr());
    let (norms, ratios_p) =
        (Shared::new(scratch.norms.as_mut_ptr()), Shared::new(scratch.ratios.as_mut_ptr()));
    let decoupled = i32::from(hp.decoupled_weight_decay);
    let bias_correction = i32::from(hp.bias_correction);
    let (grad_averaging, always_adapt) = (i32::from(hp.grad_averaging), i32::from(hp.always_adapt));
    let hp = *hp;
    m.launch(table.blocks(), BLOCK_THREADS, &|| {
        // SAFETY: the table holds the addresses, lengths and types of `states`' buffers (f32 masters, f32
        // or bf16 moments), borrowed mutably for the launch; `partials` has two slots per block; the other
        // pointers are live borrows.
        unsafe {
            moments(
                words.get(),
                n,
                steps.get(),
                bad.get(),
                factor.get(),
                hp.beta1,
                hp.beta2,
                hp.eps,
                hp.weight_decay,
                decoupled,
                bias_correction,
                grad_averaging,
                partials.get(),
            );
        }
    });
    m.launch(table.tensors().div_ceil(RATIO_THREADS as usize), RATIO_THREADS, &|| {
        // SAFETY: `first_block` has n + 1 entries, `norms` 2n, `ratios` n, `partials` two per block.
        unsafe {
            ratios(
                first_block.get(),
                n,
                bad.get(),
                partials.get(),
                hp.lr,
                hp.weight_decay,
                always_adapt,
                norms.get(),
                ratios_p.get(),
            );
        }
    });
    m.launch(table.blocks(), BLOCK_THREADS, &|| {
        // SAFETY: as for the moments; `ratios` has n entries.
        unsafe {
            apply(
                words.get(),
                n,
                steps.get(),
                bad.get(),
                hp.beta1,
                hp.beta2,
                hp.eps,
                hp.weight_decay,
                decoupled,
                bias_correction,
                ratios_p.get(),
            );
        }
    });
}

fn reference_lamb(states: &mut [State], hp: &LambParams, factor: f32) -> Vec<TensorNorms> {
    let mut norms = vec![TensorNorms::default(); states.len()];
    let mut tensors: Vec<LambTensor<'_>> = states
        .iter_mut()
        .map(|s| LambTensor {
            master: &mut s.master,
            grad: s.grad.view(),
            exp_avg: &mut s.a,
            exp_avg_sq: &mut s.b,
            working: s.working.as_mut().map(Owned::half_mut),
        })
        .collect();
    reference::lamb_step(&mut tensors, hp, factor, &mut norms);
    norms
}

#[test]
fn lamb_matches_the_reference() {
    let Some(emu) = emulator() else { return };
    let mut rng = Rng(6);
    let base = LambParams { lr: 1e-2, ..LambParams::default() };
    let configs = [
        base,
        LambParams { decoupled_weight_decay: false, ..base },
        LambParams {
            weight_decay: 0.0,
            always_adapt: true,
            grad_averaging: false,
            bias_correction: false,
            ..base
        },
        LambParams { weight_decay: 0.0, ..base },
    ];
    let scale = 256.0;
    let factor = 1.0 / scale;
    let mut tally = Tally::default();
    for (c, hp) in configs.iter().enumerate() {
        let mut got = states(&mut rng, false, scale);
        // A zero master: ||p|| = 0, so the ratio is lr alone.
        got[4].master.fill(0.0);
        let mut want = got.clone();
        // One step per configuration, at various device step counts (the bias corrections).
        let mut steps = [0i64, 1, 4, 9][c];
        let mut scratch = LambScratch::for_states(&mut got, f32::NAN);
        let bad = NO_BAD_TENSOR;
        lamb(emu, &mut got, &steps, &bad, factor, hp, &mut scratch);
        count_step(emu, &mut steps, &bad);
        let step = u64::try_from(steps).expect("a positive count");
        let norms = reference_lamb(&mut want, &LambParams { step, ..*hp }, factor);
        let what = format!("config {c} ({hp:?})");
        for (t, (g, w)) in got.iter().zip(&want).enumerate() {
            // Moments come before the norms: bit for bit.
            assert_same(&format!("{what} t{t} exp_avg"), &g.a, &w.a);
            assert_same(&format!("{what} t{t} exp_avg_sq"), &g.b, &w.b);
        }
        tally.check(&what, got.iter().zip(&want), &scratch, &norms);
    }
    tally.report("lamb");
}

/// What the LAMB comparisons found: norms bit-identical out of all, masters off, the worst distance.
#[derive(Default)]
pub struct Tally {
    norms_exact: usize,
    norms_total: usize,
    masters_off: usize,
    worst: u64,
}

impl Tally {
    /// Checks one step's norms (`scratch`, against the reference's `norms`) within 1 ulp, and each
    /// tensor's master and working copy: bit for bit where both of its norms are, else the masters
    /// within [`MASTER_ULPS`] and the working copy the rounding of the kernel's own master.
    pub fn check<'a>(
        &mut self,
        what: &str,
        pairs: impl Iterator<Item = (&'a State, &'a State)>,
        scratch: &LambScratch,
        norms: &[TensorNorms],
    ) {
        for (t, (g, w)) in pairs.enumerate() {
            // Norms: f64 sums in another order (lanes and a tree vs sequential), rounded to f32.
            let (param, update) = (scratch.norms[2 * t], scratch.norms[2 * t + 1]);
            let (want_param, want_update) = (norms[t].param, norms[t].update);
            assert!(ulps(param, want_param) <= 1, "{what} t{t}: ||p|| {param:e} vs {want_param:e}");
            assert!(ulps(update, want_update) <= 1, "{what} t{t}: ||u|| {update:e} vs {want_update:e}");
            self.norms_total += 2;
            self.norms_exact += usize::from(param == want_param) + usize::from(update == want_update);
            if param == want_param && update == want_update {
                // Same ratio: the update is elementwise, bit for bit.
                assert_same(&format!("{what} t{t} master"), &g.master, &w.master);
                if let (Some(x), Some(y)) = (&g.working, &w.working) {
                    assert_same_owned(&format!("{what} t{t} working"), x, y);
                }
            } else {
                // A ratio a few ulps off: the masters within MASTER_ULPS, the working copy the rounding
                // of the kernel's own master.
                for (i, (&x, &y)) in g.master.iter().zip(&w.master).enumerate() {
                    let d = ulps(x, y);
                    assert!(d <= MASTER_ULPS, "{what} t{t} master[{i}]: {x:e} vs {y:e} ({d} ulps)");
                    self.worst = self.worst.max(d);
                    self.masters_off += usize::from(d != 0);
                }
                if let Some(x) = &g.working {
                    assert_same_owned(&format!("{what} t{t} working"), x, &Owned::new(dtype(x), &g.master));
                }
            }
        }
    }

    pub fn report(&self, name: &str) {
        let Tally { norms_exact, norms_total, masters_off, worst } = self;
        eprintln!(
            "{name}: {norms_exact} of {norms_total} norms bit-identical; {masters_off} masters differ, by at \
             most {worst} ulps"
        );
    }
}
