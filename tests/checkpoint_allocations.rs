//! A checkpoint that declares huge sizes is refused without allocating them: loading a ~2 KB file that
//! claims a 2^62-byte tensor, a 2^40-byte header or a shape whose size overflows allocates nothing
//! larger than the file. Measured with a counting global allocator in this test binary (one test, so
//! nothing else allocates while it counts).

#[path = "corpus/checkpoint_case.rs"]
mod checkpoint_case;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

struct Largest;

static COUNTING: AtomicBool = AtomicBool::new(false);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Largest {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
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
static ALLOCATOR: Largest = Largest;

#[test]
fn huge_declared_sizes_are_refused_without_allocating_them() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/checkpoint");
    let scratch = std::env::temp_dir().join(format!("amp-alloc-{}.safetensors", std::process::id()));
    for case in ["offsets_huge", "header_length_huge", "header_length_max", "shape_overflows"] {
        let bytes = std::fs::read(dir.join(format!("{case}.safetensors")))?;
        let (mut model, mut adam, mut scaler) = checkpoint_case::fresh()?;
        std::fs::write(&scratch, &bytes)?;
        LARGEST.store(0, Ordering::Relaxed);
        COUNTING.store(true, Ordering::Relaxed);
        let loaded = amp::checkpoint::load_with(&mut model, &mut [&mut adam, &mut scaler], &scratch);
        COUNTING.store(false, Ordering::Relaxed);
        let largest = LARGEST.load(Ordering::Relaxed);
        let err = loaded.expect_err("refused").to_string();
        println!("{case}: refused, largest allocation {largest} B for a {} B file: {err}", bytes.len());
        assert!(
            largest <= bytes.len().max(4096),
            "{case}: allocated {largest} B for a {} B file",
            bytes.len()
        );
    }
    std::fs::remove_file(&scratch)?;
    Ok(())
}
