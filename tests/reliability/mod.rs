//! Helpers of the reliability tests: a small fp16 O2 model with seeded weights, its training state,
//! bit-exact snapshots and checksums of that state, and child processes of the test binary itself.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use amp::checkpoint::TrainingState;
use amp::nn::{linear, Linear};
use amp::{AmpConfig, AmpModule, AmpModuleExt, OptLevel, Precision};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};

/// Two linear layers with a tanh between them.
#[derive(AmpModule)]
pub struct Net {
    pub hidden: Linear,
    pub out: Linear,
}

impl Module for Net {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.out.forward(&self.hidden.forward(x)?.tanh()?)
    }
}

/// `inputs -> width -> outputs`, weights uniform in [-1/4, 1/4) from `seed`, fp16 O2 (fp32 masters,
/// fp16 working copies).
pub fn fp16_net(inputs: usize, width: usize, outputs: usize, seed: u64) -> amp::Result<Net> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mut net =
        Net { hidden: linear(inputs, width, vb.pp("hidden"))?, out: linear(width, outputs, vb.pp("out"))? };
    let mut vars: Vec<(String, Var)> =
        varmap.data().lock().expect("no other thread holds the map").clone().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (i, (_, var)) in vars.iter().enumerate() {
        let values = super::common::uniform_in(seed * 100 + i as u64, var.dims(), -0.25, 0.25, DType::F32)?;
        var.set(&values)?;
    }
    amp::initialize(&mut net, AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(Precision::Fp16))?;
    Ok(net)
}

/// The batch of step `step` for a net with `inputs` inputs and `outputs` outputs: smooth, deterministic.
pub fn batch(step: u64, rows: usize, inputs: usize, outputs: usize) -> candle_core::Result<(Tensor, Tensor)> {
    let x = Tensor::arange(0f32, (rows * inputs) as f32, &Device::Cpu)?.reshape((rows, inputs))?;
    let x = ((x * 0.1)? + step as f64 * 0.01)?.sin()?;
    let y = x.sum_keepdim(1)?.cos()?.broadcast_as((rows, outputs))?.contiguous()?;
    Ok((x, y))
}

/// Mean squared error of the net on a batch.
pub fn mse(net: &Net, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    (net.forward(x)? - y)?.sqr()?.mean_all()
}

/// The bits of a tensor's values (as f32: exact for f16 and bf16).
pub fn bits(t: &Tensor) -> Vec<u32> {
    let values = t.to_dtype(DType::F32).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1::<f32>());
    values.map(|v| v.iter().map(|x| x.to_bits()).collect()).expect("a float tensor")
}

/// Every bit of the training state: masters, working copies, and each state's saved form (JSON and
/// tensors), in a fixed order. Two runs are identical when their snapshots are equal.
pub fn snapshot<M: AmpModule + ?Sized>(
    net: &M,
    states: &[&dyn TrainingState],
) -> amp::Result<Vec<(String, Vec<u32>)>> {
    let mut all = Vec::new();
    for (name, p) in net.named_params() {
        all.push((format!("{name} master"), bits(p.master().as_tensor())));
        if let Some(working) = p.working() {
            all.push((format!("{name} working"), bits(working.as_tensor())));
        }
    }
    for (name, buffer) in net.named_buffers() {
        all.push((format!("{name} buffer"), bits(buffer.as_tensor())));
    }
    for state in states {
        let saved = state.save_state()?;
        let key = state.state_key();
        all.push((format!("{key} json"), saved.json.bytes().map(u32::from).collect()));
        for (name, tensor) in saved.tensors {
            all.push((format!("{key}/{name}"), bits(&tensor)));
        }
    }
    Ok(all)
}

/// FNV-1a over a snapshot: a checksum that is the same in every process.
pub fn checksum(snapshot: &[(String, Vec<u32>)]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for byte in bytes {
            hash = (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    for (name, values) in snapshot {
        eat(name.as_bytes());
        for value in values {
            eat(&value.to_le_bytes());
        }
    }
    hash
}

/// The test binary run again with only the test `entry` (which must return at once unless `env` is
/// set), with `env` set, its stdout piped.
pub fn spawn_self(entry: &str, env: &[(&str, &str)]) -> std::io::Result<Child> {
    let mut command = Command::new(std::env::current_exe()?);
    command.args(["--exact", entry, "--nocapture", "--test-threads=1"]);
    for (key, value) in env {
        command.env(key, value);
    }
    command.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn()
}

/// Reads a child's stdout until a line that ends with `marker` (libtest may print the test's name
/// before it on the same line); false when the stream ended first or nothing came within `timeout`.
pub fn wait_for_line(child: &mut Child, marker: &str, timeout: std::time::Duration) -> bool {
    let Some(stdout) = child.stdout.take() else { return false };
    let (found, seen) = std::sync::mpsc::channel();
    let marker = marker.to_string();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        loop {
            line.clear();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => return found.send(false),
                Ok(_) if line.trim_end().ends_with(&marker) => return found.send(true),
                Ok(_) => {}
            }
        }
    });
    seen.recv_timeout(timeout).unwrap_or(false)
}

/// A fresh empty directory under the system's temporary directory.
pub fn fresh_dir(name: &str) -> std::io::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("amp-{name}-{}", std::process::id()));
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// The lines of a file (empty when it does not exist).
pub fn read_lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path).map(|s| s.lines().map(str::to_string).collect()).unwrap_or_default()
}

/// The result of a reliability test or helper: any error (amp's, I/O, JSON).
pub type Outcome<T = ()> = Result<T, Box<dyn std::error::Error>>;
