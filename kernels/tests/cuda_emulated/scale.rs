//! `amp_count_step`, `amp_mark_skipped` and `amp_scale_update` (scale.cu): the optimizers' step counter,
//! the skip reason, and the loss-scale state machine against the host's (`ScaleState::record_step`),
//! bit for bit.

use amp_kernels::cuda::{ScaleChange, ScaleState, NO_BAD_TENSOR, STATE_WORDS};

use crate::common::Rng;
use crate::harness::{emulator, Emulator};
use amp_kernels::scale::ScaleRule;

use crate::launch::Shared;

/// Threads of the one-thread kernels' launches (only thread 0 of block 0 may act).
const FEW_THREADS: u32 = 8;

pub fn count_step(emu: &Emulator, steps: &mut i64, bad: &i32) {
    type Kernel = unsafe extern "C" fn(*mut i64, *const i32);
    let m = emu.module("scale");
    // SAFETY: amp_count_step's signature in scale.cu.
    let kernel: Kernel = unsafe { m.kernel("amp_count_step") };
    let (steps, bad) = (Shared::new(steps), Shared::new(bad));
    m.launch(1, FEW_THREADS, &|| {
        // SAFETY: live borrows; only thread 0 writes.
        unsafe { kernel(steps.get(), bad.get()) }
    });
}

fn mark_skipped(emu: &Emulator, bad: &mut i32, reason: i32) {
    type Kernel = unsafe extern "C" fn(*mut i32, i32);
    let m = emu.module("scale");
    // SAFETY: amp_mark_skipped's signature in scale.cu.
    let kernel: Kernel = unsafe { m.kernel("amp_mark_skipped") };
    let bad = Shared::new(bad);
    m.launch(1, FEW_THREADS, &|| {
        // SAFETY: a live borrow.
        unsafe { kernel(bad.get(), reason) }
    });
}

/// The device scaler state: `amp_scale_state`, whose 64-bit counters need 8-byte alignment.
#[repr(C, align(8))]
struct DeviceState([u32; STATE_WORDS]);

fn scale_update(emu: &Emulator, state: &mut DeviceState, c: &ScaleRule) {
    type Kernel = unsafe extern "C" fn(*mut DeviceState, i32, f32, f32, u32, u32, f32, f32);
    let m = emu.module("scale");
    // SAFETY: amp_scale_update's signature in scale.cu (DeviceState is amp_scale_state's layout).
    let kernel: Kernel = unsafe { m.kernel("amp_scale_update") };
    let state = Shared::new(state);
    let c = *c;
    let dynamic = i32::from(c.dynamic);
    m.launch(1, FEW_THREADS, &|| {
        // SAFETY: a live borrow; only thread 0 writes.
        unsafe {
            kernel(
                state.get(),
                dynamic,
                c.growth_factor,
                c.backoff_factor,
                c.growth_interval,
                c.hysteresis,
                c.min_scale,
                c.max_scale,
            );
        }
    });
}

#[test]
fn count_step_and_mark_skipped() {
    let Some(emu) = emulator() else { return };
    let mut steps = 41i64;
    count_step(emu, &mut steps, &NO_BAD_TENSOR);
    assert_eq!(steps, 42);
    count_step(emu, &mut steps, &0);
    assert_eq!(steps, 42);
    let mut bad = NO_BAD_TENSOR;
    mark_skipped(emu, &mut bad, 9);
    assert_eq!(bad, 9);
    mark_skipped(emu, &mut bad, 12);
    assert_eq!(bad, 9, "the smallest reason wins");
    mark_skipped(emu, &mut bad, 3);
    assert_eq!(bad, 3);
}

#[test]
fn scale_update_matches_the_state_machine() {
    let Some(emu) = emulator() else { return };
    let dynamic = ScaleRule {
        dynamic: true,
        growth_factor: 2.0,
        backoff_factor: 0.5,
        growth_interval: 3,
        hysteresis: 2,
        min_scale: 4096.0,
        max_scale: 1_048_576.0,
    };
    let fixed = ScaleRule { dynamic: false, ..dynamic };
    let mut seen = Vec::new();
    for (seed, p_overflow, config, init, steps) in [
        (10, 0.15, dynamic, 65536.0, 60),
        (11, 0.45, dynamic, 65536.0, 60),
        (12, 0.8, dynamic, 8192.0, 40),
        // Not a power of two: the ceiling is reached by min(grown, max), then growth stops there.
        (13, 0.05, ScaleRule { max_scale: 1e6, ..dynamic }, 300_000.0, 20),
        (14, 0.4, fixed, 65536.0, 20),
    ] {
        let mut rng = Rng(seed);
        let mut host = ScaleState::new(init, config.hysteresis);
        let mut device = DeviceState(host.to_words());
        let mut counter = 0i64;
        let (mut last_reason, mut floor_hits) = (None, 0);
        for step in 0..steps {
            let overflow = rng.unit() < p_overflow;
            if overflow {
                let mut bad = device.0[ScaleState::BAD_TENSOR_WORD] as i32;
                for _ in 0..1 + rng.next_u64() % 2 {
                    let r = (rng.next_u64() % 20) as i32;
                    mark_skipped(emu, &mut bad, r);
                    host.bad_tensor = Some(host.bad_tensor.map_or(r as u32, |x| x.min(r as u32)));
                }
                device.0[ScaleState::BAD_TENSOR_WORD] = bad as u32;
            }
            let reason = host.bad_tensor;
            count_step(emu, &mut counter, &(device.0[ScaleState::BAD_TENSOR_WORD] as i32));
            scale_update(emu, &mut device, &config);
            let change = host.record_step(&config);
            seen.push(change);
            // The report fields, counted here independently of `record_step`.
            last_reason = reason.or(last_reason);
            floor_hits += u32::from(change == ScaleChange::AtFloor);

            let what = format!("seed {seed} step {step} (overflow {overflow}, {change:?})");
            let got = ScaleState::from_words(&device.0).unwrap_or_else(|| panic!("{what}: bad change code"));
            assert_eq!(got.scale.to_bits(), host.scale.to_bits(), "{what}: scale");
            assert_eq!(got, host, "{what}");
            assert_eq!(got.inv_scale.to_bits(), (1.0 / host.scale).to_bits(), "{what}: inv_scale");
            assert_eq!(got.bad_tensor, None, "{what}: the flag is cleared");
            assert_eq!(got.last_bad_tensor, last_reason, "{what}: the most recent skip");
            assert_eq!(got.floor_hits, floor_hits, "{what}: floor_hits");
            assert_eq!(counter, host.applied as i64, "{what}: the optimizer's step counter");
        }
    }
    for change in [
        ScaleChange::Kept,
        ScaleChange::Grew,
        ScaleChange::BackedOff,
        ScaleChange::Tolerated,
        ScaleChange::AtFloor,
    ] {
        assert!(seen.contains(&change), "the sequences never produced {change:?}");
    }
}
