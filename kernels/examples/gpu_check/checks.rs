//! Every kernel against the CPU reference (amp_kernels::reference), on mixed-dtype launches.

use std::sync::Arc;

use amp_kernels::cuda::{
    CudaError, CudaKernels, DeviceScaler, DeviceTable, GradFactor, LambBuffers, NormBuffers, OptimizerStep,
    ScaleState, TensorKind,
};
use amp_kernels::optim::{AdamParams, AdamTensor, LambParams, LambTensor, SgdParams, SgdTensor, TensorNorms};
use amp_kernels::scale::ScaleRule;
use amp_kernels::{reference, Dtype, GradSliceMut};
use cudarc::driver::{CudaSlice, CudaStream};

use crate::data::{self, address_f32, grad_dtype, working_dtype, DeviceTensor, HostTensor, Rng, SIZES};
use crate::Row;

type Result<T> = std::result::Result<T, CudaError>;

/// Largest distance in units in the last place between two f32 vectors (NaNs equal to NaNs).
fn max_ulps(a: &[f32], b: &[f32]) -> u32 {
    let key = |x: f32| {
        let bits = x.to_bits() as i32;
        if bits < 0 {
            i32::MIN - bits
        } else {
            bits
        }
    };
    a.iter()
        .zip(b)
        .map(|(&x, &y)| if x.is_nan() && y.is_nan() { 0 } else { key(x).abs_diff(key(y)) })
        .max()
        .unwrap_or(0)
}

fn ulps_of(a: &HostTensor, b: &HostTensor) -> u32 {
    let widen =
        |t: &HostTensor| -> Vec<f32> { (0..t.len()).map(|i| reference::get(t.as_slice(), i)).collect() };
    if a.dtype() != b.dtype() || a.len() != b.len() {
        return u32::MAX;
    }
    max_ulps(&widen(a), &widen(b))
}

fn row(item: &str, worst: u32, allowed: u32, extra: &str) -> Row {
    Row {
        item: item.into(),
        result: format!("max {worst} ulp from the CPU reference (allowed {allowed}){extra}"),
        ok: worst <= allowed,
    }
}

fn grads(rng: &mut Rng, scale: f32) -> Vec<HostTensor> {
    SIZES.iter().enumerate().map(|(t, &n)| HostTensor::from_f32(&rng.vec(n, scale), grad_dtype(t))).collect()
}

fn upload_all(stream: &Arc<CudaStream>, hosts: &[HostTensor]) -> Result<Vec<DeviceTensor>> {
    hosts.iter().map(|h| DeviceTensor::upload(stream, h)).collect()
}

fn upload_f32(stream: &Arc<CudaStream>, hosts: &[Vec<f32>]) -> Result<Vec<CudaSlice<f32>>> {
    hosts.iter().map(|h| Ok(stream.clone_htod(h)?)).collect()
}

fn kinds(with_working: bool) -> Vec<TensorKind> {
    (0..SIZES.len())
        .map(|t| TensorKind {
            grad: grad_dtype(t),
            working: working_dtype(t).filter(|_| with_working),
            state: Dtype::F32,
        })
        .collect()
}

pub fn run_all(kernels: &CudaKernels, stream: &Arc<CudaStream>) -> Result<Vec<Row>> {
    Ok(vec![
        unscale(kernels, stream)?,
        global_norm(kernels, stream)?,
        adam(kernels, stream, false)?,
        adam(kernels, stream, true)?,
        sgd(kernels, stream)?,
        lamb(kernels, stream)?,
        skipped_step(kernels, stream)?,
        scale_machine(kernels, stream)?,
    ])
}

