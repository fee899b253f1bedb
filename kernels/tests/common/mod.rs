//! Shared test helpers: deterministic data, owned tensors of any dtype, bitwise comparison.
#![allow(dead_code)]

pub mod bf16_state;

use amp_kernels::{Dtype, GradSlice, GradSliceMut, HalfSliceMut};
use half::{bf16, f16};

/// Lengths every kernel is tested on: empty, shorter than a vector, exact vectors, tails around 8 and 16,
/// a multi-block piece, and one element past a 64 Ki leaf (a second leaf holding only a tail).
pub const LENGTHS: [usize; 9] = [0, 1, 7, 8, 15, 16, 17, 1000, 65537];

/// Gradient dtypes.
pub const DTYPES: [Dtype; 3] = [Dtype::F32, Dtype::F16, Dtype::Bf16];

/// splitmix64: deterministic, dependency-free.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Signed value with magnitude spread over 2^lo .. 2^hi.
    pub fn spread(&mut self, lo: i32, hi: i32) -> f32 {
        let e = lo + (self.next_u64() % (hi - lo + 1) as u64) as i32;
        let sign = if self.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
        sign * (1.0 + self.unit()) * 2f32.powi(e)
    }

    pub fn vec(&mut self, n: usize, lo: i32, hi: i32) -> Vec<f32> {
        (0..n).map(|_| self.spread(lo, hi)).collect()
    }

    /// Positive values (second moments).
    pub fn vec_pos(&mut self, n: usize, lo: i32, hi: i32) -> Vec<f32> {
        (0..n).map(|_| self.spread(lo, hi).abs()).collect()
    }
}

/// Whether two f32 are the same bits, or both NaN (IEEE leaves NaN payloads of two-NaN operations open).
pub fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Asserts two f32 slices are [`same`] element-wise.
#[track_caller]
pub fn assert_same(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    if let Some(i) = (0..a.len()).find(|&i| !same(a[i], b[i])) {
        panic!(
            "{what}[{i}] of {}: {:e} ({:#010x}) vs {:e} ({:#010x})",
            a.len(),
            a[i],
            a[i].to_bits(),
            b[i],
            b[i].to_bits()
        );
    }
}

/// An owned tensor in any dtype.
#[derive(Clone, Debug)]
pub enum Owned {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

impl Owned {
    /// `values` rounded to `dtype`.
    pub fn new(dtype: Dtype, values: &[f32]) -> Owned {
        match dtype {
            Dtype::F32 => Owned::F32(values.to_vec()),
            Dtype::F16 => Owned::F16(values.iter().map(|&x| f16::from_f32(x)).collect()),
            Dtype::Bf16 => Owned::Bf16(values.iter().map(|&x| bf16::from_f32(x)).collect()),
        }
    }

    pub fn len(&self) -> usize {
        self.view().len()
    }

    pub fn view(&self) -> GradSlice<'_> {
        match self {
            Owned::F32(v) => GradSlice::F32(v),
            Owned::F16(v) => GradSlice::F16(v),
            Owned::Bf16(v) => GradSlice::Bf16(v),
        }
    }

    pub fn view_mut(&mut self) -> GradSliceMut<'_> {
        match self {
            Owned::F32(v) => GradSliceMut::F32(v),
            Owned::F16(v) => GradSliceMut::F16(v),
            Owned::Bf16(v) => GradSliceMut::Bf16(v),
        }
    }

    /// The half view of an f16 / bf16 tensor (working copies).
    pub fn half_mut(&mut self) -> HalfSliceMut<'_> {
        match self {
            Owned::F16(v) => HalfSliceMut::F16(v),
            Owned::Bf16(v) => HalfSliceMut::Bf16(v),
            Owned::F32(_) => panic!("not a half tensor"),
        }
    }

    pub fn get(&self, i: usize) -> f32 {
        amp_kernels::reference::get(self.view(), i)
    }

    pub fn set(&mut self, i: usize, x: f32) {
        amp_kernels::reference::set(&mut self.view_mut(), i, x);
    }

    pub fn to_f32(&self) -> Vec<f32> {
        (0..self.len()).map(|i| self.get(i)).collect()
    }
}

