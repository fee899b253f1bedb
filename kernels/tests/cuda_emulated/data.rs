//! Seeded test data of every type the kernels handle, and how results are compared.

use amp_kernels::Dtype;

use crate::common::{Owned, Rng, State};

/// The test tensors, in one table of 7 blocks of at most 1000 elements (`tables::CHUNK`): lengths giving
/// two blocks (the second a single element), exactly one block, none, short ones; every gradient type,
/// both working-copy types after f32 and f16 gradients, and no working copy. (Each block is a turn of
/// BLOCK_THREADS OS threads: the sizes are kept small.)
const SPECS: [(usize, Dtype, Option<Dtype>); 7] = [
    (800, Dtype::F32, Some(Dtype::Bf16)),
    (1000, Dtype::Bf16, Some(Dtype::Bf16)),
    (1001, Dtype::F16, Some(Dtype::F16)),
    (0, Dtype::F16, Some(Dtype::Bf16)),
    (7, Dtype::F16, Some(Dtype::Bf16)),
    (300, Dtype::Bf16, None),
    (64, Dtype::F32, Some(Dtype::F16)),
];

/// `n` values of magnitudes 2^lo .. 2^(hi+1) times `scale`.
fn scaled(rng: &mut Rng, n: usize, lo: i32, hi: i32, scale: f32) -> Vec<f32> {
    rng.vec(n, lo, hi).iter().map(|x| x * scale).collect()
}

/// Gradients of the [`SPECS`] types, magnitudes 2^lo .. 2^(hi+1) times `scale`.
pub fn gradients(rng: &mut Rng, lo: i32, hi: i32, scale: f32) -> Vec<Owned> {
    SPECS.iter().map(|&(n, grad, _)| Owned::new(grad, &scaled(rng, n, lo, hi, scale))).collect()
}

/// Optimizer states of the [`SPECS`] types (masters around 1, gradients 2^-6 .. 2^7 times `scale`).
pub fn states(rng: &mut Rng, with_c: bool, scale: f32) -> Vec<State> {
    SPECS.iter().map(|&(n, grad, working)| State::random(rng, n, grad, working, with_c, scale)).collect()
}

/// New gradients for both copies of the states.
pub fn regrade(rng: &mut Rng, a: &mut [State], b: &mut [State], scale: f32) {
    for (s, t) in a.iter_mut().zip(b) {
        s.grad = Owned::new(dtype(&s.grad), &scaled(rng, s.master.len(), -6, 6, scale));
        t.grad = s.grad.clone();
    }
}

pub fn dtype(o: &Owned) -> Dtype {
    o.view().dtype()
}

/// Distance in ulps of two finite f32 (consecutive representable values are 1 apart, across zero too).
pub fn ulps(a: f32, b: f32) -> u64 {
    let key = |x: f32| {
        let bits = i64::from(x.to_bits() as i32);
        if bits < 0 {
            i64::from(i32::MIN) - bits
        } else {
            bits
        }
    };
    key(a).abs_diff(key(b))
}
