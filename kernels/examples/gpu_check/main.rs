//! The GPU check of amp's CUDA kernels, in one binary built on a machine without a GPU and run on one
//! with (see scripts/gpu-check.sh): every kernel against the CPU reference, then the fused AdamW and
//! unscale bandwidth against the device's copy bandwidth measured in the same run. Prints one table,
//! row by row as results come; exits non-zero when a check fails; skips cleanly without a device.
//!
//! ```text
//! cargo build --release -p amp-kernels --features cuda-dynamic-loading --example gpu_check
//! gpu_check [--budget-s SECONDS]   # long items are skipped first when the budget runs short
//! ```

mod bench;
mod checks;
mod data;

use std::time::{Duration, Instant};

use amp_kernels::cuda::{device_available, nvrtc_available, CudaKernels};
use cudarc::driver::CudaContext;

/// One row of the table.
#[derive(Debug)]
pub struct Row {
    pub item: String,
    pub result: String,
    pub ok: bool,
}

pub fn print_row(row: &Row) {
    let mark = if row.ok { "ok" } else { "FAIL" };
    println!("| {:<44} | {:<60} | {:<4} |", row.item, row.result, mark);
}

fn budget() -> Duration {
    let mut args = std::env::args().skip(1);
    let mut seconds = 420.0;
    while let Some(arg) = args.next() {
        if arg == "--budget-s" {
            seconds = args.next().and_then(|s| s.parse().ok()).unwrap_or(seconds);
        }
    }
    Duration::from_secs_f64(seconds)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let start = Instant::now();
    let budget = budget();
    if !nvrtc_available() {
        println!("skipped: libnvrtc not found (put the CUDA toolkit's or the nvidia-cuda-nvrtc wheel's lib on LD_LIBRARY_PATH)");
        return Ok(());
    }
    if !device_available() {
        println!("skipped: no CUDA driver or device");
        return Ok(());
    }
    let context = CudaContext::new(0)?;
    let stream = context.default_stream();
    let (major, minor) = context.compute_capability()?;
    println!("# amp CUDA kernel check: {} (sm_{major}{minor})", context.name()?);
    println!();
    println!("| {:<44} | {:<60} | {:<4} |", "item", "result", "");
    println!("|{}|{}|{}|", "-".repeat(46), "-".repeat(62), "-".repeat(6));
    let compile = Instant::now();
    let kernels = CudaKernels::for_context(&context)?;
    print_row(&Row {
        item: "NVRTC: every family compiled and loaded".into(),
        result: format!("{:?} in {:.2} s", kernels.arch(), compile.elapsed().as_secs_f64()),
        ok: true,
    });

    let mut failed = 0;
    for row in checks::run_all(&kernels, &stream)? {
        print_row(&row);
        failed += usize::from(!row.ok);
    }
    let left = budget.saturating_sub(start.elapsed());
    for row in bench::run_all(&kernels, &stream, left)? {
        print_row(&row);
        failed += usize::from(!row.ok);
    }
    println!();
    println!("{} s in all; {failed} failed", start.elapsed().as_secs());
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}
