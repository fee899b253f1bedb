//! New vectors written in parallel blocks, each block zeroed by the thread that writes it just before
//! it does (in that core's cache), instead of the whole vector zero-filled on the calling thread first.
//!
//! `vec![0.0; n]` for an op's output is a `memset` of `n` elements on one thread while the other cores
//! wait, and the kernel's writes that follow miss the cache again: in the main job's bf16 step
//! amp's op outputs (GELU's 4 MiB each way, attention's probabilities, the layer norm's) were
//! zero-filled that way. Zeroing a block right before writing it costs a pass over memory the
//! write then finds in cache.

use std::mem::MaybeUninit;

use rayon::prelude::*;

/// A new vector of `len` elements, written in parallel blocks of `block` elements (the last one may
/// be shorter): block `i`, elements `i * block ..`, is zeroed (`T::default()`) and then passed to
/// `write(i * block, block)`. Whatever `write` leaves is the default.
///
/// # Panics
/// If `block` is 0 while `len` is not; a panic in `write` reaches the caller (the vector is dropped).
pub fn written_in_blocks<T, W>(len: usize, block: usize, write: W) -> Vec<T>
where
    T: Copy + Default + Send + Sync,
    W: Fn(usize, &mut [T]) + Sync,
{
    assert!(block > 0 || len == 0, "fresh: blocks of 0 elements");
    let mut out: Vec<T> = Vec::with_capacity(len);
    out.spare_capacity_mut()[..len].par_chunks_mut(block.max(1)).enumerate().for_each(|(i, part)| {
        write(i * block, zeroed(part));
    });
    // SAFETY: the parallel loop above initialised every one of the first `len` elements (its
    // chunks cover them; `zeroed` writes each element of its chunk) before any could be read.
    unsafe { out.set_len(len) };
    out
}

/// `part` with every element set to `T::default()`, as initialised memory.
fn zeroed<T: Copy + Default>(part: &mut [MaybeUninit<T>]) -> &mut [T] {
    for slot in part.iter_mut() {
        slot.write(T::default());
    }
    // SAFETY: every element was written just above, and `MaybeUninit<T>` has `T`'s size,
    // alignment and layout, so the same memory is a valid `[T]` of the same length.
    unsafe { &mut *(std::ptr::from_mut(part) as *mut [T]) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_block_is_written_at_its_offset_and_the_rest_is_zero() {
        for (len, block) in [(0, 1), (0, 0), (1, 1), (10, 3), (1000, 64), (1000, 1000), (7, 100)] {
            let v: Vec<u32> = written_in_blocks(len, block, |start, part| {
                assert!(part.iter().all(|&x| x == 0), "zeroed before it is written");
                // Every other element written: the rest must stay zero.
                for (i, x) in part.iter_mut().enumerate().step_by(2) {
                    *x = (start + i) as u32 + 1;
                }
            });
            assert_eq!(v.len(), len);
            for (i, &x) in v.iter().enumerate() {
                let want = if (i % block) % 2 == 0 { i as u32 + 1 } else { 0 };
                assert_eq!(x, want, "len {len} block {block} [{i}]");
            }
        }
    }

    #[test]
    #[should_panic(expected = "writer failed")]
    fn a_panic_in_the_writer_reaches_the_caller() {
        let _: Vec<f32> = written_in_blocks(100, 10, |start, _| assert!(start != 50, "writer failed"));
    }
}
