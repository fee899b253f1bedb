//! Multi-tensor parallel driver: one deterministic work split over a list of tensors.
//!
//! The element space of all tensors is cut into leaves of at most [`CHUNK`] elements: a tensor longer
//! than `CHUNK` is cut at multiples of `CHUNK` from its start; consecutive short tensors whose total is at
//! most `CHUNK` form one leaf and run one after the other. Leaves run in parallel through `rayon::join`,
//! bisecting first the tensor list (at the tensor boundary nearest the middle element) and then single
//! tensors (at the multiple of `CHUNK` nearest their middle).
//!
//! The split depends only on the tensor lengths, never on the thread count or on timing, and results
//! combine in the order of the split tree. Reductions (norms, first non-finite tensor) are therefore
//! deterministic. `rayon::join` keeps its jobs on the stack: the driver allocates nothing. Many small
//! tensors cost the same per byte as one large one, since no leaf is smaller than necessary.

/// Maximum elements per leaf: 64 Ki (256 KiB of f32), large enough that a `rayon::join` (~1 µs) is noise,
/// small enough that 25 M parameters give ~400 leaves to balance across cores.
pub(crate) const CHUNK: usize = 1 << 16;

/// One tensor's work, splittable along its elements.
pub(crate) trait Piece: Send + Sized {
    /// Number of elements.
    fn len(&self) -> usize;
    /// Splits into `[0, mid)` and `[mid, len)`.
    fn split_at(self, mid: usize) -> (Self, Self);
}

/// A list of tensors, splittable at tensor boundaries.
pub(crate) trait Tensors: Send + Sized {
    /// The work of one tensor.
    type Piece: Piece;
    /// Where a per-tensor result goes (`()` for none).
    type Slot: Send;
    /// Number of tensors.
    fn count(&self) -> usize;
    /// Elements of tensor `i`.
    fn len_of(&self, i: usize) -> usize;
    /// Splits into tensors `[0, i)` and `[i, count)`.
    fn split_at(self, i: usize) -> (Self, Self);
    /// The only tensor of a one-tensor list.
    fn into_single(self) -> (Self::Piece, Self::Slot);
}

/// The computation run on each leaf, and how results combine.
pub(crate) trait Kernel<T: Tensors>: Sync {
    /// Partial result over part of one tensor.
    type Acc: Send;
    /// Result over whole tensors.
    type Out: Send;
    /// Runs on one leaf-sized piece of a tensor.
    fn leaf(&self, piece: T::Piece) -> Self::Acc;
    /// Combines partials of adjacent pieces of one tensor (left, right).
    fn merge(&self, left: Self::Acc, right: Self::Acc) -> Self::Acc;
    /// Turns a whole tensor's partial into a result; `index` is its position in the full list.
    fn finish(&self, index: usize, acc: Self::Acc, slot: T::Slot) -> Self::Out;
    /// Combines results of adjacent tensor ranges (left, right).
    fn join(&self, left: Self::Out, right: Self::Out) -> Self::Out;
    /// The result over no tensors.
    fn empty(&self) -> Self::Out;
}

/// A list of exactly one tensor.
pub(crate) struct One<P>(pub(crate) P);

impl<P: Piece> Tensors for One<P> {
    type Piece = P;
    type Slot = ();
    fn count(&self) -> usize {
        1
    }
    fn len_of(&self, _i: usize) -> usize {
        self.0.len()
    }
    fn split_at(self, _i: usize) -> (Self, Self) {
        unreachable!("a one-tensor list is never split at a tensor boundary")
    }
    fn into_single(self) -> (P, ()) {
        (self.0, ())
    }
}

/// Runs `kernel` over every element of `tensors`, in parallel on the current rayon pool.
pub(crate) fn run<T: Tensors, K: Kernel<T>>(tensors: T, kernel: &K) -> K::Out {
    let total = (0..tensors.count()).map(|i| tensors.len_of(i)).sum();
    over_tensors(tensors, 0, total, kernel)
}

fn over_tensors<T: Tensors, K: Kernel<T>>(tensors: T, base: usize, total: usize, k: &K) -> K::Out {
    let n = tensors.count();
    if n == 0 {
        return k.empty();
    }
    if n == 1 {
        let (piece, slot) = tensors.into_single();
        let acc = over_elements(piece, k);
        return k.finish(base, acc, slot);
    }
    if total <= CHUNK {
        let mut out = k.empty();
        let mut rest = tensors;
        for i in 0..n {
            let (head, tail) = rest.split_at(1);
            rest = tail;
            let (piece, slot) = head.into_single();
            out = k.join(out, k.finish(base + i, k.leaf(piece), slot));
        }
        return out;
    }
    let (mid, left_total) = split_point(&tensors, total);
    let (left, right) = tensors.split_at(mid);
    let (a, b) = rayon::join(
        || over_tensors(left, base, left_total, k),
        || over_tensors(right, base + mid, total - left_total, k),
    );
    k.join(a, b)
}

