//! The measured inputs of docs/DISTRIBUTED.md's cost model, side by side in one MPI job: all-reduce
//! time and bus bandwidth of the job's ranks for 1 to 100 MiB of gradients on the fp32 and bf16 wires,
//! and the fused AdamW step on the 25.2M-parameter set of the performance baselines; then the ring
//! all-reduce time projected for that set on 8 and 64 nodes at 25 and 100 Gbit/s against the measured
//! optimizer step.
//!
//! Run (Open MPI; drop `--allow-run-as-root --oversubscribe` outside containers):
//! `cargo build --release --features mpi --example allreduce_bandwidth`, then
//! `mpirun --allow-run-as-root --oversubscribe -np 2 target/release/examples/allreduce_bandwidth`.
//!
//! Each timing is one collective call of amp's `Communicator::all_reduce_sum` (the call
//! `DataParallel::step_fused` makes per bucket: the fp32 wire copies the send buffer, a 16-bit wire
//! encodes, reduces with its user op and decodes, all counted), started after a barrier, its time the
//! slowest rank's. The cases are interleaved in every round (f32 and bf16 of each size, then the
//! optimizer), so load from other processes falls on all alike; each reports its median round.
//!
//! Bus bandwidth is nccl-tests' definition: `bytes / time * 2 (W - 1) / W` for `W` ranks, the rate each
//! rank's link would carry in a ring, comparable across world sizes. The bf16 wire's "as f32" rate
//! counts the f32 gradient bytes it reduced: the link rate an fp32 wire would need to keep up. For
//! scale, every rank also copies the same f32 bytes in memory at once (`memcpy GB/s`, bytes / time) and
//! does the bf16 wire's arithmetic alone, without MPI (`bf16 arithmetic ms`: encode, one combine of two
//! operands, decode).

use std::time::Instant;

use amp::distributed::{sum_half_words, Communicator, HalfWire, Mpi, Wire};
use amp::optim::{AdamConfig, FusedAdamW, FusedOptimizer, ParamGroups};
use amp_kernels::timing::median;
use candle_core::{DType, Device, Tensor, Var};

/// Kept rounds per case (after one warm-up round).
const ROUNDS: usize = 7;
/// Gradient sizes in MiB of f32 values.
const MIB: [usize; 5] = [1, 4, 16, 64, 100];
/// Nodes and link rates (Gbit/s) of the projection.
const NODES: [usize; 2] = [8, 64];
const LINKS_GBIT: [f64; 2] = [25.0, 100.0];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    share_cores_among_local_ranks();
    let comm = Mpi::init()?;
    if let Err(e) = measure(&comm) {
        eprintln!("rank {}: {e}", comm.rank());
        comm.abort(1);
    }
    Ok(())
}

fn measure(comm: &Mpi) -> Result<(), Box<dyn std::error::Error>> {
    let world = comm.world_size();
    let params = shapes().iter().map(|s| s.iter().product::<usize>()).sum::<usize>();
    let mut cases: Vec<usize> = MIB.iter().map(|m| m << 18).collect(); // f32 values
    cases.push(params);
    let mut buffer = vec![0f32; *cases.iter().max().unwrap_or(&0)];
    for (i, v) in buffer.iter_mut().enumerate() {
        *v = 1e-3 * ((i % 1000) as f32 - 500.0); // gradient-like magnitudes, both signs
    }
    let mut copy = vec![0f32; buffer.len()];
    let (mut optimizer, grads) = optimizer_on_param_set()?;
    if comm.rank() == 0 {
        println!(
            "{world} ranks, {} rayon threads a rank; {ROUNDS} rounds after a warm-up; each time the slowest \
             rank's, median of the rounds",
            rayon::current_num_threads()
        );
    }
    // times[case]: seconds of each round on the f32 wire, on the bf16 wire, of a memory copy of the same
    // f32 bytes and of the bf16 wire's arithmetic alone, on every rank at once; optimizer: each round's.
    let mut times = vec![[Vec::new(), Vec::new(), Vec::new(), Vec::new()]; cases.len()];
    let mut optimizer_s = Vec::new();
    for round in 0..=ROUNDS {
        for (case, &values) in cases.iter().enumerate() {
            for (w, wire) in [Wire::F32, Wire::Bf16].into_iter().enumerate() {
                let s = slowest(comm, || comm.all_reduce_sum(&mut buffer[..values], wire))?;
                // Keep the values in range: the sum doubles them on every call.
                buffer[..values].iter_mut().for_each(|v| *v /= world as f32);
                if round > 0 {
                    times[case][w].push(s);
                }
            }
            let s = slowest(comm, || {
                copy[..values].copy_from_slice(&buffer[..values]);
                std::hint::black_box(&mut copy);
                Ok(())
            })?;
            let codec = slowest(comm, || {
                bf16_arithmetic(&buffer[..values], &mut copy[..values]);
                Ok(())
            })?;
            if round > 0 {
                times[case][2].push(s);
                times[case][3].push(codec);
            }
        }
        let s = slowest(comm, || optimizer.step(&grads))?;
        if round > 0 {
            optimizer_s.push(s);
        }
    }
    if comm.rank() == 0 {
        let optimizer_ms = 1e3 * median(&optimizer_s);
        bandwidth_table(world, &cases, &times);
        println!(
            "\nfused AdamW fp32 on {params} parameters (98 tensors), every rank stepping its own copy at once: \
             {optimizer_ms:.2} ms ({:.1} GB/s at 28 B/param)",
            28.0 * params as f64 / (optimizer_ms / 1e3) / 1e9
        );
        projection(params, optimizer_ms);
    }
    Ok(())
}

