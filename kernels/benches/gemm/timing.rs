//! The GEMM bench's rounds on the shared harness (`amp_kernels::timing`), and its tables.

use std::time::Instant;

pub use amp_kernels::timing::median;

use crate::peak::{Peak, Peaks};

/// Wall time each contender should get per shape, summed over its rounds.
const BUDGET_S: f64 = 0.6;

/// Times `call(0..n)` in rounds: a warm-up round (dropped) that also sizes the run, then 3 to 15 rounds
/// (as many as fit the budget), a peak sample before each. Each round calls every contender once, in
/// an order shuffled anew each round, so that none always follows the same neighbour: amp's rows share
/// their packing buffers and operands, and in a fixed order the first of them always found those
/// evicted by the peers' products before it (measured: that row 8-45% slower than the same path two
/// rows later on the skinny shapes). A call that returns a time (a peer in another process, timed
/// there) is kept at that time. Returns every contender's kept times in seconds, and the peaks sampled
/// between these rounds: the shape's "% of peak" is of what the CPU could do in the same seconds
/// (measured: a run's first shapes saw 128-146 GFLOP/s of ymm FMA where its later ones saw 184, and
/// against the median of the samples so far 2048^3 read 115% of its peak).
pub fn interleaved(n: usize, mut call: impl FnMut(usize) -> Option<f64>) -> (Vec<Vec<f64>>, Peaks) {
    let mut peaks = Peaks::default();
    let mut timed = |i: usize| {
        let start = Instant::now();
        call(i).unwrap_or_else(|| start.elapsed().as_secs_f64())
    };
    let start = Instant::now();
    for i in 0..n {
        timed(i);
    }
    let slowest_round = start.elapsed().as_secs_f64();
    let rounds = ((BUDGET_S * n as f64 / slowest_round) as usize).clamp(3, 15);
    let mut seconds = vec![Vec::with_capacity(rounds); n];
    let mut order: Vec<usize> = (0..n).collect();
    let mut shuffle = Shuffle(0x9E37_79B9_7F4A_7C15);
    for _ in 0..rounds {
        peaks.measure();
        shuffle.apply(&mut order);
        for &i in &order {
            seconds[i].push(timed(i));
        }
    }
    (seconds, peaks)
}

/// A fixed sequence of shuffles (xorshift64 and Fisher-Yates): the same orders in every run.
struct Shuffle(u64);

impl Shuffle {
    fn apply(&mut self, order: &mut [usize]) {
        for i in (1..order.len()).rev() {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            order.swap(i, (self.0 % (i as u64 + 1)) as usize);
        }
    }
}

/// One contender's median on one shape.
pub struct Row {
    pub name: String,
    pub seconds: f64,
    /// The peak it is measured against.
    pub peak: Peak,
}

impl Row {
    fn gflops(&self, flops: f64) -> f64 {
        flops / self.seconds / 1e9
    }

    fn of_peak(&self, flops: f64, peaks: &Peaks) -> Option<f64> {
        let peak = peaks.of(self.peak)?;
        Some(100.0 * self.gflops(flops) / peak)
    }
}

pub fn print(rows: &[Row], flops: f64, peaks: &Peaks) {
    let candle = rows.iter().find(|r| r.name == "candle f32").map(|r| r.seconds);
    println!("  peaks in these rounds: {}", peaks.brief());
    println!(
        "  {:<40} {:>9} {:>9} {:>12} {:>13}",
        "contender", "ms", "GFLOP/s", "% of peak", "vs candle f32"
    );
    for r in rows {
        let of_peak = r.of_peak(flops, peaks).map_or("-".into(), |p| format!("{p:.0}% {}", r.peak.label()));
        let vs = candle.map_or("-".into(), |c| format!("{:.2}x", c / r.seconds));
        println!(
            "  {:<40} {:>9.3} {:>9.1} {:>12} {:>13}",
            r.name,
            r.seconds * 1e3,
            r.gflops(flops),
            of_peak,
            vs
        );
    }
}

/// Every shape's rows, for the goals printed at the end.
#[derive(Default)]
pub struct Summary {
    shapes: Vec<(String, f64, Vec<Row>)>,
    /// The peaks sampled in the 2048^3 shape's rounds.
    peaks_2048: Peaks,
    /// Every shape's peak samples.
    all_peaks: Peaks,
}

