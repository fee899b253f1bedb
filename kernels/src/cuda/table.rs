//! The multi-tensor launch table: what every multi-tensor kernel reads to find its chunk (layout in
//! `common.cuh`). Built on the host from device addresses; pure data, so it is tested without a GPU.

use crate::Dtype;

/// Elements per block: Apex's multi_tensor_apply chunk size.
pub const CHUNK_ELEMENTS: usize = 64 * 1024;

/// A table cannot describe these tensors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TableError {
    /// A list does not have one address per tensor.
    #[error("list {list} has {got} addresses for {expected} tensors")]
    ListLength {
        /// The list.
        list: usize,
        /// Addresses given.
        got: usize,
        /// Tensors.
        expected: usize,
    },
    /// More tensors or blocks than a kernel can index with 32-bit integers / a grid can hold.
    #[error("{what} = {count} exceeds the launch limit {limit}: split the parameters into several groups")]
    TooLarge {
        /// `"tensors"` or `"blocks"`.
        what: &'static str,
        /// How many.
        count: usize,
        /// The limit.
        limit: usize,
    },
    /// A tensor with elements but a null address in list 0 (the list every kernel reads).
    #[error("tensor {tensor} has {len} elements but a null address in list 0")]
    NullPointer {
        /// The tensor.
        tensor: usize,
        /// Its length.
        len: usize,
    },
}

/// One block's chunk: `[begin, end)` of tensor `tensor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockEntry {
    /// Tensor index.
    pub tensor: usize,
    /// First element.
    pub begin: usize,
    /// One past the last element.
    pub end: usize,
}

/// The element types of one tensor, as the table records them (`AMP_KIND_*` in `common.cuh`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorKind {
    /// The gradient's element type.
    pub grad: Dtype,
    /// The working copy's, when there is one (f16 or bf16).
    pub working: Option<Dtype>,
    /// The optimizer state's: f32, or bf16 (rounded stochastically when stored). Kernels without state
    /// ignore it.
    pub state: Dtype,
}

impl TensorKind {
    /// A tensor whose gradient is `grad`, with no working copy and f32 state.
    #[must_use]
    pub fn grad(grad: Dtype) -> Self {
        TensorKind { grad, working: None, state: Dtype::F32 }
    }

    /// The table word: gradient code in bits 0-7, working copy's in bits 8-15, state's in bits 16-23.
    #[must_use]
    pub fn word(self) -> u64 {
        let code = |d: Dtype| match d {
            Dtype::F32 => 0u64,
            Dtype::F16 => 1,
            Dtype::Bf16 => 2,
        };
        code(self.grad) | (self.working.map_or(0, code) << 8) | (code(self.state) << 16)
    }
}

/// The table of one multi-tensor launch, as uploaded: `lists * n` addresses, `n` lengths, `n` element
/// type words ([`TensorKind::word`]), then one `(tensor, begin, end)` triple per block. [`first_block`](Self::first_block) (`n + 1` entries) goes
/// in a second buffer for the reductions that sum per-tensor partials.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchTable {
    words: Vec<u64>,
    first_block: Vec<u64>,
    tensors: usize,
    lists: usize,
}

impl LaunchTable {
    /// The table for `lens.len()` tensors; `lists[l][t]` is the device address of tensor `t` in list `l`
    /// (0 where the kernel accepts an absent list: working copies, AMSGrad's max, momentum), `kinds[t]`
    /// its element types; blocks of at most `chunk` elements ([`CHUNK_ELEMENTS`] in launches).
    ///
    /// # Errors
    /// A list of the wrong length, a null address in list 0, or more tensors / blocks than a launch holds.
    pub fn new(
        lists: &[&[u64]],
        lens: &[usize],
        kinds: &[TensorKind],
        chunk: usize,
    ) -> Result<Self, TableError> {
        let n = lens.len();
        if let Some((list, l)) = lists.iter().enumerate().find(|(_, l)| l.len() != n) {
            return Err(TableError::ListLength { list, got: l.len(), expected: n });
        }
        if kinds.len() != n {
            return Err(TableError::ListLength { list: lists.len(), got: kinds.len(), expected: n });
        }
        let limit = i32::MAX as usize;
        if n > limit {
            return Err(TableError::TooLarge { what: "tensors", count: n, limit });
        }
        if let Some(first) = lists.first() {
            if let Some(tensor) = (0..n).find(|&t| first[t] == 0 && lens[t] > 0) {
                return Err(TableError::NullPointer { tensor, len: lens[tensor] });
            }
        }
        let chunk = chunk.max(1);
        let blocks: usize = lens.iter().map(|len| len.div_ceil(chunk)).sum();
        if blocks > limit {
            return Err(TableError::TooLarge { what: "blocks", count: blocks, limit });
        }
        let mut words = Vec::with_capacity(lists.len() * n + 2 * n + 3 * blocks);
        for list in lists {
            words.extend_from_slice(list);
        }
        words.extend(lens.iter().map(|&len| len as u64));
        words.extend(kinds.iter().map(|k| k.word()));
        let mut first_block = Vec::with_capacity(n + 1);
        let mut block = 0u64;
        for (tensor, &len) in lens.iter().enumerate() {
            first_block.push(block);
            for begin in (0..len).step_by(chunk) {
                words.extend([tensor as u64, begin as u64, (begin + chunk).min(len) as u64]);
                block += 1;
            }
        }
        first_block.push(block);
        Ok(LaunchTable { words, first_block, tensors: n, lists: lists.len() })
    }

