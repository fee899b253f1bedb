//! GEMM throughput: amp's paths against candle's matmul and gemmkit, with the machine's own peaks.
//!
//! Every shape runs every contender interleaved (A, B, C, ... per round) on a 2-thread rayon pool;
//! each row is the median of its rounds. "peak" is what the same binary measures for a loop of the
//! instruction on independent accumulators (AMX `tdpbf16ps`, `vdpbf16ps` and the widest f32 FMA), timed
//! before each round so that it sees the same neighbours; a shape's "% of peak" is of its own rounds'
//! peaks. Shapes: squares 256..4096, the main job's and a BERT-base layer's products (forward, and both
//! backward products), and skinny products (m = 4, 16, 64).
//!
//! The first bf16 row ("amp bf16 auto") is amp's own choice ([`gemm`], on the path
//! [`GemmPath::choose`] picks); the rows after it force each path the CPU has. (A path reads the
//! operands of a product of few rows in place where it has a kernel for them: every row runs it.)
//!
//! Layouts are training's: forward `x·W^T` reads the weight `(out, in)` in place (B transposed),
//! `dX = dY·W` reads both row-major, `dW = dY^T·X` reads A transposed. amp's bf16 and f16 rows write
//! bf16 / f16 C (as candle's and gemmkit's half products do); f32 rows write f32. On an AVX-512 CPU the
//! AVX2 rows are forced paths, their packing loops capped at AVX2 too (`vectorise::limit_width`), so
//! that they run what an AVX2-only CPU would.
//!
//! Run: `cargo bench -p amp-kernels --bench gemm` (a few minutes; `-- --quick` for squares to 2048,
//! `-- --shape TEXT` for the shapes whose name contains TEXT, e.g. `--shape 2048^3` or `--shape bert`).
//! `scripts/torch-bench.sh` runs it with PyTorch's bf16 and f32 matmul as two more columns, and
//! `scripts/candle-x86-v4-bench.sh` with candle's f32 matmul built with its `gemm` dependency's `x86-v4`
//! feature (AVX-512 kernels) as one more (`peer.rs`).

mod peak;
mod peer;
mod timing;

use amp_kernels::gemm::{gemm, gemm_with, Compute, Dims, GemmPath, MatMut, MatRef, Start};
use amp_kernels::{vectorise, Isa};
use candle_core::{DType, Device, Tensor};
use half::bf16;
use half::f16;

use peak::Peak;
use peer::{ChildPeer, PeerDtype};
use timing::median;

/// The longest a peer's product may be expected to take (at its speed on the last shape it ran) for
/// the peer to run a shape: PyTorch multiplies bf16 at 0.3-24 GFLOP/s on an AVX2-only CPU (it has no
/// bf16 kernel there: 57 s for 2048^3, some 8 minutes for 4096^3), which would keep the sweep from
/// ending.
const PEER_PRODUCT_LIMIT_S: f64 = 2.0;

/// How B is read: `Normal` row-major `(k, n)`, `Transposed` a row-major `(n, k)` read as its transpose.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Layout {
    Normal,
    Transposed,
}

struct Shape {
    name: String,
    m: usize,
    k: usize,
    n: usize,
    a: Layout,
    b: Layout,
}

fn shape(name: impl Into<String>, (m, k, n): (usize, usize, usize), a: Layout, b: Layout) -> Shape {
    Shape { name: name.into(), m, k, n, a, b }
}

/// The three products of a Linear layer with `tokens` rows, `inp` inputs and `out` outputs.
fn linear(label: &str, tokens: usize, inp: usize, out: usize) -> [Shape; 3] {
    use Layout::{Normal, Transposed};
    [
        shape(format!("{label} fwd"), (tokens, inp, out), Normal, Transposed),
        shape(format!("{label} dX"), (tokens, out, inp), Normal, Normal),
        shape(format!("{label} dW"), (out, tokens, inp), Transposed, Normal),
    ]
}

fn shapes(quick: bool) -> Vec<Shape> {
    use Layout::{Normal, Transposed};
    let mut v = Vec::new();
    let squares: &[usize] = if quick { &[256, 512, 1024, 2048] } else { &[256, 512, 1024, 2048, 4096] };
    for &s in squares {
        v.push(shape(format!("{s}^3"), (s, s, s), Normal, Normal));
    }
    if quick {
        return v;
    }
    // The main job (examples/train, default size): 8 x 128 tokens, d_model 256 (q, k, v and out
    // projections 256 x 256), MLP 1024.
    v.extend(linear("main proj", 1024, 256, 256));
    v.extend(linear("main mlp-up", 1024, 256, 1024));
    v.extend(linear("main mlp-down", 1024, 1024, 256));
    // A BERT-base layer at 16 x 128 tokens: d 768, FFN 3072.
    v.extend(linear("bert qkv", 2048, 768, 2304));
    v.extend(linear("bert ffn-up", 2048, 768, 3072));
    v.extend(linear("bert ffn-down", 2048, 3072, 768));
    // m = 4: a Linear's forward on a batch of a few rows (generation, one token per sequence).
    for m in [4, 16, 64] {
        v.push(shape(format!("skinny m={m}"), (m, 1024, 1024), Normal, Transposed));
        v.push(shape(format!("skinny m={m} wide"), (m, 4096, 4096), Normal, Transposed));
    }
    v
}

