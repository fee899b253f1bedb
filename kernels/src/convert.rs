//! f32 <-> f16 / bf16 conversion of whole tensors, in parallel chunks.
//!
//! Semantics are `half`'s, bit for bit: widening is exact (bf16: a 16-bit shift), except that a
//! signalling NaN comes out quiet; narrowing rounds to nearest, ties to even,
//! overflows to infinity, keeps subnormals, and turns a NaN into a quiet NaN of the same sign that keeps
//! the top mantissa bits. (bf16 is the top half of an f32; f16 uses F16C `vcvtps2ph` on the AVX2 path.)

use half::{bf16, f16};

use crate::backend::{dispatch, Backend, Element};
use crate::par::{self, Kernel, One, Piece};
use crate::{GradSlice, HalfSliceMut, Isa};

/// `dst = src` as f32 (a copy for an f32 `src`). Runs on [`Isa::detect`].
///
/// # Panics
/// If the lengths differ.
pub fn widen(src: GradSlice<'_>, dst: &mut [f32]) {
    widen_with(Isa::detect(), src, dst);
}

/// [`widen`] on an explicit code path.
///
/// # Panics
/// If the lengths differ.
pub fn widen_with(isa: Isa, src: GradSlice<'_>, dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widen: source and destination lengths differ");
    par::run(One(Widen { src, dst }), &Convert(Backend::new(isa)));
}

/// `dst = src` narrowed to f16 / bf16 (the working-copy refresh). Runs on [`Isa::detect`].
///
/// # Panics
/// If the lengths differ.
pub fn narrow(src: &[f32], dst: HalfSliceMut<'_>) {
    narrow_with(Isa::detect(), src, dst);
}

/// [`narrow`] on an explicit code path.
///
/// # Panics
/// If the lengths differ.
pub fn narrow_with(isa: Isa, src: &[f32], dst: HalfSliceMut<'_>) {
    assert_eq!(src.len(), dst.len(), "narrow: source and destination lengths differ");
    par::run(One(Narrow { src, dst }), &Convert(Backend::new(isa)));
}

/// `dst += src` widened to f32, element by element (one f32 addition each: the gradient accumulator's
/// sum of a micro-batch into the window's). Runs on [`Isa::detect`].
///
/// # Panics
/// If the lengths differ.
pub fn add_widened(src: GradSlice<'_>, dst: &mut [f32]) {
    add_widened_with(Isa::detect(), src, dst);
}

/// [`add_widened`] on an explicit code path.
///
/// # Panics
/// If the lengths differ.
pub fn add_widened_with(isa: Isa, src: GradSlice<'_>, dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "add_widened: source and destination lengths differ");
    par::run(One(AddWidened(Widen { src, dst })), &Convert(Backend::new(isa)));
}

/// [`widen`] of one block on the calling thread, for loops inside other kernels (on the conversions'
/// one x86 path, AVX2 + F16C, where the CPU has it).
pub(crate) fn widen_block<T: Element>(src: &[T], dst: &mut [f32]) {
    widen_piece(Backend::new(Isa::Avx2), src, dst);
}

/// [`narrow`] of one block on the calling thread, for loops inside other kernels (as [`widen_block`]).
pub(crate) fn narrow_block<T: Element>(src: &[f32], dst: &mut [T]) {
    narrow_piece(Backend::new(Isa::Avx2), src, dst);
}

struct Widen<'a> {
    src: GradSlice<'a>,
    dst: &'a mut [f32],
}

struct Narrow<'a> {
    src: &'a [f32],
    dst: HalfSliceMut<'a>,
}

/// A [`Widen`] whose values are added to the destination's.
struct AddWidened<'a>(Widen<'a>);

impl Piece for Widen<'_> {
    fn len(&self) -> usize {
        self.dst.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (sa, sb) = self.src.split_at(mid);
        let (da, db) = self.dst.split_at_mut(mid);
        (Widen { src: sa, dst: da }, Widen { src: sb, dst: db })
    }
}

impl Piece for AddWidened<'_> {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (a, b) = self.0.split_at(mid);
        (AddWidened(a), AddWidened(b))
    }
}

impl Piece for Narrow<'_> {
    fn len(&self) -> usize {
        self.src.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (sa, sb) = self.src.split_at(mid);
        let (da, db) = self.dst.split_at(mid);
        (Narrow { src: sa, dst: da }, Narrow { src: sb, dst: db })
    }
}

struct Convert(Backend);

fn widen_piece<T: Element>(backend: Backend, src: &[T], dst: &mut [f32]) {
    dispatch!(backend, kernels::widen::<T>(src, dst));
}

fn narrow_piece<T: Element>(backend: Backend, src: &[f32], dst: &mut [T]) {
    dispatch!(backend, kernels::narrow::<T>(src, dst));
}

impl<'a> Kernel<One<Widen<'a>>> for Convert {
    type Acc = ();
    type Out = ();
    fn leaf(&self, p: Widen<'a>) {
        match p.src {
            GradSlice::F32(s) => p.dst.copy_from_slice(s),
            GradSlice::F16(s) => widen_piece::<f16>(self.0, s, p.dst),
            GradSlice::Bf16(s) => widen_piece::<bf16>(self.0, s, p.dst),
        }
    }
    fn merge(&self, (): (), (): ()) {}
    fn finish(&self, _index: usize, (): (), (): ()) {}
    fn join(&self, (): (), (): ()) {}
    fn empty(&self) {}
}

/// Elements a half source is widened in at a time, on the stack, before they are added.
const ADD_BLOCK: usize = 1024;

impl<'a> Kernel<One<AddWidened<'a>>> for Convert {
    type Acc = ();
    type Out = ();
    fn leaf(&self, AddWidened(p): AddWidened<'a>) {
        fn add(src: &[f32], dst: &mut [f32]) {
            for (d, s) in dst.iter_mut().zip(src) {
                *d += s;
            }
        }
        let mut block = [0f32; ADD_BLOCK];
        match p.src {
            GradSlice::F32(s) => add(s, p.dst),
            GradSlice::F16(s) => {
                for (src, dst) in s.chunks(ADD_BLOCK).zip(p.dst.chunks_mut(ADD_BLOCK)) {
                    widen_piece::<f16>(self.0, src, &mut block[..src.len()]);
                    add(&block[..src.len()], dst);
                }
            }
            GradSlice::Bf16(s) => {
                for (src, dst) in s.chunks(ADD_BLOCK).zip(p.dst.chunks_mut(ADD_BLOCK)) {
                    widen_piece::<bf16>(self.0, src, &mut block[..src.len()]);
                    add(&block[..src.len()], dst);
                }
            }
        }
    }
    fn merge(&self, (): (), (): ()) {}
    fn finish(&self, _index: usize, (): (), (): ()) {}
    fn join(&self, (): (), (): ()) {}
    fn empty(&self) {}
}

impl<'a> Kernel<One<Narrow<'a>>> for Convert {
    type Acc = ();
    type Out = ();
    fn leaf(&self, p: Narrow<'a>) {
        match p.dst {
            HalfSliceMut::F16(d) => narrow_piece::<f16>(self.0, p.src, d),
            HalfSliceMut::Bf16(d) => narrow_piece::<bf16>(self.0, p.src, d),
        }
    }
    fn merge(&self, (): (), (): ()) {}
    fn finish(&self, _index: usize, (): (), (): ()) {}
    fn join(&self, (): (), (): ()) {}
    fn empty(&self) {}
}
