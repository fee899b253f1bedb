//! Bandwidth benchmark of the fused kernels on the project's baseline parameter set (the README's
//! "Benchmarks"):
//! 25,220,096 fp32 parameters in 98 tensors, 8 transformer layers with d = 512, ffn = 2048:
//!
//! per layer (12 tensors, 3,152,384 params): qkv weight 512x1536, qkv bias 1536, out weight 512x512,
//! out bias 512, ffn-in weight 512x2048, ffn-in bias 2048, ffn-out weight 2048x512, ffn-out bias 512,
//! two LayerNorms (weight 512 + bias 512 each); then a final LayerNorm (512 + 512): 8 * 12 + 2 = 98
//! tensors, 8 * 3,152,384 + 1,024 = 25,220,096 params (no embeddings).
//!
//! Everything runs on a 2-thread rayon pool. Kernels are timed interleaved (A/B/C/... per round, with
//! `amp_kernels::timing`, the harness `benches/optimizer_step.rs` uses too) and each reports the median of
//! its rounds. Bytes are real traffic: what is read plus what is written.
//!
//! Two bandwidth references, timed the same way (rayon, 64 Ki-element chunks, same pool):
//! - "triad": an in-place triad `a[i] += s * b[i]` (reads 2 streams, writes 1 back in place: 12 B, no
//!   write-allocate); STREAM's `a = b + s * c` is shown too (12 B counted, 16 B real).
//! - "pattern": a trivial kernel with the same streams as the kernel measured (`x *= s` in place for
//!   f32 unscale, a 16-bit in-place xor for f16 unscale, `p += g; m += g; v += g * g` for AdamW: read 4,
//!   write 3). On a 2-core VM one core's bandwidth is limited by its outstanding misses, so kernels with
//!   more streams can beat the triad; the same-pattern stream is the fairer ceiling.
//!
//! Run: `cargo bench -p amp-kernels` (about 15 s once built).

use amp_kernels::optim::{adam_step_with, AdamParams, AdamTensor};
use amp_kernels::timing::Interleaved;
use amp_kernels::unscale::unscale_and_check_with;
use amp_kernels::{GradSlice, GradSliceMut, HalfSliceMut, Isa};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

const ROUNDS: usize = 31;
const CHUNK: usize = 1 << 16;

fn shapes() -> Vec<usize> {
    let (d, f) = (512, 2048);
    let mut v = Vec::new();
    for _ in 0..8 {
        v.extend([d * 3 * d, 3 * d, d * d, d, d * f, f, f * d, d, d, d, d, d]);
    }
    v.extend([d, d]);
    v
}

/// Splits one flat buffer into the tensors' slices.
fn split<'a, T>(mut buf: &'a mut [T], lens: &[usize]) -> Vec<&'a mut [T]> {
    lens.iter()
        .map(|&n| {
            let (a, b) = std::mem::take(&mut buf).split_at_mut(n);
            buf = b;
            a
        })
        .collect()
}

/// Splits one flat buffer into the tensors' read-only slices.
fn split_ref<'a, T>(mut buf: &'a [T], lens: &[usize]) -> Vec<&'a [T]> {
    lens.iter()
        .map(|&n| {
            let (a, b) = buf.split_at(n);
            buf = b;
            a
        })
        .collect()
}

fn filled(n: usize, seed: u32, f: impl Fn(u32) -> f32 + Sync) -> Vec<f32> {
    (0..n as u32).into_par_iter().map(|i| f(i.wrapping_mul(2_654_435_761).wrapping_add(seed))).collect()
}

fn noise(h: u32) -> f32 {
    (h >> 8) as f32 / (1u32 << 24) as f32 - 0.5
}

struct Row {
    name: &'static str,
    bytes_per_param: f64,
    /// Row index of the same-pattern reference stream.
    pattern: Option<usize>,
}

fn row(name: &'static str, bytes_per_param: f64, pattern: Option<usize>) -> Row {
    Row { name, bytes_per_param, pattern }
}

fn main() {
    let lens = shapes();
    let n: usize = lens.iter().sum();
    assert_eq!((lens.len(), n), (98, 25_220_096));
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    pool.install(|| run(&lens, n));
}