/// Operands of one shape in every dtype, stored as the layouts say.
struct Operands {
    a32: Vec<f32>,
    b32: Vec<f32>,
    a16: Vec<f16>,
    b16: Vec<f16>,
    abf: Vec<bf16>,
    bbf: Vec<bf16>,
}

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) >> 8) as f32 / (1u32 << 24) as f32 - 0.5)
        .collect()
}

impl Operands {
    fn new(s: &Shape) -> Operands {
        let (a32, b32) = (values(s.m * s.k, 1), values(s.k * s.n, 2));
        Operands {
            a16: a32.iter().map(|&x| f16::from_f32(x)).collect(),
            b16: b32.iter().map(|&x| f16::from_f32(x)).collect(),
            abf: a32.iter().map(|&x| bf16::from_f32(x)).collect(),
            bbf: b32.iter().map(|&x| bf16::from_f32(x)).collect(),
            a32,
            b32,
        }
    }
}

/// The amp view of a stored operand of logical shape `(rows, cols)`.
fn view<'a, T>(data: &'a [T], rows: usize, cols: usize, layout: Layout) -> MatRef<'a>
where
    &'a [T]: Into<amp_kernels::GradSlice<'a>>,
{
    match layout {
        Layout::Normal => MatRef::row_major(data, cols),
        Layout::Transposed => {
            let _ = rows;
            MatRef::transposed(data, rows)
        }
    }
}

/// A candle tensor of logical shape `(rows, cols)` stored as `layout` says (a transposed view, no copy).
fn candle(data: &[f32], rows: usize, cols: usize, layout: Layout, dtype: DType) -> Tensor {
    let t = match layout {
        Layout::Normal => Tensor::from_slice(data, (rows, cols), &Device::Cpu).unwrap(),
        Layout::Transposed => Tensor::from_slice(data, (cols, rows), &Device::Cpu).unwrap().t().unwrap(),
    };
    t.to_dtype(dtype).unwrap()
}

/// A gemmkit view of a stored operand.
fn kit<T>(data: &[T], rows: usize, cols: usize, layout: Layout) -> gemmkit::MatRef<'_, T> {
    match layout {
        Layout::Normal => gemmkit::MatRef::from_row_major(data, rows, cols),
        Layout::Transposed => gemmkit::MatRef::from_col_major(data, rows, cols),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let filter = args.iter().position(|a| a == "--shape").map(|i| {
        args.get(i + 1).cloned().unwrap_or_else(|| panic!("--shape needs the text a shape's name contains"))
    });
    let mut shapes = shapes(quick);
    if let Some(filter) = &filter {
        shapes.retain(|s| s.name.contains(filter.as_str()));
        assert!(!shapes.is_empty(), "no shape's name contains {filter:?}");
    }
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    pool.install(|| run(shapes));
}

/// One implementation of the product.
#[derive(Clone, Copy)]
enum Contender {
    /// amp's own choice ([`gemm`], on [`GemmPath::choose`]'s path).
    AmpAuto(Compute),
    Amp(GemmPath, Compute),
    CandleF32,
    CandleBf16,
    GemmkitBf16,
    Torch(PeerDtype),
    /// candle's f32 matmul with `gemm`'s `x86-v4` kernels, in a child process.
    CandleX86V4,
}

impl Contender {
    fn all(torch: bool, candle_x86_v4: bool) -> Vec<Contender> {
        // bf16 as amp chooses for each product first (the goals read the first "amp bf16" row), then
        // on every path the CPU has.
        let mut v = vec![Contender::AmpAuto(Compute::Bf16)];
        for path in [GemmPath::AmxBf16, GemmPath::Avx512Bf16, GemmPath::Avx512, GemmPath::Avx2] {
            if path.is_supported() {
                v.push(Contender::Amp(path, Compute::Bf16));
            }
        }
        // f16 and f32 on each FMA path the CPU has: on an AVX-512 CPU the AVX2 rows show what the
        // AVX2-only goals measure (forced paths; another CPU's own numbers still wait for one).
        for compute in [Compute::F16, Compute::F32] {
            for path in [GemmPath::Avx512, GemmPath::Avx2] {
                if path.is_supported() {
                    v.push(Contender::Amp(path, compute));
                }
            }
        }
        v.extend([Contender::CandleF32, Contender::CandleBf16, Contender::GemmkitBf16]);
        if candle_x86_v4 {
            v.push(Contender::CandleX86V4);
        }
        if torch {
            v.extend([Contender::Torch(PeerDtype::Bf16), Contender::Torch(PeerDtype::F32)]);
        }
        v
    }