impl Summary {
    /// Adds a shape's rows and the peaks sampled in its rounds.
    pub fn add(&mut self, shape: &str, flops: f64, rows: Vec<Row>, peaks: &Peaks) {
        if shape == "2048^3" {
            self.peaks_2048 = peaks.clone();
        }
        self.all_peaks.absorb(peaks);
        self.shapes.push((shape.to_string(), flops, rows));
    }

    pub fn print(&self) {
        println!("\nover the whole run: {}", self.all_peaks);
        let peaks = &self.peaks_2048;
        let find =
            |rows: &[Row], prefix: &str| rows.iter().find(|r| r.name.starts_with(prefix)).map(|r| r.seconds);
        let Some((_, _, any)) = self.shapes.first() else { return };
        let Some((_, flops, rows)) = self.shapes.iter().find(|(s, _, _)| s == "2048^3") else {
            println!("goals (issue #12): stated at 2048^3, which this run's --shape filter left out");
            return;
        };
        println!("goals (issue #12), medians of this run:");
        let candle = find(rows, "candle f32").unwrap_or(f64::NAN);
        let best_bf16 = find(rows, "amp bf16").unwrap_or(f64::NAN);
        let best_f32 = find(rows, "amp f32").unwrap_or(f64::NAN);
        let best_f16 = find(rows, "amp f16").unwrap_or(f64::NAN);
        if any.iter().any(|r| r.name.contains("tdpbf16ps")) {
            let tile = rows.iter().find(|r| r.name.contains("tdpbf16ps") && !r.name.contains("auto"));
            let tile_s = tile.map_or(f64::NAN, |r| r.seconds);
            println!("  AMX CPU:");
            println!("    amp bf16 (AMX) / candle f32 at 2048^3: {:.2}x (goal >= 3x)", candle / tile_s);
            println!("    amp bf16 (AMX) / amp f32 at 2048^3: {:.2}x", best_f32 / tile_s);
            let of_peak = tile.and_then(|r| r.of_peak(*flops, peaks)).unwrap_or(f64::NAN);
            println!("    amp bf16 (AMX) at 2048^3: {of_peak:.0}% of the measured tdpbf16ps peak");
            if let Some(step) = peaks.tile_step() {
                let gflops = flops / tile_s / 1e9;
                println!(
                    "    amp bf16 (AMX) at 2048^3: {:.0}% of the kernel's 2 x 2 tile step from L1 ({step:.0} GFLOP/s)",
                    100.0 * gflops / step
                );
            }
            let mut ahead = 0;
            for (shape, _, rows) in &self.shapes {
                let (ours, f32) = (find(rows, "amp bf16"), find(rows, "amp f32"));
                if let (Some(ours), Some(f32)) = (ours, f32) {
                    if ours < f32 {
                        ahead += 1;
                    } else {
                        println!(
                            "    bf16 (AMX) slower than amp f32 on {shape}: {:.2}x of its speed",
                            f32 / ours
                        );
                    }
                }
            }
            println!("    amp bf16 (AMX) faster than amp f32 on {ahead} of {} shapes", self.shapes.len());
        }
        if any.iter().any(|r| r.name.contains("vdpbf16ps")) {
            // The first "amp bf16" row is amp's own choice ("auto: " and its path): AMX, `vdpbf16ps`,
            // or the zmm FMA where `vdpbf16ps` multiplies slower than it.
            let chosen = rows.iter().find(|r| r.name.starts_with("amp bf16")).map_or("?", |r| &r.name[9..]);
            let dot = rows.iter().find(|r| r.name.contains("vdpbf16ps") && !r.name.contains("auto"));
            println!("  AVX512-BF16 CPU (amp bf16 = amp's own choice, at 2048^3 {chosen}):");
            println!("    amp bf16 / candle f32 at 2048^3: {:.2}x (goal >= 3x)", candle / best_bf16);
            let ceiling =
                [Peak::Tile, Peak::Dot, Peak::Fma].iter().filter_map(|&p| peaks.of(p)).fold(0.0, f64::max);
            let candle_gflops = flops / candle / 1e9;
            println!(
                "      (the highest peak measured in these rounds, {ceiling:.0} GFLOP/s, is {:.2}x candle f32)",
                ceiling / candle_gflops
            );
            let of_peak = dot.and_then(|r| r.of_peak(*flops, peaks)).unwrap_or(f64::NAN);
            println!(
                "    amp bf16 vdpbf16ps path at 2048^3: {of_peak:.0}% of the measured vdpbf16ps peak (goal >= 85%)"
            );
            println!("    amp f32 / candle f32 at 2048^3: {:.2}x (goal >= 1.5x)", candle / best_f32);
            self.ahead("amp bf16", |r| r.name.starts_with("amp bf16"), "gemmkit bf16", true);
        } else {
            println!("  AVX2-only CPU:");
            println!("    amp bf16 / amp f32 speed at 2048^3: {:.2}x (goal >= 0.95x)", best_f32 / best_bf16);
            println!("    amp f16 / amp f32 speed at 2048^3: {:.2}x (goal >= 0.95x)", best_f32 / best_f16);
            println!("    amp f32 / candle f32 at 2048^3: {:.2}x (goal >= 1x)", candle / best_f32);
        }
        let forced = |name: &str| rows.iter().find(|r| r.name == name).map_or(f64::NAN, |r| r.seconds);
        if any.iter().any(|r| r.name.contains("avx512")) && any.iter().any(|r| r.name.contains("avx2")) {
            let f32_avx2 = forced("amp f32 avx2 f32 fma");
            println!("  AVX2 paths forced on this CPU (an AVX2-only CPU's own numbers still wait for one):");
            println!(
                "    amp bf16 / amp f32 speed at 2048^3: {:.2}x (goal >= 0.95x)",
                f32_avx2 / forced("amp bf16 avx2 f32 fma")
            );
            println!(
                "    amp f16 / amp f32 speed at 2048^3: {:.2}x (goal >= 0.95x)",
                f32_avx2 / forced("amp f16 avx2 f32 fma")
            );
            println!("    amp f32 / candle f32 at 2048^3: {:.2}x (goal >= 1x)", candle / f32_avx2);
        }
        if find(any, "candle x86-v4 f32").is_some() {
            let x86_v4 = find(rows, "candle x86-v4 f32").unwrap_or(f64::NAN);
            println!("  candle with gemm's x86-v4 kernels (a peer column; the issue's baseline is candle's default):");
            println!("    candle x86-v4 f32 / candle f32 at 2048^3: {:.2}x", candle / x86_v4);
            println!("    amp f32 / candle x86-v4 f32 at 2048^3: {:.2}x", x86_v4 / best_f32);
            self.ahead("amp f32", |r| r.name.starts_with("amp f32"), "candle x86-v4 f32", false);
        }
        if find(any, "torch bf16").is_some() {
            println!("  PyTorch (a peer column):");
            match find(rows, "torch bf16") {
                Some(torch) => println!("    amp bf16 / torch bf16 at 2048^3: {:.2}x", torch / best_bf16),
                None => println!("    torch bf16 not run at 2048^3 (too slow on this CPU)"),
            }
            self.ahead("amp bf16", |r| r.name.starts_with("amp bf16"), "torch bf16", true);
        }
    }

    /// Prints every shape where the first row that is `ours` is not faster than the row named `peer`,
    /// then on how many shapes it is (with the goal of all, where `goal`).
    fn ahead(&self, label: &str, ours: impl Fn(&Row) -> bool, peer: &str, goal: bool) {
        let (mut ahead, mut compared) = (0, 0);
        for (shape, _, rows) in &self.shapes {
            let us = rows.iter().find(|r| ours(r)).map(|r| r.seconds);
            let them = rows.iter().find(|r| r.name == peer).map(|r| r.seconds);
            if let (Some(us), Some(them)) = (us, them) {
                compared += 1;
                if us < them {
                    ahead += 1;
                } else {
                    println!("    behind {peer} on {shape}: {:.2}x of its speed", them / us);
                }
            }
        }
        let goal = if goal { " (goal: all)" } else { "" };
        let not_run = self.shapes.len() - compared;
        let not_run = if not_run > 0 { format!(" (not run on {not_run}: too slow)") } else { String::new() };
        println!("    {label} ahead of {peer} on {ahead} of {compared} shapes{goal}{not_run}");
    }
}