    /// The words to upload, in the layout `common.cuh` reads.
    #[must_use]
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// First block of each tensor, then the block count.
    #[must_use]
    pub fn first_block(&self) -> &[u64] {
        &self.first_block
    }

    /// Number of tensors (the kernels' `n`).
    #[must_use]
    pub fn tensors(&self) -> usize {
        self.tensors
    }

    /// Number of lists.
    #[must_use]
    pub fn lists(&self) -> usize {
        self.lists
    }

    /// Number of blocks to launch.
    #[must_use]
    pub fn blocks(&self) -> usize {
        self.first_block.last().map_or(0, |&b| b as usize)
    }

    /// Block `b` read back from the words exactly as `amp_this_block` does on the device.
    #[must_use]
    pub fn block(&self, b: usize) -> BlockEntry {
        let at = self.lists * self.tensors + 2 * self.tensors + 3 * b;
        let entry = &self.words[at..at + 3];
        BlockEntry { tensor: entry[0] as usize, begin: entry[1] as usize, end: entry[2] as usize }
    }

    /// Address of tensor `t` in list `l`, as `amp_ptr` reads it.
    #[must_use]
    pub fn address(&self, l: usize, t: usize) -> u64 {
        self.words[l * self.tensors + t]
    }

    /// Length of tensor `t`.
    #[must_use]
    pub fn len_of(&self, t: usize) -> usize {
        self.words[self.lists * self.tensors + t] as usize
    }

    /// Element types word of tensor `t`, as `amp_grad_kind` / `amp_working_kind` read it.
    #[must_use]
    pub fn kind_word(&self, t: usize) -> u64 {
        self.words[self.lists * self.tensors + self.tensors + t]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn small_layout_by_hand() -> Result<(), TableError> {
        let kinds = [
            TensorKind::grad(Dtype::F32),
            TensorKind { grad: Dtype::F16, working: Some(Dtype::Bf16), state: Dtype::Bf16 },
        ];
        let table = LaunchTable::new(&[&[0x100, 0x200], &[0x300, 0]], &[5, 2], &kinds, 4)?;
        #[rustfmt::skip]
        assert_eq!(table.words(), &[
            0x100, 0x200, 0x300, 0,  // lists
            5, 2,                    // lengths
            0, 0x20201,              // kinds: f32 / none / f32, f16 / bf16 / bf16
            0, 0, 4,  0, 4, 5,  1, 0, 2,  // blocks
        ]);
        assert_eq!(table.first_block(), &[0, 2, 3]);
        assert_eq!(table.blocks(), 3);
        Ok(())
    }

    #[test]
    fn bad_tables_are_refused() {
        let f32s = [TensorKind::grad(Dtype::F32); 2];
        assert_eq!(
            LaunchTable::new(&[&[1, 2], &[3]], &[1, 1], &f32s, 4),
            Err(TableError::ListLength { list: 1, got: 1, expected: 2 })
        );
        assert_eq!(
            LaunchTable::new(&[&[1, 2]], &[1, 1], &f32s[..1], 4),
            Err(TableError::ListLength { list: 1, got: 1, expected: 2 })
        );
        assert_eq!(
            LaunchTable::new(&[&[1, 0]], &[1, 3], &f32s, 4),
            Err(TableError::NullPointer { tensor: 1, len: 3 })
        );
        // An empty tensor may have a null address: it gets no block.
        assert_eq!(LaunchTable::new(&[&[1, 0]], &[1, 0], &f32s, 4).map(|t| t.blocks()), Ok(1));
    }

    proptest! {
        #[test]
        fn blocks_cover_every_element_once_in_order(
            lens in prop::collection::vec(0usize..300, 0..12),
            chunk in 1usize..70,
        ) {
            let addresses: Vec<u64> = (1..=lens.len() as u64).map(|a| a * 0x1000).collect();
            let kinds: Vec<TensorKind> = (0..lens.len())
                .map(|t| TensorKind::grad([Dtype::F32, Dtype::F16, Dtype::Bf16][t % 3]))
                .collect();
            let table = LaunchTable::new(&[&addresses, &addresses], &lens, &kinds, chunk).unwrap();
            let mut next = vec![0usize; lens.len()];
            let mut last_tensor = 0;
            for b in 0..table.blocks() {
                let e = table.block(b);
                prop_assert!(e.tensor >= last_tensor, "blocks of a tensor are consecutive");
                prop_assert_eq!(e.begin, next[e.tensor]);
                prop_assert!(e.end > e.begin && e.end - e.begin <= chunk);
                next[e.tensor] = e.end;
                last_tensor = e.tensor;
                let first = table.first_block()[e.tensor] as usize;
                prop_assert!(first <= b && b < table.first_block()[e.tensor + 1] as usize);
            }
            prop_assert_eq!(&next, &lens);
            for (t, &len) in lens.iter().enumerate() {
                prop_assert_eq!(table.len_of(t), len);
                prop_assert_eq!(table.address(1, t), addresses[t]);
                prop_assert_eq!(table.kind_word(t), [0, 1, 2][t % 3]);
            }
        }
    }
}
