//! The driver's buffers, kept per thread from one product to the next.

use std::cell::Cell;

thread_local! {
    /// Packed A and B of the calling thread's last product, kept for the next.
    pub(super) static PACKED: Cell<(Vec<u32>, Vec<u32>)> = const { Cell::new((Vec::new(), Vec::new())) };
    /// A worker's f32 block for half output.
    pub(super) static SCRATCH: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    /// A worker's B micro-panels of one block and k-block, when blocks pack their own.
    pub(super) static BLOCK_B: Cell<Vec<u32>> = const { Cell::new(Vec::new()) };
    /// A block's own A micro-panels of one k-block, where it packs them itself.
    pub(super) static BLOCK_A: Cell<Vec<u32>> = const { Cell::new(Vec::new()) };
}

/// `len` elements of `words` (4-byte packed words, or f32 scratch) that start on a cache line,
/// `words` grown as needed (keeping its memory for the next product).
///
/// Every panel and k-block then starts on a line too (their sizes are multiples of 16 words, except the
/// register kernels' 6-line A panels, which are read by broadcasts), so no vector or tile row load of a
/// packed operand straddles two lines. The allocator aligns to 16 bytes only; measured on the AMX
/// kernel at 1024^3 on one thread, the straddling loads cost a third of its speed (575 against 910
/// GFLOP/s).
pub(super) fn cache_aligned<T: Copy + Default>(words: &mut Vec<T>, len: usize) -> &mut [T] {
    let line = 64 / std::mem::size_of::<T>();
    // Grown only, never shrunk: a shorter length would be filled again when a larger product follows.
    if words.len() < len + line - 1 {
        words.resize(len + line - 1, T::default());
    }
    let skip = words.as_ptr().align_offset(64).min(line - 1);
    &mut words[skip..skip + len]
}

#[cfg(test)]
mod tests {
    use super::cache_aligned;

    #[test]
    fn packed_buffers_start_on_a_cache_line_and_keep_their_memory() {
        let mut words: Vec<u32> = Vec::new();
        for len in [1, 15, 16, 1000, 4096, 17] {
            let slice = cache_aligned(&mut words, len);
            assert_eq!(slice.len(), len);
            assert_eq!(slice.as_ptr() as usize % 64, 0, "len {len}");
        }
        let capacity = words.capacity();
        cache_aligned(&mut words, 100);
        assert_eq!(words.capacity(), capacity, "a smaller product reuses the buffer");
        let mut floats: Vec<f32> = vec![1.0; 3];
        assert_eq!(cache_aligned(&mut floats, 40).as_ptr() as usize % 64, 0);
    }
}