/// Runs `f` on every rank after a barrier; its time on the slowest rank, in seconds.
fn slowest(comm: &Mpi, f: impl FnOnce() -> amp::Result<()>) -> amp::Result<f64> {
    comm.barrier()?;
    let start = Instant::now();
    f()?;
    let seconds = start.elapsed().as_secs_f32();
    Ok(f64::from(comm.all_reduce_max_f32(seconds)?))
}

/// The measured table: per size, each wire's median time and bus bandwidth.
fn bandwidth_table(world: usize, cases: &[usize], times: &[[Vec<f64>; 4]]) {
    let bus = 2.0 * (world - 1) as f64 / world as f64;
    println!(
        "\n| gradients (f32 values) | as f32 | f32 wire ms | f32 bus GB/s | bf16 wire ms | bf16 bus GB/s | bf16 as f32 GB/s | bf16 / f32 time | memcpy GB/s | bf16 arithmetic ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (&values, [f32_s, bf16_s, copy_s, codec_s]) in cases.iter().zip(times) {
        let [f32_s, bf16_s, copy_s, codec_s] = [f32_s, bf16_s, copy_s, codec_s].map(|t| median(t));
        let gbs = |bytes: f64, s: f64| bus * bytes / s / 1e9;
        let f32_bytes = 4.0 * values as f64;
        println!(
            "| {values} | {:.1} MiB | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1} | {:.2} |",
            f32_bytes / (1 << 20) as f64,
            1e3 * f32_s,
            gbs(f32_bytes, f32_s),
            1e3 * bf16_s,
            gbs(f32_bytes / 2.0, bf16_s),
            gbs(f32_bytes, bf16_s),
            bf16_s / f32_s,
            f32_bytes / copy_s / 1e9,
            1e3 * codec_s
        );
    }
}

/// What a bf16 all-reduce of two ranks computes besides moving bytes, as `Mpi::all_reduce_sum` does it:
/// encode to bf16 words, one combine of two operands (`sum_half_words`), decode into `out`.
fn bf16_arithmetic(values: &[f32], out: &mut [f32]) {
    let words = HalfWire::Bf16.encode_all(values);
    let mut sum = words.clone();
    sum_half_words(HalfWire::Bf16, &words, &mut sum);
    HalfWire::Bf16.decode_into(&sum, out);
}

/// Ring all-reduce time `2 (N - 1) / N * bytes / link` of the parameter set's gradients, per wire, node
/// count and link rate, against the measured optimizer step. Ignores the latency term (2 (N - 1)
/// messages per all-reduce) and overlap with backward.
fn projection(params: usize, optimizer_ms: f64) {
    println!(
        "\nprojected ring all-reduce per step, {params} gradients: 2(N-1)/N x bytes / link (no latency term, \
         no overlap with backward)"
    );
    println!("| wire | bytes | nodes | link | all-reduce ms | / optimizer step ({optimizer_ms:.1} ms) |");
    println!("|---|---|---|---|---|---|");
    for (wire, bytes_per) in [("fp32", 4.0), ("bf16", 2.0)] {
        let bytes = bytes_per * params as f64;
        for nodes in NODES {
            for gbit in LINKS_GBIT {
                let ms = 1e3 * 2.0 * (nodes - 1) as f64 / nodes as f64 * bytes / (gbit * 1e9 / 8.0);
                println!(
                    "| {wire} | {:.1} MB | {nodes} | {gbit} Gbit/s | {ms:.1} | {:.2}x |",
                    bytes / 1e6,
                    ms / optimizer_ms
                );
            }
        }
    }
}

/// The 98 tensor shapes of the performance baselines' parameter set (benches/optimizer_step.rs): per
/// layer of 8, qkv (1536x512), out (512x512), ffn (2048x512, 512x2048) with biases and two layer norms
/// (weight and bias); then a final norm. 25,220,096 values.
fn shapes() -> Vec<Vec<usize>> {
    let layer = [(1536, 512), (512, 512), (2048, 512), (512, 2048)];
    let mut shapes: Vec<Vec<usize>> = (0..8)
        .flat_map(|_| {
            let linears = layer.iter().flat_map(|&(rows, cols)| [vec![rows, cols], vec![rows]]);
            linears.chain(std::iter::repeat_n(vec![512], 4))
        })
        .collect();
    shapes.extend([vec![512], vec![512]]);
    shapes
}

/// A fused AdamW over the parameter set in fp32 and gradients for it (0.01 everywhere).
fn optimizer_on_param_set() -> amp::Result<(FusedAdamW, candle_core::backprop::GradStore)> {
    let vars = shapes()
        .iter()
        .map(|s| Var::ones(s.as_slice(), DType::F32, &Device::Cpu))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let mut loss = Tensor::new(0f32, &Device::Cpu)?;
    for v in &vars {
        loss = (loss + (v.as_tensor() * 0.01)?.sum_all()?)?;
    }
    let grads = loss.backward()?;
    let optimizer = FusedAdamW::new(ParamGroups::from_vars(vars)?, AdamConfig::default())?;
    Ok((optimizer, grads))
}

/// Gives rayon (the optimizer's threads) this rank's share of the cores when the launcher says how many
/// ranks share the machine (Open MPI's `OMPI_COMM_WORLD_LOCAL_SIZE`, MPICH's `MPI_LOCALNRANKS`), unless
/// `RAYON_NUM_THREADS` is set: ranks on one machine would otherwise oversubscribe it.
fn share_cores_among_local_ranks() {
    if std::env::var_os("RAYON_NUM_THREADS").is_some() {
        return;
    }
    if let Some(threads) = amp::distributed::local_share_of_cores() {
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    }
}