fn unscale(kernels: &CudaKernels, stream: &Arc<CudaStream>) -> Result<Row> {
    let mut rng = Rng::new(1);
    let mut host = grads(&mut rng, 3000.0);
    // A value that overflows only once rounded to f16 after unscaling... and a NaN in tensor 4.
    if let HostTensor::Bf16(v) = &mut host[5] {
        v[2] = half::bf16::from_f32(f32::INFINITY);
    }
    if let HostTensor::F16(v) = &mut host[4] {
        v[7] = half::f16::NAN;
    }
    let device = upload_all(stream, &host)?;
    let lens: Vec<usize> = host.iter().map(HostTensor::len).collect();
    let addresses = device.iter().map(|d| d.address(stream)).collect();
    let table = DeviceTable::upload(stream, data::table(&[addresses], &lens, &kinds(false))?)?;
    let mut scaler = DeviceScaler::new(stream, &ScaleState::new(0.125, 1))?; // inv_scale 8: grows values
                                                                             // SAFETY: the table holds the live buffers of `device`, in the recorded dtypes and lengths.
    unsafe { kernels.unscale(stream, &table, &mut scaler)? };
    let state = scaler.read(stream)?;
    let mut want: Vec<GradSliceMut<'_>> = host.iter_mut().map(HostTensor::as_mut).collect();
    let want_bad = reference::unscale_and_check(&mut want, 8.0);
    let worst = device
        .iter()
        .zip(&host)
        .map(|(d, h)| Ok(ulps_of(&d.download(stream)?, h)))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .max()
        .unwrap_or(0);
    let flag_ok = state.bad_tensor.map(|t| t as usize) == want_bad;
    let mut r = row(
        "unscale, f32/f16/bf16 in one launch",
        if flag_ok { worst } else { u32::MAX },
        0,
        &format!("; first bad tensor {:?} (want {want_bad:?})", state.bad_tensor),
    );
    r.ok &= flag_ok;
    Ok(r)
}

fn global_norm(kernels: &CudaKernels, stream: &Arc<CudaStream>) -> Result<Row> {
    let mut rng = Rng::new(2);
    let host = grads(&mut rng, 100.0);
    let device = upload_all(stream, &host)?;
    let lens: Vec<usize> = host.iter().map(HostTensor::len).collect();
    let addresses = device.iter().map(|d| d.address(stream)).collect();
    let table = DeviceTable::upload(stream, data::table(&[addresses], &lens, &kinds(false))?)?;
    let mut scaler = DeviceScaler::new(stream, &ScaleState::new(1024.0, 1))?;
    let mut norms = NormBuffers::new(stream, &table)?;
    let max_norm = 0.5;
    // SAFETY: as in `unscale` (read only).
    unsafe { kernels.global_norm(stream, &table, &mut scaler, Some(max_norm), &mut norms)? };
    let (norm, factor) = norms.read(stream)?;
    let per_tensor = norms.read_per_tensor(stream, lens.len())?;
    let slices: Vec<_> = host.iter().map(HostTensor::as_slice).collect();
    let mut want_per = vec![0.0; lens.len()];
    let want = reference::l2_norms(&slices, 1.0 / 1024.0, &mut want_per);
    let want_factor = (1.0 / 1024.0) * amp_kernels::clip::clip_coefficient(want, max_norm);
    let worst = max_ulps(&[norm, factor], &[want, want_factor]).max(max_ulps(&per_tensor, &want_per));
    let skipped = scaler.read(stream)?.bad_tensor.is_some();
    let mut r = row("global L2 norm + clip factor (deterministic)", worst, 1, &format!("; norm {norm}"));
    r.ok &= !skipped;
    Ok(r)
}

/// Host and device copies of an optimizer's parameters.
struct Params {
    grads: Vec<HostTensor>,
    master: Vec<Vec<f32>>,
    working: Vec<Option<HostTensor>>,
    d_grads: Vec<DeviceTensor>,
    d_master: Vec<CudaSlice<f32>>,
    d_working: Vec<Option<DeviceTensor>>,
}

impl Params {
    fn new(stream: &Arc<CudaStream>, seed: u64, grad_scale: f32) -> Result<Self> {
        let mut rng = Rng::new(seed);
        let grads = grads(&mut rng, grad_scale);
        let master: Vec<Vec<f32>> = SIZES.iter().map(|&n| rng.vec(n, 1.0)).collect();
        let working: Vec<Option<HostTensor>> =
            (0..SIZES.len()).map(|t| working_dtype(t).map(|d| HostTensor::from_f32(&master[t], d))).collect();
        Ok(Params {
            d_grads: upload_all(stream, &grads)?,
            d_master: upload_f32(stream, &master)?,
            d_working: working
                .iter()
                .map(|w| w.as_ref().map(|w| DeviceTensor::upload(stream, w)).transpose())
                .collect::<Result<_>>()?,
            grads,
            master,
            working,
        })
    }

    fn grad_addresses(&self, stream: &Arc<CudaStream>) -> Vec<u64> {
        self.d_grads.iter().map(|d| d.address(stream)).collect()
    }

    fn master_addresses(&self, stream: &Arc<CudaStream>) -> Vec<u64> {
        self.d_master.iter().map(|d| address_f32(stream, d)).collect()
    }

