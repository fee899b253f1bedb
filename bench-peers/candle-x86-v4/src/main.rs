//! candle's f32 matmul, built with the `gemm` crate's `x86-v4` feature, as a child of the GEMM bench.
//!
//! It speaks `scripts/torch_peer.py`'s protocol on stdin and stdout, one command per line:
//!
//! ```text
//! shape M K N A B    operands of a product (A is (M, K), B is (K, N)); A and B are "n" (stored
//!                    row-major) or "t" (stored as the transpose, read through a view); values as the
//!                    bench's; answers "ok"
//! run f32            one product; answers the seconds it took, timed here around the call and the
//!                    freeing of its result (as the bench times candle's own column)
//! quit
//! ```
//!
//! Its first line says which kernels `gemm` will run: the AVX-512 ones where the CPU has AVX-512F,
//! else the same AVX2 + FMA ones as candle's default build.

use std::io::{BufRead, Write};
use std::time::Instant;

use candle_core::{Device, Tensor};

/// The bench's operand values: `(((i * 2654435761) mod 2^32) ^ seed) >> 8`, scaled to `[-0.5, 0.5)`.
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) >> 8) as f32 / (1u32 << 24) as f32 - 0.5)
        .collect()
}

/// An operand of logical shape `(rows, cols)`, stored as `layout` says ("t": its transpose, viewed).
fn operand(rows: usize, cols: usize, layout: &str, seed: u32) -> candle_core::Result<Tensor> {
    let data = values(rows * cols, seed);
    match layout {
        "t" => Tensor::from_vec(data, (cols, rows), &Device::Cpu)?.t(),
        _ => Tensor::from_vec(data, (rows, cols), &Device::Cpu),
    }
}

fn kernels() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        return "gemm's AVX-512 kernels (x86-v4)";
    }
    "gemm's AVX2 + FMA kernels (no AVX-512F on this CPU: what the default build runs)"
}

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    // On 2 threads, as the bench runs candle's default build (candle's matmul splits its work into
    // tasks for the current rayon pool).
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build()?;
    pool.install(serve)
}

/// Answers the bench's commands until `quit` or the end of its input.
fn serve() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "candle 0.11.1 with gemm x86-v4: {}", kernels())?;
    out.flush()?;
    let mut operands: Option<(Tensor, Tensor)> = None;
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["shape", m, k, n, a, b] => {
                let (m, k, n): (usize, usize, usize) = (m.parse()?, k.parse()?, n.parse()?);
                operands = Some((operand(m, k, a, 1)?, operand(k, n, b, 2)?));
                writeln!(out, "ok")?;
            }
            ["run", "f32"] => match &operands {
                Some((a, b)) => {
                    // The product freed inside the timing, as the bench times candle's in its own
                    // process.
                    let start = Instant::now();
                    drop(a.matmul(b)?);
                    let seconds = start.elapsed().as_secs_f64();
                    writeln!(out, "{seconds:.9}")?;
                }
                None => writeln!(out, "error: run before shape")?,
            },
            ["quit"] => return Ok(()),
            [] => continue,
            _ => writeln!(out, "error: cannot do {line:?} (this peer multiplies f32 only)")?,
        }
        out.flush()?;
    }
    Ok(())
}