fn run(lens: &[usize], n: usize) {
    let isa = Isa::detect();
    println!(
        "amp-kernels bench: {n} params in {} tensors, 2 threads, isa {isa:?}, {ROUNDS} rounds",
        lens.len()
    );
    let (mut ta, tb, tc) = (filled(n, 1, noise), filled(n, 2, noise), filled(n, 3, noise));
    let mut g32 = filled(n, 4, |h| noise(h) * 1e-2);
    let mut g16: Vec<f16> = g32.par_iter().map(|&x| f16::from_f32(x * 1024.0)).collect();
    let mut p = filled(n, 5, noise);
    let mut m = filled(n, 6, |h| noise(h) * 1e-3);
    let mut v = filled(n, 7, |h| noise(h).abs() * 1e-6);
    let mut w16: Vec<f16> = p.par_iter().map(|&x| f16::from_f32(x)).collect();
    let mut wbf: Vec<bf16> = p.par_iter().map(|&x| bf16::from_f32(x)).collect();

    let rows = vec![
        row("STREAM triad a=b+s*c (16 B real)", 16.0, None),
        row("triad in place a+=s*b (12 B)", 12.0, None),
        row("stream: f32 x*=s in place (8 B)", 8.0, None),
        row("stream: u16 x^=1 in place (4 B)", 4.0, None),
        row("stream: p+=g,m+=g,v+=g*g (28 B)", 28.0, None),
        row("unscale+check f32 (8 B)", 8.0, Some(2)),
        row("unscale+check f16 (4 B)", 4.0, Some(3)),
        row("unscale+check f32, as 1 tensor (8 B)", 8.0, Some(2)),
        row("unscale+check f32, 24,629 tensors", 8.0, Some(2)),
        row("AdamW fp32 (28 B)", 28.0, Some(4)),
        row("AdamW f16 grad+f16 working (28 B)", 28.0, Some(4)),
        row("AdamW f32 grad+f16 working (30 B)", 30.0, Some(4)),
        row("AdamW f32 grad+bf16 working (30 B)", 30.0, Some(4)),
        row("AdamW fp32, portable path (28 B)", 28.0, Some(4)),
    ];
    let hp = AdamParams::default();
    // Round 0 warms pages and caches.
    let mut harness = Interleaved::new(rows.len(), 1);
    for round in 0..ROUNDS + 1 {
        let s = if round % 2 == 0 { 0.5f32 } else { 2.0 };
        let mut t = harness.round();
        t.time(|| {
            let abc = ta.par_chunks_mut(CHUNK).zip(tb.par_chunks(CHUNK).zip(tc.par_chunks(CHUNK)));
            abc.for_each(|(a, (b, c))| {
                a.iter_mut().zip(b.iter().zip(c)).for_each(|(a, (b, c))| *a = b + s * c)
            })
        });
        t.time(|| {
            let ab = ta.par_chunks_mut(CHUNK).zip(tb.par_chunks(CHUNK));
            ab.for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(a, b)| *a += s * b))
        });
        t.time(|| g32.par_chunks_mut(CHUNK).for_each(|a| a.iter_mut().for_each(|a| *a *= s)));
        t.time(|| {
            let bits = g16.reinterpret_cast_mut();
            bits.par_chunks_mut(CHUNK).for_each(|a| a.iter_mut().for_each(|a| *a ^= 1))
        });
        t.time(|| {
            let pm = p.par_chunks_mut(CHUNK).zip(m.par_chunks_mut(CHUNK));
            let all = pm.zip(v.par_chunks_mut(CHUNK).zip(g32.par_chunks(CHUNK)));
            all.for_each(|((p, m), (v, g))| {
                for i in 0..p.len().min(m.len()).min(v.len()).min(g.len()) {
                    p[i] += g[i];
                    m[i] += g[i];
                    v[i] += g[i] * g[i];
                }
            })
        });
        let mut gs: Vec<GradSliceMut<'_>> =
            split(&mut g32, lens).into_iter().map(GradSliceMut::F32).collect();
        t.time(|| assert_eq!(unscale_and_check_with(isa, &mut gs, s), None));
        drop(gs);
        let mut gs: Vec<GradSliceMut<'_>> =
            split(&mut g16, lens).into_iter().map(GradSliceMut::F16).collect();
        t.time(|| assert_eq!(unscale_and_check_with(isa, &mut gs, s), None));
        drop(gs);
        // The same f32 bytes as one flat tensor, and cut into 1 Ki-element tensors.
        let mut gs = [GradSliceMut::F32(&mut g32)];
        t.time(|| assert_eq!(unscale_and_check_with(isa, &mut gs, s), None));
        let mut gs: Vec<GradSliceMut<'_>> = g32.chunks_mut(1024).map(GradSliceMut::F32).collect();
        t.time(|| assert_eq!(unscale_and_check_with(isa, &mut gs, s), None));
        drop(gs);
        for (adam, path) in [
            (Adam::F32, isa),
            (Adam::F16GradF16Working, isa),
            (Adam::F16Working, isa),
            (Adam::Bf16Working, isa),
            (Adam::F32, Isa::Portable),
        ] {
            let (ps, ms, vs) = (split(&mut p, lens), split(&mut m, lens), split(&mut v, lens));
            let working = split(&mut w16, lens).into_iter().zip(split(&mut wbf, lens));
            let (g32s, g16s) = (split_ref(&g32, lens), split_ref(&g16, lens));
            let mut ts: Vec<AdamTensor<'_>> =
                ps.into_iter()
                    .zip(ms)
                    .zip(vs.into_iter().zip(working))
                    .zip(g32s.into_iter().zip(g16s))
                    .map(|(((p, m), (v, (w16, wbf))), (g32, g16))| match adam {
                        Adam::F32 => AdamTensor::new(p, GradSlice::F32(g32), m, v),
                        Adam::F16GradF16Working => {
                            AdamTensor::new(p, GradSlice::F16(g16), m, v).with_working(HalfSliceMut::F16(w16))
                        }
                        Adam::F16Working => {
                            AdamTensor::new(p, GradSlice::F32(g32), m, v).with_working(HalfSliceMut::F16(w16))
                        }
                        Adam::Bf16Working => AdamTensor::new(p, GradSlice::F32(g32), m, v)
                            .with_working(HalfSliceMut::Bf16(wbf)),
                    })
                    .collect();
            t.time(|| adam_step_with(path, &mut ts, &hp, 1.0 / 1024.0));
        }
    }
    report(&rows, &harness, n);
}