    fn working_addresses(&self, stream: &Arc<CudaStream>) -> Vec<u64> {
        self.d_working.iter().map(|w| w.as_ref().map_or(0, |w| w.address(stream))).collect()
    }

    /// Worst ulp distance of masters and working copies from the host.
    fn compare(&self, stream: &Arc<CudaStream>) -> Result<u32> {
        let mut worst = 0;
        for (d, h) in self.d_master.iter().zip(&self.master) {
            worst = worst.max(max_ulps(&stream.clone_dtoh(d)?, h));
        }
        for (d, h) in self.d_working.iter().zip(&self.working) {
            if let (Some(d), Some(h)) = (d, h) {
                worst = worst.max(ulps_of(&d.download(stream)?, h));
            }
        }
        Ok(worst)
    }
}

fn state_ulps(stream: &Arc<CudaStream>, device: &[CudaSlice<f32>], host: &[Vec<f32>]) -> Result<u32> {
    let mut worst = 0;
    for (d, h) in device.iter().zip(host) {
        worst = worst.max(max_ulps(&stream.clone_dtoh(d)?, h));
    }
    Ok(worst)
}

/// Host vectors and their device copies.
type Mirrored = (Vec<Vec<f32>>, Vec<CudaSlice<f32>>);

fn zeros(stream: &Arc<CudaStream>) -> Result<Mirrored> {
    let host: Vec<Vec<f32>> = SIZES.iter().map(|&n| vec![0.0; n]).collect();
    let device = upload_f32(stream, &host)?;
    Ok((host, device))
}

/// The optimizer tables' stream list for f32 state (which draws no random bits).
fn no_streams() -> Vec<u64> {
    vec![0; SIZES.len()]
}

fn addresses_f32(stream: &Arc<CudaStream>, slices: &[CudaSlice<f32>]) -> Vec<u64> {
    slices.iter().map(|s| address_f32(stream, s)).collect()
}

fn adam(kernels: &CudaKernels, stream: &Arc<CudaStream>, amsgrad_l2: bool) -> Result<Row> {
    let scale = 1024.0f32;
    let mut p = Params::new(stream, 3, scale)?;
    let (mut m, d_m) = zeros(stream)?;
    let (mut v, d_v) = zeros(stream)?;
    let (mut vmax, d_vmax) = zeros(stream)?;
    let vmax_addresses = if amsgrad_l2 { addresses_f32(stream, &d_vmax) } else { vec![0; SIZES.len()] };
    let lists = vec![
        p.grad_addresses(stream),
        p.master_addresses(stream),
        addresses_f32(stream, &d_m),
        addresses_f32(stream, &d_v),
        vmax_addresses,
        p.working_addresses(stream),
        no_streams(),
    ];
    let table = DeviceTable::upload(stream, data::table(&lists, &SIZES, &kinds(true))?)?;
    let scaler = DeviceScaler::new(stream, &ScaleState::new(scale, 1))?;
    let mut steps: CudaSlice<i64> = stream.alloc_zeros(1)?;
    let mut hp = AdamParams { lr: 1e-2, weight_decay: 0.1, ..AdamParams::default() };
    if amsgrad_l2 {
        hp = AdamParams { decoupled_weight_decay: false, amsgrad: true, ..hp };
    }
    for step in 1..=3 {
        let inputs = OptimizerStep { steps: &steps, scaler: &scaler, factor: GradFactor::InvScale };
        // SAFETY: every address in the table is a live buffer of this check, of the recorded type.
        unsafe { kernels.adam(stream, &table, inputs, &hp)? };
        kernels.count_step(stream, &mut steps, &scaler)?;
        let hp = AdamParams { step, ..hp };
        let mut tensors: Vec<AdamTensor<'_>> = Vec::new();
        for ((((master, grad), (m, v)), vmax), working) in p
            .master
            .iter_mut()
            .zip(&p.grads)
            .zip(m.iter_mut().zip(v.iter_mut()))
            .zip(vmax.iter_mut())
            .zip(p.working.iter_mut())
        {
            let mut t = AdamTensor::new(master, grad.as_slice(), m, v);
            if hp.amsgrad {
                t = t.with_max_exp_avg_sq(vmax);
            }
            t.working = working.as_mut().and_then(HostTensor::as_half_mut);
            tensors.push(t);
        }
        reference::adam_step(&mut tensors, &hp, 1.0 / scale);
    }
    let counted = stream.clone_dtoh(&steps)?[0];
    let worst = p.compare(stream)?.max(state_ulps(stream, &d_m, &m)?).max(state_ulps(stream, &d_v, &v)?);
    let worst = if amsgrad_l2 { worst.max(state_ulps(stream, &d_vmax, &vmax)?) } else { worst };
    // Bias correction uses the device's pow(); the CPU's may differ by an ulp before rounding to f32.
    let name =
        if amsgrad_l2 { "Adam (L2 decay, AMSGrad), 3 steps" } else { "AdamW + working copies, 3 steps" };
    let mut r = row(name, worst, 1, &format!("; device step count {counted}"));
    r.ok &= counted == 3;
    Ok(r)
}

