//! Dtype-tagged slices: the tensors the kernels take, as borrowed memory.
//!
//! Gradients arrive in the dtype backward produced them in (f32, f16 or bf16); half working copies are
//! f16 or bf16. These enums let one multi-tensor call take a list mixing dtypes without generics leaking
//! into the API. Everything is plain borrowed memory: no candle types.

use half::{bf16, f16};

/// Element type of a [`GradSlice`] / [`GradSliceMut`] / [`HalfSliceMut`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16: the top 16 bits of a binary32.
    Bf16,
}

/// A read-only gradient (or any tensor) in f32, f16 or bf16.
#[derive(Clone, Copy, Debug)]
pub enum GradSlice<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// f16 elements.
    F16(&'a [f16]),
    /// bf16 elements.
    Bf16(&'a [bf16]),
}

/// A mutable gradient (or any tensor) in f32, f16 or bf16.
#[derive(Debug)]
pub enum GradSliceMut<'a> {
    /// f32 elements.
    F32(&'a mut [f32]),
    /// f16 elements.
    F16(&'a mut [f16]),
    /// bf16 elements.
    Bf16(&'a mut [bf16]),
}

/// A mutable half-precision working copy (the weights the forward pass reads).
#[derive(Debug)]
pub enum HalfSliceMut<'a> {
    /// f16 elements.
    F16(&'a mut [f16]),
    /// bf16 elements.
    Bf16(&'a mut [bf16]),
}

impl<'a> GradSlice<'a> {
    /// Number of elements.
    #[must_use]
    pub fn len(&self) -> usize {
        match self {
            GradSlice::F32(s) => s.len(),
            GradSlice::F16(s) => s.len(),
            GradSlice::Bf16(s) => s.len(),
        }
    }

    /// Whether there are no elements.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element type.
    #[must_use]
    pub fn dtype(&self) -> Dtype {
        match self {
            GradSlice::F32(_) => Dtype::F32,
            GradSlice::F16(_) => Dtype::F16,
            GradSlice::Bf16(_) => Dtype::Bf16,
        }
    }

    /// Splits into `[0, mid)` and `[mid, len)`.
    ///
    /// # Panics
    /// If `mid > len`.
    #[must_use]
    pub fn split_at(self, mid: usize) -> (GradSlice<'a>, GradSlice<'a>) {
        match self {
            GradSlice::F32(s) => {
                let (a, b) = s.split_at(mid);
                (GradSlice::F32(a), GradSlice::F32(b))
            }
            GradSlice::F16(s) => {
                let (a, b) = s.split_at(mid);
                (GradSlice::F16(a), GradSlice::F16(b))
            }
            GradSlice::Bf16(s) => {
                let (a, b) = s.split_at(mid);
                (GradSlice::Bf16(a), GradSlice::Bf16(b))
            }
        }
    }
}

impl<'a> GradSliceMut<'a> {
    /// Number of elements.
    #[must_use]
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether there are no elements.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element type.
    #[must_use]
    pub fn dtype(&self) -> Dtype {
        self.as_slice().dtype()
    }

    /// A read-only view of the same elements.
    #[must_use]
    pub fn as_slice(&self) -> GradSlice<'_> {
        match self {
            GradSliceMut::F32(s) => GradSlice::F32(s),
            GradSliceMut::F16(s) => GradSlice::F16(s),
            GradSliceMut::Bf16(s) => GradSlice::Bf16(s),
        }
    }

    /// A shorter-lived mutable view of the same elements.
    #[must_use]
    pub fn reborrow(&mut self) -> GradSliceMut<'_> {
        match self {
            GradSliceMut::F32(s) => GradSliceMut::F32(s),
            GradSliceMut::F16(s) => GradSliceMut::F16(s),
            GradSliceMut::Bf16(s) => GradSliceMut::Bf16(s),
        }
    }

    /// Splits into `[0, mid)` and `[mid, len)`.
    ///
    /// # Panics
    /// If `mid > len`.
    #[must_use]
    pub fn split_at(self, mid: usize) -> (GradSliceMut<'a>, GradSliceMut<'a>) {
        match self {
            GradSliceMut::F32(s) => {
                let (a, b) = s.split_at_mut(mid);
                (GradSliceMut::F32(a), GradSliceMut::F32(b))
            }
            GradSliceMut::F16(s) => {
                let (a, b) = s.split_at_mut(mid);
                (GradSliceMut::F16(a), GradSliceMut::F16(b))
            }
            GradSliceMut::Bf16(s) => {
                let (a, b) = s.split_at_mut(mid);
                (GradSliceMut::Bf16(a), GradSliceMut::Bf16(b))
            }
        }
    }
}

impl<'a> HalfSliceMut<'a> {
    /// Number of elements.
    #[must_use]
    pub fn len(&self) -> usize {
        match self {
            HalfSliceMut::F16(s) => s.len(),
            HalfSliceMut::Bf16(s) => s.len(),
        }
    }

    /// Whether there are no elements.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element type.
    #[must_use]
    pub fn dtype(&self) -> Dtype {
        match self {
            HalfSliceMut::F16(_) => Dtype::F16,
            HalfSliceMut::Bf16(_) => Dtype::Bf16,
        }
    }

    /// A shorter-lived mutable view of the same elements.
    #[must_use]
    pub fn reborrow(&mut self) -> HalfSliceMut<'_> {
        match self {
            HalfSliceMut::F16(s) => HalfSliceMut::F16(s),
            HalfSliceMut::Bf16(s) => HalfSliceMut::Bf16(s),
        }
    }

    /// Splits into `[0, mid)` and `[mid, len)`.
    ///
    /// # Panics
    /// If `mid > len`.
    #[must_use]
    pub fn split_at(self, mid: usize) -> (HalfSliceMut<'a>, HalfSliceMut<'a>) {
        match self {
            HalfSliceMut::F16(s) => {
                let (a, b) = s.split_at_mut(mid);
                (HalfSliceMut::F16(a), HalfSliceMut::F16(b))
            }
            HalfSliceMut::Bf16(s) => {
                let (a, b) = s.split_at_mut(mid);
                (HalfSliceMut::Bf16(a), HalfSliceMut::Bf16(b))
            }
        }
    }
}

macro_rules! impl_from {
    ($ty:ident, $variant:ident, $elem:ty) => {
        impl<'a> From<&'a [$elem]> for GradSlice<'a> {
            fn from(s: &'a [$elem]) -> Self {
                GradSlice::$variant(s)
            }
        }
        impl<'a> From<&'a mut [$elem]> for $ty<'a> {
            fn from(s: &'a mut [$elem]) -> Self {
                $ty::$variant(s)
            }
        }
    };
}