    /// Whether it runs in a child process (`peer.rs`): a column that may be too slow to run every shape.
    fn is_peer(self) -> bool {
        matches!(self, Contender::Torch(_) | Contender::CandleX86V4)
    }

    /// Its row's name, where amp's own choice took `auto` for the shape.
    fn name(self, auto: GemmPath) -> String {
        match self {
            Contender::AmpAuto(compute) => {
                format!("amp {} auto: {auto}", format!("{compute:?}").to_lowercase())
            }
            Contender::Amp(path, compute) => format!("amp {} {path}", format!("{compute:?}").to_lowercase()),
            Contender::CandleF32 => "candle f32".into(),
            Contender::CandleBf16 => "candle bf16".into(),
            Contender::GemmkitBf16 => "gemmkit bf16".into(),
            Contender::Torch(PeerDtype::Bf16) => "torch bf16".into(),
            Contender::Torch(PeerDtype::F32) => "torch f32".into(),
            Contender::CandleX86V4 => "candle x86-v4 f32".into(),
        }
    }

    /// Which measured peak bounds it: AMX's or `vdpbf16ps`'s for the dot-product paths, `vdpbf16ps`'s
    /// for the peers' bf16 products where the CPU has it, else the FMA's.
    fn peak(self, auto: GemmPath) -> Peak {
        match self {
            Contender::AmpAuto(compute) => Contender::Amp(auto, compute).peak(auto),
            Contender::Amp(GemmPath::AmxBf16, _) => Peak::Tile,
            Contender::Amp(path, _) if path.is_bf16_dot() => Peak::Dot,
            Contender::GemmkitBf16 | Contender::CandleBf16 | Contender::Torch(PeerDtype::Bf16)
                if GemmPath::Avx512Bf16.is_supported() =>
            {
                Peak::Dot
            }
            _ => Peak::Fma,
        }
    }
}