fn sgd(kernels: &CudaKernels, stream: &Arc<CudaStream>) -> Result<Row> {
    let scale = 256.0f32;
    let mut p = Params::new(stream, 4, scale)?;
    let (mut buf, d_buf) = zeros(stream)?;
    let lists = vec![
        p.grad_addresses(stream),
        p.master_addresses(stream),
        addresses_f32(stream, &d_buf),
        p.working_addresses(stream),
        no_streams(),
    ];
    let table = DeviceTable::upload(stream, data::table(&lists, &SIZES, &kinds(true))?)?;
    let scaler = DeviceScaler::new(stream, &ScaleState::new(scale, 1))?;
    let mut steps: CudaSlice<i64> = stream.alloc_zeros(1)?;
    let hp =
        SgdParams { lr: 0.05, momentum: 0.9, dampening: 0.1, weight_decay: 1e-3, ..SgdParams::default() };
    for step in 0..3 {
        let inputs = OptimizerStep { steps: &steps, scaler: &scaler, factor: GradFactor::InvScale };
        // SAFETY: as in `adam`.
        unsafe { kernels.sgd(stream, &table, inputs, &hp)? };
        kernels.count_step(stream, &mut steps, &scaler)?;
        let hp = SgdParams { first_step: step == 0, ..hp };
        let mut tensors: Vec<SgdTensor<'_>> = Vec::new();
        for (((master, grad), buf), working) in
            p.master.iter_mut().zip(&p.grads).zip(buf.iter_mut()).zip(p.working.iter_mut())
        {
            tensors.push(SgdTensor {
                master,
                grad: grad.as_slice(),
                momentum_buffer: Some(buf),
                working: working.as_mut().and_then(HostTensor::as_half_mut),
            });
        }
        reference::sgd_step(&mut tensors, &hp, 1.0 / scale);
    }
    let worst = p.compare(stream)?.max(state_ulps(stream, &d_buf, &buf)?);
    Ok(row("SGD (momentum, dampening, L2), 3 steps", worst, 0, ""))
}

fn lamb(kernels: &CudaKernels, stream: &Arc<CudaStream>) -> Result<Row> {
    let scale = 4096.0f32;
    let mut p = Params::new(stream, 5, scale)?;
    let (mut m, d_m) = zeros(stream)?;
    let (mut v, d_v) = zeros(stream)?;
    let lists = vec![
        p.grad_addresses(stream),
        p.master_addresses(stream),
        addresses_f32(stream, &d_m),
        addresses_f32(stream, &d_v),
        p.working_addresses(stream),
        no_streams(),
    ];
    let table = DeviceTable::upload(stream, data::table(&lists, &SIZES, &kinds(true))?)?;
    let scaler = DeviceScaler::new(stream, &ScaleState::new(scale, 1))?;
    let mut steps: CudaSlice<i64> = stream.alloc_zeros(1)?;
    let mut scratch = LambBuffers::new(stream, &table)?;
    let hp = LambParams { lr: 1e-2, ..LambParams::default() };
    let mut norms = vec![TensorNorms::default(); SIZES.len()];
    for step in 1..=2 {
        let inputs = OptimizerStep { steps: &steps, scaler: &scaler, factor: GradFactor::InvScale };
        // SAFETY: as in `adam`.
        unsafe { kernels.lamb(stream, &table, inputs, &hp, &mut scratch)? };
        kernels.count_step(stream, &mut steps, &scaler)?;
        let hp = LambParams { step, ..hp };
        let mut tensors: Vec<LambTensor<'_>> = Vec::new();
        for (((master, grad), (m, v)), working) in
            p.master.iter_mut().zip(&p.grads).zip(m.iter_mut().zip(v.iter_mut())).zip(p.working.iter_mut())
        {
            tensors.push(LambTensor {
                master,
                grad: grad.as_slice(),
                exp_avg: m,
                exp_avg_sq: v,
                working: working.as_mut().and_then(HostTensor::as_half_mut),
            });
        }
        reference::lamb_step(&mut tensors, &hp, 1.0 / scale, &mut norms);
    }
    let device_norms = scratch.read_norms(stream, SIZES.len())?;
    let (dp, dn): (Vec<f32>, Vec<f32>) = device_norms.into_iter().unzip();
    let (hp_norms, hu_norms): (Vec<f32>, Vec<f32>) = norms.iter().map(|n| (n.param, n.update)).unzip();
    let norm_ulps = max_ulps(&dp, &hp_norms).max(max_ulps(&dn, &hu_norms));
    // Norms are f64 sums in a different order (<= 1 ulp); the trust ratio carries that ulp into the step.
    let worst = p.compare(stream)?.max(state_ulps(stream, &d_m, &m)?).max(state_ulps(stream, &d_v, &v)?);
    let mut r = row("LAMB (3 launches), 2 steps", worst, 4, &format!("; norms within {norm_ulps} ulp"));
    r.ok &= norm_ulps <= 1;
    Ok(r)
}

