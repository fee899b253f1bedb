//! A scoped cache of parameter casts, for models that use one weight several times in a step (tied
//! embeddings, shared layers): under O1 each use would otherwise cast the fp32 weight again.
//!
//! The cache lives only while a [`CastCache`] guard is alive on this thread, like Apex's cache that is
//! cleared when the autocast context exits. Keep the guard around forward and backward, and drop it
//! before the optimizer updates the weights: a cast cached across an update would be stale. amp's own
//! master refresh and checkpoint loading clear it as well.
//!
//! Products on amp's CPU GEMM cast nothing (the GEMM rounds an operand while packing it), so the cache
//! serves the casts of other ops and of products elsewhere (CUDA, candle's kernel).
//!
//! The trade-off: with one shared cast, backward sums the uses' gradient contributions in the half type
//! before widening them to the fp32 weight (as PyTorch's autocast cache does); without the cache each is
//! widened first and summed in f32. The cache saves casts at the cost of one half-precision rounding of
//! that sum.

use std::cell::RefCell;
use std::collections::HashMap;

use candle_core::{DType, Tensor, TensorId};

thread_local! {
    static CACHE: RefCell<Option<Entries>> = const { RefCell::new(None) };
}

#[derive(Default)]
struct Entries {
    casts: HashMap<(TensorId, DType), Tensor>,
    hits: usize,
    /// Guards alive on this thread: the cache ends when the outermost one is dropped.
    depth: usize,
}

/// While alive, casts of parameters on this thread are computed once per (parameter, dtype).
#[derive(Debug)]
#[must_use = "the cache is cleared when the guard is dropped"]
pub struct CastCache {
    // Not Send: the cache is per thread.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl CastCache {
    /// Starts caching on this thread. Nested guards share the outer cache: dropping an inner guard keeps
    /// it (and its casts) for the outer one; the cache ends with the outermost guard.
    pub fn enter() -> Self {
        CACHE.with(|cache| {
            cache.borrow_mut().get_or_insert_with(Entries::default).depth += 1;
        });
        CastCache { _not_send: std::marker::PhantomData }
    }

    /// How many casts were served from the cache since the outermost guard was entered.
    pub fn hits(&self) -> usize {
        CACHE.with(|cache| cache.borrow().as_ref().map_or(0, |e| e.hits))
    }

    /// Forgets every cached cast (the weights changed).
    pub fn clear() {
        CACHE.with(|cache| {
            if let Some(entries) = cache.borrow_mut().as_mut() {
                entries.casts.clear();
            }
        });
    }
}

impl Drop for CastCache {
    fn drop(&mut self) {
        CACHE.with(|cache| {
            let mut cache = cache.borrow_mut();
            let last = cache.as_mut().is_none_or(|entries| {
                entries.depth = entries.depth.saturating_sub(1);
                entries.depth == 0
            });
            if last {
                *cache = None;
            }
        });
    }
}

/// `source` cast to `dtype`, from the cache when one is active.
pub(crate) fn cast(source: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
    if source.dtype() == dtype {
        return Ok(source.clone());
    }
    let key = (source.id(), dtype);
    let cached = CACHE.with(|cache| {
        let mut cache = cache.borrow_mut();
        let entries = cache.as_mut()?;
        let hit = entries.casts.get(&key).cloned();
        entries.hits += usize::from(hit.is_some());
        hit
    });
    if let Some(cast) = cached {
        return Ok(cast);
    }
    let cast = source.to_dtype(dtype)?;
    CACHE.with(|cache| {
        if let Some(entries) = cache.borrow_mut().as_mut() {
            entries.casts.insert(key, cast.clone());
        }
    });
    Ok(cast)
}