/// The AdamW rows' operands: the gradient's dtype and the working copy written.
#[derive(Clone, Copy)]
enum Adam {
    /// f32 gradient, no working copy (fp32 training).
    F32,
    /// f16 gradient and f16 working copy (O2 fp16 with half gradients).
    F16GradF16Working,
    /// f32 gradient (the master's), f16 working copy.
    F16Working,
    /// f32 gradient (the master's), bf16 working copy (O2 bf16).
    Bf16Working,
}

fn report(rows: &[Row], harness: &Interleaved, n: usize) {
    let gbs = |i: usize| rows[i].bytes_per_param * n as f64 / harness.median_s(i) / 1e9;
    let triad = gbs(1);
    println!(
        "triad (in place, real bytes): {triad:.1} GB/s; STREAM triad counted 12 B: {:.1} GB/s",
        gbs(0) * 12.0 / 16.0
    );
    println!(
        "{:<38} {:>9} {:>8} {:>7} {:>9} {:>10}",
        "kernel", "median ms", "min ms", "GB/s", "vs triad", "vs pattern"
    );
    for (i, r) in rows.iter().enumerate() {
        let pattern = r.pattern.map_or(String::new(), |p| format!("{:.0}%", 100.0 * gbs(i) / gbs(p)));
        println!(
            "{:<38} {:>9.2} {:>8.2} {:>7.1} {:>8.0}% {:>10}",
            r.name,
            harness.median_s(i) * 1e3,
            harness.min_s(i) * 1e3,
            gbs(i),
            100.0 * gbs(i) / triad,
            pattern
        );
    }
}
