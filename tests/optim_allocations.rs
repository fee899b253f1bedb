//! A fused optimizer step makes no large allocation: its per-step bookkeeping is a few small vectors of
//! pointers, never a buffer proportional to the parameters (candle-nn's AdamW makes ~15 full-size
//! temporaries per parameter). Measured with a counting global allocator in this test binary.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use amp::optim::{AdamConfig, FusedAdam, FusedOptimizer, ParamGroups};
use candle_core::{DType, Device, Tensor, Var};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static COUNT: AtomicUsize = AtomicUsize::new(0);
static LARGEST: AtomicUsize = AtomicUsize::new(0);
static BYTES: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            COUNT.fetch_add(1, Ordering::Relaxed);
            BYTES.fetch_add(layout.size(), Ordering::Relaxed);
            LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        }
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn a_fused_step_over_98_tensors_allocates_nothing_large() -> amp::Result<()> {
    // 98 tensors, 2.1M parameters: mostly 128x128 and 512x128 matrices with small vectors.
    let shapes: Vec<Vec<usize>> = (0..98)
        .map(|i| {
            if i % 3 == 0 {
                vec![128]
            } else if i % 3 == 1 {
                vec![128, 128]
            } else {
                vec![512, 128]
            }
        })
        .collect();
    let vars: Vec<Var> =
        shapes.iter().map(|s| Var::ones(s.as_slice(), DType::F32, &Device::Cpu)).collect::<Result<_, _>>()?;
    let mut loss = Tensor::new(0f32, &Device::Cpu)?;
    for v in &vars {
        loss = (loss + (v.as_tensor() * 0.5)?.sum_all()?)?;
    }
    let grads = loss.backward()?;
    let params: usize = vars.iter().map(|v| v.elem_count()).sum();
    let mut optimizer = FusedAdam::new(ParamGroups::from_vars(vars)?, AdamConfig::default())?;
    optimizer.step(&grads)?; // warm up rayon's pool

    COUNT.store(0, Ordering::SeqCst);
    LARGEST.store(0, Ordering::SeqCst);
    BYTES.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    optimizer.step_scaled(&grads, 0.5)?;
    COUNTING.store(false, Ordering::SeqCst);

    let (count, largest, bytes) =
        (COUNT.load(Ordering::SeqCst), LARGEST.load(Ordering::SeqCst), BYTES.load(Ordering::SeqCst));
    println!("one step over {params} parameters: {count} allocations, {bytes} bytes in all, largest {largest} bytes");
    assert!(largest <= 16 * 1024, "largest allocation {largest} bytes: a per-parameter buffer was allocated");
    assert!(bytes < params / 16, "{bytes} bytes allocated in a step over {params} parameters");
    Ok(())
}
