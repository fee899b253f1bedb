//! The machine's own peaks: [`PeakLoop`] (one instruction on independent accumulators) on both threads.

use std::fmt;
use std::time::Instant;

use amp_kernels::gemm::PeakLoop;
use amp_kernels::timing::median;

/// Peak samples in GFLOP/s, taken between rounds so that they see the same neighbours as the products.
#[derive(Default, Clone)]
pub struct Peaks {
    bf16: Vec<f64>,
    fma: Vec<f64>,
    /// The ymm FMA beside the zmm one, where the widest is zmm (candle's f32 kernels are ymm).
    ymm: Vec<f64>,
    tile: Vec<f64>,
    /// The AMX kernel's 2 x 2 step on operands in L1 ([`PeakLoop::TileStepAmx`]).
    tile_step: Vec<f64>,
}

/// Which peak bounds a contender.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Peak {
    /// The widest f32 FMA.
    Fma,
    /// `vdpbf16ps`.
    Dot,
    /// AMX `tdpbf16ps`.
    Tile,
}

const ITERS: usize = 2_000_000;

/// The widest FMA loop this CPU runs.
fn fma_loop() -> Option<PeakLoop> {
    [PeakLoop::FmaZmm, PeakLoop::FmaYmm].into_iter().find(|l| l.isa().is_supported())
}

impl Peak {
    /// The short name in the "% of peak" column.
    pub fn label(self) -> &'static str {
        match self {
            Peak::Fma => "fma",
            Peak::Dot => "dp",
            Peak::Tile => "amx",
        }
    }
}

impl Peaks {
    /// Takes one sample of each peak the CPU has.
    pub fn measure(&mut self) {
        if let Some(g) = on_two_threads(PeakLoop::Dpbf16) {
            self.bf16.push(g);
        }
        if let Some(g) = fma_loop().and_then(on_two_threads) {
            self.fma.push(g);
        }
        if fma_loop() == Some(PeakLoop::FmaZmm) {
            self.ymm.extend(on_two_threads(PeakLoop::FmaYmm));
        }
        if let Some(g) = on_two_threads(PeakLoop::TileAmx) {
            self.tile.push(g);
        }
        if let Some(g) = on_two_threads(PeakLoop::TileStepAmx) {
            self.tile_step.push(g);
        }
    }

    /// Adds `other`'s samples to these.
    pub fn absorb(&mut self, other: &Peaks) {
        self.bf16.extend(&other.bf16);
        self.fma.extend(&other.fma);
        self.ymm.extend(&other.ymm);
        self.tile.extend(&other.tile);
        self.tile_step.extend(&other.tile_step);
    }

    /// The median of `peak`'s samples (GFLOP/s), if the CPU has it.
    pub fn of(&self, peak: Peak) -> Option<f64> {
        match peak {
            Peak::Fma => self.fma(),
            Peak::Dot => self.bf16(),
            Peak::Tile => (!self.tile.is_empty()).then(|| median(&self.tile)),
        }
    }

    /// Median `vdpbf16ps` peak (GFLOP/s), if the CPU has the instruction.
    pub fn bf16(&self) -> Option<f64> {
        (!self.bf16.is_empty()).then(|| median(&self.bf16))
    }

    /// Median rate of the AMX kernel's 2 x 2 step on operands in L1 (GFLOP/s), if the CPU has AMX.
    pub fn tile_step(&self) -> Option<f64> {
        (!self.tile_step.is_empty()).then(|| median(&self.tile_step))
    }

    /// Median f32 FMA peak of the widest vectors the CPU has (GFLOP/s).
    pub fn fma(&self) -> Option<f64> {
        (!self.fma.is_empty()).then(|| median(&self.fma))
    }

    /// The peaks this CPU has, in one short line: `vdpbf16ps 612, zmm FMA 301 GFLOP/s (9 samples)`.
    pub fn brief(&self) -> String {
        let fma = fma_loop().map_or("", |l| if l == PeakLoop::FmaZmm { "zmm FMA" } else { "ymm FMA" });
        let named = [("AMX tdpbf16ps", self.of(Peak::Tile)), ("vdpbf16ps", self.bf16()), (fma, self.fma())];
        let shown: Vec<String> =
            named.iter().filter_map(|(name, g)| g.map(|g| format!("{name} {g:.0}"))).collect();
        let samples = self.fma.len();
        format!("{} GFLOP/s ({samples} sample{})", shown.join(", "), if samples == 1 { "" } else { "s" })
    }
}

impl fmt::Display for Peaks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |x: Option<f64>| x.map_or("not on this CPU".to_string(), |g| format!("{g:.0} GFLOP/s"));
        let fma = fma_loop().map_or("no", |l| if l == PeakLoop::FmaZmm { "zmm" } else { "ymm" });
        let samples = self.fma.len();
        write!(
            f,
            "peaks (2 threads, median of {samples} samples): AMX tdpbf16ps {}, vdpbf16ps {}, {fma} FMA {}",
            show(self.of(Peak::Tile)),
            show(self.bf16()),
            show(self.fma())
        )?;
        if !self.ymm.is_empty() {
            write!(f, " (ymm FMA {:.0} GFLOP/s)", median(&self.ymm))?;
        }
        if let Some(step) = self.tile_step() {
            write!(
                f,
                "; the AMX kernel's 2 x 2 tile step (4 tile loads, 4 tdpbf16ps) from L1 {step:.0} GFLOP/s"
            )?;
        }
        Ok(())
    }
}

/// GFLOP/s of `kind` run on two threads at once, or `None` where the CPU lacks it.
fn on_two_threads(kind: PeakLoop) -> Option<f64> {
    // The tile loop does 1/6 as many instructions per iteration, each 16 cycles or more.
    let iters = if kind.isa() == amp_kernels::Isa::AmxBf16 { ITERS / 16 } else { ITERS };
    kind.seconds(iters / 100)?; // warm up
    let start = Instant::now();
    rayon::join(|| kind.seconds(iters), || kind.seconds(iters));
    let seconds = start.elapsed().as_secs_f64();
    Some(2.0 * iters as f64 * kind.flops_per_iter() / seconds / 1e9)
}
