//! A piece of a tensor that knows where in its tensor it starts: the element index stochastic rounding
//! draws its random bits for, whatever the split of the work.

use crate::par::Piece;
use crate::stochastic::before_key_change;

/// `piece`, starting at element `offset` of its tensor.
pub(crate) struct Offset<P> {
    pub(crate) piece: P,
    pub(crate) offset: u64,
}

impl<P: Piece> Piece for Offset<P> {
    fn len(&self) -> usize {
        self.piece.len()
    }
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (a, b) = self.piece.split_at(mid);
        (Offset { piece: a, offset: self.offset }, Offset { piece: b, offset: self.offset + mid as u64 })
    }
}

impl<P: Piece> Offset<P> {
    /// Calls `f(piece, offset)` on consecutive runs of the piece whose indices share their high 32 bits
    /// (one run but for a tensor of more than 2^32 elements): each run takes one stream key.
    pub(crate) fn for_each_key_run(self, mut f: impl FnMut(P, u64)) {
        let mut rest = self;
        while rest.len() > before_key_change(rest.offset) {
            let room = before_key_change(rest.offset);
            let (head, tail) = rest.split_at(room);
            f(head.piece, head.offset);
            rest = tail;
        }
        f(rest.piece, rest.offset);
    }
}