impl_from!(GradSliceMut, F32, f32);
impl_from!(GradSliceMut, F16, f16);
impl_from!(GradSliceMut, Bf16, bf16);

impl<'a> From<&'a mut [f16]> for HalfSliceMut<'a> {
    fn from(s: &'a mut [f16]) -> Self {
        HalfSliceMut::F16(s)
    }
}

impl<'a> From<&'a mut [bf16]> for HalfSliceMut<'a> {
    fn from(s: &'a mut [bf16]) -> Self {
        HalfSliceMut::Bf16(s)
    }
}

// The slice types as work for the parallel driver.

impl crate::par::Piece for GradSlice<'_> {
    fn len(&self) -> usize {
        GradSlice::len(self)
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        GradSlice::split_at(self, mid)
    }
}

impl crate::par::Piece for GradSliceMut<'_> {
    fn len(&self) -> usize {
        GradSliceMut::len(self)
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        GradSliceMut::split_at(self, mid)
    }
}

impl<'a> crate::par::Tensors for &'a mut [GradSliceMut<'_>] {
    type Piece = GradSliceMut<'a>;
    type Slot = ();
    fn count(&self) -> usize {
        self.len()
    }
    fn len_of(&self, i: usize) -> usize {
        self[i].len()
    }
    fn split_at(self, i: usize) -> (Self, Self) {
        self.split_at_mut(i)
    }
    fn into_single(self) -> (GradSliceMut<'a>, ()) {
        (self[0].reborrow(), ())
    }
}

impl<'a> crate::par::Tensors for &[GradSlice<'a>] {
    type Piece = GradSlice<'a>;
    type Slot = ();
    fn count(&self) -> usize {
        self.len()
    }
    fn len_of(&self, i: usize) -> usize {
        self[i].len()
    }
    fn split_at(self, i: usize) -> (Self, Self) {
        <[GradSlice<'a>]>::split_at(self, i)
    }
    fn into_single(self) -> (GradSlice<'a>, ()) {
        (self[0], ())
    }
}

/// A stored float element, widened to f32 and narrowed back a block at a time (exact widening,
/// round-to-nearest-even narrowing as `half` does, in AVX2 / F16C vectors where the CPU has them:
/// [`crate::convert`]'s kernels, not `half`'s slice conversions, which convert bf16 one value at a time).
pub(crate) trait Float: Copy + Default + Send + Sync {
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(src: &[f32], dst: &mut [Self]);
    /// The elements themselves when they are f32: a loop can read them where they lie instead of
    /// widening a copy.
    fn as_f32(_src: &[Self]) -> Option<&[f32]> {
        None
    }
    /// As [`Float::as_f32`], to write.
    fn as_f32_mut(_dst: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
}

impl Float for f32 {
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn narrow(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn as_f32(src: &[f32]) -> Option<&[f32]> {
        Some(src)
    }
    fn as_f32_mut(dst: &mut [f32]) -> Option<&mut [f32]> {
        Some(dst)
    }
}

impl Float for f16 {
    fn widen(src: &[f16], dst: &mut [f32]) {
        crate::convert::widen_block(src, dst);
    }
    fn narrow(src: &[f32], dst: &mut [f16]) {
        crate::convert::narrow_block(src, dst);
    }
}

impl Float for bf16 {
    fn widen(src: &[bf16], dst: &mut [f32]) {
        crate::convert::widen_block(src, dst);
    }
    fn narrow(src: &[f32], dst: &mut [bf16]) {
        crate::convert::narrow_block(src, dst);
    }
}