fn run(shapes: Vec<Shape>) {
    println!("GEMM bench: 2 threads, {}", cpu_line());
    let mut first = peak::Peaks::default();
    first.measure();
    println!("peaks before the first shape: {}", first.brief());
    println!("amp's bf16 products run on: {}", chosen_bf16_reason());
    let mut torch = ChildPeer::torch_from_env();
    let mut x86_v4 = ChildPeer::candle_x86_v4_from_env();
    for peer in torch.iter().chain(&x86_v4) {
        println!("peer: {} on 2 threads, in a child process that times each product itself", peer.version);
    }
    let contenders = Contender::all(torch.is_some(), x86_v4.is_some());
    let mut summary = timing::Summary::default();
    // Each peer's GFLOP/s on the last shape it ran.
    let mut peer_speed: Vec<Option<f64>> = vec![None; contenders.len()];
    for s in shapes {
        let dims = Dims::new(s.m, s.n, s.k);
        let flops = dims.flops();
        let expected_s: Vec<Option<f64>> =
            peer_speed.iter().map(|speed| speed.map(|g| flops / g / 1e9)).collect();
        let not_run: Vec<bool> =
            expected_s.iter().map(|t| t.is_some_and(|t| t > PEER_PRODUCT_LIMIT_S)).collect();
        let ops = Operands::new(&s);
        let mut c32 = vec![0.0f32; s.m * s.n];
        let mut c16 = vec![f16::ZERO; s.m * s.n];
        let mut cbf = vec![bf16::ZERO; s.m * s.n];
        let (ca32, cb32) =
            (candle(&ops.a32, s.m, s.k, s.a, DType::F32), candle(&ops.b32, s.k, s.n, s.b, DType::F32));
        let (cabf, cbbf) =
            (candle(&ops.a32, s.m, s.k, s.a, DType::BF16), candle(&ops.b32, s.k, s.n, s.b, DType::BF16));
        for peer in torch.iter_mut().chain(&mut x86_v4) {
            peer.shape(&s);
        }
        let auto = GemmPath::choose(Compute::Bf16);
        let call = |i: usize| -> Option<f64> {
            if not_run[i] {
                return Some(f64::NAN);
            }
            match contenders[i] {
                Contender::AmpAuto(compute) => {
                    let (a, b, out) = amp_operands(&s, &ops, compute, (&mut c32, &mut c16, &mut cbf));
                    gemm(dims, a, b, out, compute, Start::Zero).unwrap();
                }
                Contender::Amp(path, compute) => {
                    let (a, b, out) = amp_operands(&s, &ops, compute, (&mut c32, &mut c16, &mut cbf));
                    // A forced AVX2 path also packs with the AVX2 versions of the loops, as on an
                    // AVX2-only CPU.
                    let cap = (path == GemmPath::Avx2).then(|| vectorise::limit_width(Some(Isa::Avx2)));
                    gemm_with(path, dims, a, b, out, compute, Start::Zero).unwrap();
                    if let Some(previous) = cap {
                        vectorise::limit_width(previous);
                    }
                }
                Contender::CandleF32 => drop(ca32.matmul(&cb32).unwrap()),
                Contender::CandleBf16 => drop(cabf.matmul(&cbbf).unwrap()),
                Contender::GemmkitBf16 => {
                    let (a, b) = (kit(&ops.abf, s.m, s.k, s.a), kit(&ops.bbf, s.k, s.n, s.b));
                    let c = gemmkit::MatMut::from_row_major(&mut cbf[..], s.m, s.n);
                    gemmkit::gemm(bf16::ONE, a, b, bf16::ZERO, c, gemmkit::Parallelism::Rayon(2));
                }
                Contender::Torch(dtype) => {
                    return Some(torch.as_mut().expect("a torch column has a peer").run(dtype));
                }
                Contender::CandleX86V4 => {
                    return Some(x86_v4.as_mut().expect("an x86-v4 column has a peer").run(PeerDtype::F32));
                }
            }
            None
        };
        let (times, peaks) = timing::interleaved(contenders.len(), call);
        println!("\n{} (m {}, k {}, n {}): {:.2} GFLOP", s.name, s.m, s.k, s.n, flops / 1e9);
        let mut rows = Vec::new();
        for (i, (c, t)) in contenders.iter().zip(times).enumerate() {
            let seconds = median(&t);
            if not_run[i] {
                let (speed, expected) =
                    (peer_speed[i].unwrap_or(f64::NAN), expected_s[i].unwrap_or(f64::NAN));
                let why =
                    format!("{expected:.0} s a product at its {speed:.1} GFLOP/s of the last shape it ran");
                println!("  {}: not run ({why})", c.name(auto));
                continue;
            }
            if c.is_peer() {
                peer_speed[i] = Some(flops / seconds / 1e9);
            }
            rows.push(timing::Row { name: c.name(auto), seconds, peak: c.peak(auto) });
        }
        timing::print(&rows, flops, &peaks);
        summary.add(&s.name, flops, rows, &peaks);
    }
    summary.print();
}

/// A and B of a shape in `compute`'s dtype, and C of that dtype from the three buffers.
fn amp_operands<'a>(
    s: &Shape,
    ops: &'a Operands,
    compute: Compute,
    (c32, c16, cbf): (&'a mut [f32], &'a mut [f16], &'a mut [bf16]),
) -> (MatRef<'a>, MatRef<'a>, MatMut<'a>) {
    match compute {
        Compute::Bf16 => {
            (view(&ops.abf, s.m, s.k, s.a), view(&ops.bbf, s.k, s.n, s.b), MatMut::row_major(cbf, s.n))
        }
        Compute::F16 => {
            (view(&ops.a16, s.m, s.k, s.a), view(&ops.b16, s.k, s.n, s.b), MatMut::row_major(c16, s.n))
        }
        Compute::F32 => {
            (view(&ops.a32, s.m, s.k, s.a), view(&ops.b32, s.k, s.n, s.b), MatMut::row_major(c32, s.n))
        }
    }
}

/// The path amp chooses for bf16 products on this CPU, and why where `vdpbf16ps` exists.
fn chosen_bf16_reason() -> String {
    let chosen = GemmPath::choose(Compute::Bf16);
    match amp_kernels::gemm::dot_product_speedup() {
        Some(ratio) if !chosen.is_bf16_dot() => format!(
            "{chosen} (vdpbf16ps multiplies at {ratio:.2}x the zmm FMA's flop rate here, below the {:.1}x \
             at which amp takes it)",
            amp_kernels::gemm::DOT_PAYS
        ),
        Some(ratio) => format!("{chosen} (vdpbf16ps at {ratio:.2}x the zmm FMA's flop rate here)"),
        None => chosen.to_string(),
    }
}

fn cpu_line() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = info
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .unwrap_or(" unknown");
    let flags: Vec<&str> = info
        .lines()
        .find(|l| l.starts_with("flags"))
        .map(|l| {
            l.split_whitespace()
                .filter(|f| ["avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16"].contains(f))
                .collect()
        })
        .unwrap_or_default();
    format!("CPU{model}, flags: {}", flags.join(" "))
}
