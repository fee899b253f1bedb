//! Bandwidth of the fused AdamW and of unscale against the device's own copy bandwidth, measured side by
//! side in this run with CUDA events. Goal: at least 85 % of copy bandwidth (Apex's fused kernels' mark).

use std::sync::Arc;
use std::time::{Duration, Instant};

use amp_kernels::cuda::{
    CudaError, CudaKernels, DeviceScaler, DeviceTable, GradFactor, OptimizerStep, ScaleState, TensorKind,
};
use amp_kernels::optim::AdamParams;
use amp_kernels::Dtype;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use half::f16;

use crate::data;
use crate::Row;

type Result<T> = std::result::Result<T, CudaError>;

/// Tensors and elements per tensor: 64 Mi parameters, a mid-size model.
const TENSORS: usize = 32;
const PER_TENSOR: usize = 2 << 20;
const ITERATIONS: usize = 20;
const GOAL: f64 = 0.85;

/// Mean seconds per call of `f` over `ITERATIONS` calls after two warm-up calls, timed with events.
fn time(stream: &Arc<CudaStream>, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    f()?;
    let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    for _ in 0..ITERATIONS {
        f()?;
    }
    let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    end.synchronize()?;
    Ok(f64::from(start.elapsed_ms(&end)?) / 1e3 / ITERATIONS as f64)
}

fn buffers<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
) -> Result<Vec<CudaSlice<T>>> {
    (0..TENSORS).map(|_| Ok(stream.alloc_zeros::<T>(PER_TENSOR)?)).collect()
}

fn addresses<T>(stream: &Arc<CudaStream>, slices: &[CudaSlice<T>]) -> Vec<u64> {
    slices.iter().map(|s| s.device_ptr(stream).0).collect()
}

fn gbps(bytes: f64, seconds: f64) -> f64 {
    bytes / seconds / 1e9
}

pub fn run_all(kernels: &CudaKernels, stream: &Arc<CudaStream>, budget: Duration) -> Result<Vec<Row>> {
    let start = Instant::now();
    let n = (TENSORS * PER_TENSOR) as f64;
    let mut rows = Vec::new();

    // The reference: a device-to-device copy of 1 GiB (reads and writes 1 GiB each).
    let src: CudaSlice<f32> = stream.alloc_zeros(TENSORS * PER_TENSOR * 4)?;
    let mut dst: CudaSlice<f32> = stream.alloc_zeros(TENSORS * PER_TENSOR * 4)?;
    let copy_bytes = 2.0 * 4.0 * 4.0 * n;
    let copy = gbps(copy_bytes, time(stream, || Ok(stream.memcpy_dtod(&src, &mut dst)?))?);
    rows.push(Row { item: "device copy (reference)".into(), result: format!("{copy:.0} GB/s"), ok: true });
    drop((src, dst));

    let measure = |name: &str, bytes_per_element: f64, seconds: f64| {
        let bw = gbps(bytes_per_element * n, seconds);
        let ratio = bw / copy;
        Row {
            item: name.into(),
            result: format!("{bw:.0} GB/s = {:.0} % of copy (goal {:.0} %)", 100.0 * ratio, 100.0 * GOAL),
            ok: ratio >= GOAL,
        }
    };
    let scaler = DeviceScaler::new(stream, &ScaleState::new(1.0, 1))?;
    let mut unscale_scaler = DeviceScaler::new(stream, &ScaleState::new(1.0, 1))?;

    // Unscale in place: f32 (read 4 + write 4 bytes) and f16 (2 + 2).
    for (dtype, bytes, name) in
        [(Dtype::F32, 8.0, "unscale, f32 grads"), (Dtype::F16, 4.0, "unscale, f16 grads")]
    {
        let f32s = if dtype == Dtype::F32 { buffers::<f32>(stream)? } else { Vec::new() };
        let f16s = if dtype == Dtype::F16 { buffers::<f16>(stream)? } else { Vec::new() };
        let list = if dtype == Dtype::F32 { addresses(stream, &f32s) } else { addresses(stream, &f16s) };
        let kinds = vec![TensorKind::grad(dtype); TENSORS];
        let table = DeviceTable::upload(stream, data::table(&[list], &[PER_TENSOR; TENSORS], &kinds)?)?;
        // SAFETY: the table holds this scope's live buffers.
        let seconds = time(stream, || unsafe { kernels.unscale(stream, &table, &mut unscale_scaler) })?;
        rows.push(measure(name, bytes, seconds));
    }

    // Fused AdamW: read grad, master, m, v; write master, m, v (+ the working copy).
    for (mixed, name) in [(false, "fused AdamW, f32 grads"), (true, "fused AdamW, f16 grads + f16 copy")] {
        if start.elapsed() > budget {
            rows.push(Row { item: name.into(), result: "skipped: time budget spent".into(), ok: true });
            continue;
        }
        let (master, m, v) = (buffers::<f32>(stream)?, buffers::<f32>(stream)?, buffers::<f32>(stream)?);
        let grads32 = if mixed { Vec::new() } else { buffers::<f32>(stream)? };
        let (grads16, working) =
            if mixed { (buffers::<f16>(stream)?, buffers::<f16>(stream)?) } else { (Vec::new(), Vec::new()) };
        let grad_list = if mixed { addresses(stream, &grads16) } else { addresses(stream, &grads32) };
        let working_list = if mixed { addresses(stream, &working) } else { vec![0; TENSORS] };
        let lists = vec![
            grad_list,
            addresses(stream, &master),
            addresses(stream, &m),
            addresses(stream, &v),
            vec![0; TENSORS],
            working_list,
            vec![0; TENSORS], // random streams: f32 state draws none
        ];
        let kind = if mixed {
            TensorKind { grad: Dtype::F16, working: Some(Dtype::F16), state: Dtype::F32 }
        } else {
            TensorKind::grad(Dtype::F32)
        };
        let host = data::table(&lists, &[PER_TENSOR; TENSORS], &[kind; TENSORS])?;
        let table = DeviceTable::upload(stream, host.clone())?;
        let steps: CudaSlice<i64> = stream.alloc_zeros(1)?;
        let hp = AdamParams::default();
        let inputs = || OptimizerStep { steps: &steps, scaler: &scaler, factor: GradFactor::InvScale };
        // SAFETY: the table holds this scope's live buffers.
        let seconds = time(stream, || unsafe { kernels.adam(stream, &table, inputs(), &hp) })?;
        // f32: grad 4 + master/m/v 12 read, 12 written. Mixed: grad 2 + 12 read, 12 + copy 2 written.
        let bytes = 28.0;
        rows.push(measure(name, bytes, seconds));
        if !mixed {
            // What the runtime does: gradients are new buffers after every backward, so an optimizer's
            // table is uploaded every step. The measured cost decides between uploaded tables and
            // tables passed as kernel arguments (which would need no upload, but split launches).
            let uploading = time(stream, || {
                let fresh = DeviceTable::upload(stream, host.clone())?;
                // SAFETY: as above, the same addresses.
                unsafe { kernels.adam(stream, &fresh, inputs(), &hp) }
            })?;
            let overhead = uploading / seconds - 1.0;
            rows.push(Row {
                item: "AdamW f32 with its table uploaded every step".into(),
                result: format!(
                    "{:+.1} % time ({} KiB table; goal: under 5 %, else kernel-argument tables)",
                    100.0 * overhead,
                    8 * host.words().len() / 1024
                ),
                ok: overhead < 0.05,
            });
        }
    }
    Ok(rows)
}