fn over_elements<P: Piece, T: Tensors<Piece = P>, K: Kernel<T>>(piece: P, k: &K) -> K::Acc {
    let len = piece.len();
    if len <= CHUNK {
        return k.leaf(piece);
    }
    let mid = len.div_ceil(CHUNK) / 2 * CHUNK;
    let (left, right) = piece.split_at(mid);
    let (a, b) = rayon::join(|| over_elements(left, k), || over_elements(right, k));
    k.merge(a, b)
}

/// The tensor boundary `i` in `1..count` whose prefix of elements is nearest `total / 2`, and that prefix.
fn split_point<T: Tensors>(tensors: &T, total: usize) -> (usize, usize) {
    let n = tensors.count();
    let half = total / 2;
    let mut prefix = 0;
    for i in 1..n {
        let next = prefix + tensors.len_of(i - 1);
        if next >= half {
            // Boundary i (prefix `next`) or i - 1 (prefix `prefix`), whichever is nearer; never 0.
            return if i > 1 && half - prefix < next - half { (i - 1, prefix) } else { (i, next) };
        }
        prefix = next;
    }
    (n - 1, prefix)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake list: only lengths. A leaf reports (tensor-local start, len) so tests can see the split.
    #[derive(Clone, Copy)]
    struct Lens<'a>(&'a [usize]);

    struct Span(usize, usize);

    impl Piece for Span {
        fn len(&self) -> usize {
            self.1
        }
        fn split_at(self, mid: usize) -> (Self, Self) {
            (Span(self.0, mid), Span(self.0 + mid, self.1 - mid))
        }
    }

    impl Tensors for Lens<'_> {
        type Piece = Span;
        type Slot = ();
        fn count(&self) -> usize {
            self.0.len()
        }
        fn len_of(&self, i: usize) -> usize {
            self.0[i]
        }
        fn split_at(self, i: usize) -> (Self, Self) {
            let (a, b) = self.0.split_at(i);
            (Lens(a), Lens(b))
        }
        fn into_single(self) -> (Span, ()) {
            (Span(0, self.0[0]), ())
        }
    }

    /// Collects (tensor, start, len) of every leaf, in list order, plus the number of leaves.
    struct Leaves;

    impl<'a> Kernel<Lens<'a>> for Leaves {
        type Acc = Vec<(usize, usize)>;
        type Out = Vec<(usize, usize, usize)>;
        fn leaf(&self, piece: Span) -> Self::Acc {
            vec![(piece.0, piece.1)]
        }
        fn merge(&self, mut a: Self::Acc, b: Self::Acc) -> Self::Acc {
            a.extend(b);
            a
        }
        fn finish(&self, index: usize, acc: Self::Acc, (): ()) -> Self::Out {
            acc.into_iter().map(|(s, l)| (index, s, l)).collect()
        }
        fn join(&self, mut a: Self::Out, b: Self::Out) -> Self::Out {
            a.extend(b);
            a
        }
        fn empty(&self) -> Self::Out {
            Vec::new()
        }
    }

    #[test]
    fn leaves_cover_every_element_once_in_order_and_cut_at_chunk_multiples() {
        let lens = [3 * CHUNK + 5, 1, 0, 7, CHUNK, CHUNK + 1, 2, 9 * CHUNK];
        let leaves = run(Lens(&lens), &Leaves);
        let mut expect = Vec::new();
        for (t, &len) in lens.iter().enumerate() {
            if len == 0 {
                expect.push((t, 0, 0));
            }
            for start in (0..len).step_by(CHUNK) {
                expect.push((t, start, CHUNK.min(len - start)));
            }
        }
        assert_eq!(leaves, expect);
    }

    #[test]
    fn empty_list_gives_empty_result() {
        assert!(run(Lens(&[]), &Leaves).is_empty());
    }

    #[test]
    fn split_point_never_returns_an_end() {
        for lens in [&[5usize, 0][..], &[0, 5], &[100, 1, 1], &[1, 1, 100], &[0, 0, 0]] {
            let (i, prefix) = split_point(&Lens(lens), lens.iter().sum());
            assert!((1..lens.len()).contains(&i), "{lens:?} -> {i}");
            assert_eq!(prefix, lens[..i].iter().sum::<usize>());
        }
    }
}