fn skipped_step(kernels: &CudaKernels, stream: &Arc<CudaStream>) -> Result<Row> {
    let scale = 65536.0f32;
    let p = Params::new(stream, 6, scale)?;
    let (m, d_m) = zeros(stream)?;
    let (_, d_v) = zeros(stream)?;
    let lists = vec![
        p.grad_addresses(stream),
        p.master_addresses(stream),
        addresses_f32(stream, &d_m),
        addresses_f32(stream, &d_v),
        vec![0; SIZES.len()],
        p.working_addresses(stream),
        no_streams(),
    ];
    let table = DeviceTable::upload(stream, data::table(&lists, &SIZES, &kinds(true))?)?;
    let mut scaler = DeviceScaler::new(stream, &ScaleState::new(scale, 1))?;
    let mut steps: CudaSlice<i64> = stream.alloc_zeros(1)?;
    kernels.mark_skipped(stream, &mut scaler, 2)?;
    let inputs = OptimizerStep { steps: &steps, scaler: &scaler, factor: GradFactor::InvScale };
    // SAFETY: as in `adam`.
    unsafe { kernels.adam(stream, &table, inputs, &AdamParams::default())? };
    kernels.count_step(stream, &mut steps, &scaler)?;
    let config = ScaleRule {
        dynamic: true,
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval: 2000,
        hysteresis: 1,
        min_scale: 1.0,
        max_scale: 16_777_216.0,
    };
    kernels.scale_update(stream, &mut scaler, &config)?;
    let state = scaler.read(stream)?;
    let unchanged =
        p.compare(stream)? == 0 && state_ulps(stream, &d_m, &m)? == 0 && stream.clone_dtoh(&steps)?[0] == 0;
    let ok = unchanged
        && state.skipped == 1
        && state.scale == scale / 2.0
        && state.last_bad_tensor == Some(2)
        && state.bad_tensor.is_none();
    Ok(Row {
        item: "skipped step: nothing written, scale backs off".into(),
        result: format!("masters/copies bit-identical: {unchanged}; scale {} -> {}", scale, state.scale),
        ok,
    })
}

/// The scale's state machine on the device against the host's (`ScaleState::record_step`).
fn scale_machine(kernels: &CudaKernels, stream: &Arc<CudaStream>) -> Result<Row> {
    let config = ScaleRule {
        dynamic: true,
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval: 3,
        hysteresis: 2,
        min_scale: 1.0,
        max_scale: 1024.0,
    };
    let mut host = ScaleState::new(128.0, config.hysteresis);
    let mut scaler = DeviceScaler::new(stream, &host)?;
    let mut rng = Rng::new(7);
    let mut mismatches = 0;
    for step in 0..200 {
        let overflow = rng.uniform() < -0.6 || (60..80).contains(&step);
        if overflow {
            kernels.mark_skipped(stream, &mut scaler, 0)?;
        }
        kernels.scale_update(stream, &mut scaler, &config)?;
        host.bad_tensor = overflow.then_some(0);
        host.record_step(&config);
        if scaler.read(stream)? != host {
            mismatches += 1;
        }
    }
    Ok(Row {
        item: "scale state machine, 200 random steps".into(),
        result: format!("{mismatches} steps differ from the host machine; final scale {}", host.scale),
        ok: mismatches == 0,
    })
}