/// Asserts two tensors of the same dtype hold the same bits (NaNs: both NaN).
#[track_caller]
pub fn assert_same_owned(what: &str, a: &Owned, b: &Owned) {
    assert_same(what, &a.to_f32(), &b.to_f32());
    let raw = |o: &Owned| -> Vec<u32> {
        match o {
            Owned::F32(v) => v.iter().map(|x| if x.is_nan() { 0x7FC0_0000 } else { x.to_bits() }).collect(),
            Owned::F16(v) => {
                v.iter().map(|x| if x.is_nan() { 0x7E00 } else { u32::from(x.to_bits()) }).collect()
            }
            Owned::Bf16(v) => {
                v.iter().map(|x| if x.is_nan() { 0x7FC0 } else { u32::from(x.to_bits()) }).collect()
            }
        }
    };
    assert_eq!(raw(a), raw(b), "{what}: raw bits");
}

/// One tensor per entry of [`LENGTHS`], values spread over 2^lo .. 2^hi, in `dtype`.
pub fn tensor_set(rng: &mut Rng, dtype: Dtype, lo: i32, hi: i32) -> Vec<Owned> {
    LENGTHS.iter().map(|&n| Owned::new(dtype, &rng.vec(n, lo, hi))).collect()
}

pub fn views(ts: &[Owned]) -> Vec<GradSlice<'_>> {
    ts.iter().map(Owned::view).collect()
}

pub fn views_mut(ts: &mut [Owned]) -> Vec<GradSliceMut<'_>> {
    ts.iter_mut().map(Owned::view_mut).collect()
}

/// Owned state of one parameter tensor for optimizer tests: master, gradient, up to three f32 state
/// arrays (Adam: m, v, v_max; SGD: momentum buffer; LAMB: m, v) and an optional working copy.
#[derive(Clone, Debug)]
pub struct State {
    pub master: Vec<f32>,
    pub grad: Owned,
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    pub c: Option<Vec<f32>>,
    pub working: Option<Owned>,
}

impl State {
    /// Random state of `n` elements: masters around 1, gradients of magnitude 2^-6..2^6 times `scale`,
    /// moments of plausible sizes (after a few steps).
    pub fn random(
        rng: &mut Rng,
        n: usize,
        grad: Dtype,
        working: Option<Dtype>,
        with_c: bool,
        scale: f32,
    ) -> State {
        let master = rng.vec(n, -4, 1);
        let g: Vec<f32> = rng.vec(n, -6, 6).iter().map(|x| x * scale).collect();
        State {
            working: working.map(|d| Owned::new(d, &master)),
            master,
            grad: Owned::new(grad, &g),
            a: rng.vec(n, -8, 2),
            b: rng.vec_pos(n, -16, 4),
            c: with_c.then(|| rng.vec_pos(n, -16, 4)),
        }
    }
}

/// Asserts every array of two states is bit-identical (NaNs: both NaN).
#[track_caller]
pub fn assert_same_state(what: &str, x: &[State], y: &[State]) {
    for (i, (s, t)) in x.iter().zip(y).enumerate() {
        assert_same(&format!("{what} t{i} master"), &s.master, &t.master);
        assert_same(&format!("{what} t{i} a"), &s.a, &t.a);
        assert_same(&format!("{what} t{i} b"), &s.b, &t.b);
        if let (Some(c), Some(d)) = (&s.c, &t.c) {
            assert_same(&format!("{what} t{i} c"), c, d);
        }
        if let (Some(w), Some(v)) = (&s.working, &t.working) {
            assert_same_owned(&format!("{what} t{i} working"), w, v);
        }
    }
}

/// One state per entry of [`LENGTHS`].
pub fn state_set(rng: &mut Rng, grad: Dtype, working: Option<Dtype>, with_c: bool, scale: f32) -> Vec<State> {
    LENGTHS.iter().map(|&n| State::random(rng, n, grad, working, with_c, scale)).collect()
}

/// Working-copy choices.
pub const WORKING: [Option<Dtype>; 3] = [None, Some(Dtype::F16), Some(Dtype::Bf16)];
