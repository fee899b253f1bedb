//! Helpers of the multi-process training tests: a seeded O2 MLP in fp16 or bf16, its batches, the two
//! fused optimizers behind one type, and the bits of a model's masters.
#![allow(dead_code, clippy::ptr_arg)] // `&Vec<Linear>`: the AmpModule is the Vec, not a slice

pub mod lockstep;

use amp::checkpoint::TrainingState;
use amp::nn::{linear, Linear};
use amp::optim::{AdamConfig, FusedAdamW, FusedLamb, FusedOptimizer, LambConfig, ParamGroups, StateDtype};
use amp::scaler::ScalerConfig;
use amp::{AmpConfig, AmpModuleExt, GradScaler, OptLevel, Precision};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};

/// Layer widths of the test MLP: four linear layers (three of 32 x 32 or close), so that whole-tensor
/// shards balance over two ranks.
pub const WIDTHS: [usize; 5] = [8, 32, 32, 32, 4];

/// An O2 MLP (`WIDTHS`, tanh between layers): fp32 masters uniform in [-1/4, 1/4) from `seed`, working
/// copies in `half`.
pub fn mlp(half: Precision, seed: u64) -> amp::Result<Vec<Linear>> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mut model = WIDTHS
        .windows(2)
        .enumerate()
        .map(|(i, w)| linear(w[0], w[1], vb.pp(format!("l{i}"))))
        .collect::<candle_core::Result<Vec<Linear>>>()?;
    let mut vars: Vec<(String, candle_core::Var)> =
        varmap.data().lock().expect("no other thread holds the map").clone().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (i, (_, var)) in vars.iter().enumerate() {
        var.set(&super::common::uniform_in(seed * 100 + i as u64, var.dims(), -0.25, 0.25, DType::F32)?)?;
    }
    amp::initialize(&mut model, AmpConfig::new(OptLevel::O2, &Device::Cpu).with_half(half))?;
    Ok(model)
}

/// The MLP's output.
pub fn forward(model: &[Linear], x: &Tensor) -> candle_core::Result<Tensor> {
    let mut h = x.clone();
    for (i, layer) in model.iter().enumerate() {
        h = layer.forward(&h)?;
        if i + 1 < model.len() {
            h = h.tanh()?;
        }
    }
    Ok(h)
}

/// Rows `rows` of the 16-row batch of step `step`: smooth, deterministic inputs and targets.
pub fn batch(step: u64, rows: std::ops::Range<usize>) -> candle_core::Result<(Tensor, Tensor)> {
    let (n, inputs, outputs) = (16, WIDTHS[0], WIDTHS[WIDTHS.len() - 1]);
    let x = Tensor::arange(0f32, (n * inputs) as f32, &Device::Cpu)?.reshape((n, inputs))?;
    let x = ((x * 0.37)? + step as f64 * 0.11)?.sin()?;
    let y = (x.sum_keepdim(1)?.cos()? * 0.5)?.broadcast_as((n, outputs))?.contiguous()?;
    Ok((x.narrow(0, rows.start, rows.len())?, y.narrow(0, rows.start, rows.len())?))
}

/// Mean squared error on rows `rows` of step `step`'s batch.
pub fn loss(model: &Vec<Linear>, step: u64, rows: std::ops::Range<usize>) -> candle_core::Result<Tensor> {
    let (x, y) = batch(step, rows)?;
    (forward(model, &x)? - y)?.sqr()?.mean_all()
}

/// The gradients of `loss` for the model's trainable parameters, in model order, as f32.
pub fn gradients(model: &Vec<Linear>, loss: &Tensor) -> amp::Result<Vec<Vec<f32>>> {
    let grads = loss.backward()?;
    model
        .named_params()
        .iter()
        .map(|(path, p)| {
            let g = p
                .grad(path, &grads)?
                .ok_or_else(|| amp::Error::Internal { what: format!("no gradient for {path}") })?;
            Ok(g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
        })
        .collect()
}

/// The fp32 masters, in model order.
pub fn masters(model: &Vec<Linear>) -> amp::Result<Vec<Vec<f32>>> {
    model
        .named_params()
        .iter()
        .map(|(_, p)| Ok(p.master().as_tensor().flatten_all()?.to_vec1::<f32>()?))
        .collect()
}

/// Which fused optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// AdamW, PyTorch's defaults but lr 1e-2.
    AdamW,
    /// LAMB, Apex's defaults but lr 1e-2.
    Lamb,
}

/// The learning rate of both optimizers (large, so that 50 steps move the weights measurably).
pub const LR: f64 = 1e-2;

/// Weight decay of both optimizers (their default).
pub const WEIGHT_DECAY: f64 = 0.01;

/// One of the fused optimizers.
#[derive(Debug)]
pub enum Optimizer {
    /// AdamW.
    AdamW(FusedAdamW),
    /// LAMB.
    Lamb(FusedLamb),
}

impl Optimizer {
    /// `kind` over `groups`.
    pub fn new(kind: Kind, groups: ParamGroups) -> amp::Result<Self> {
        Ok(match kind {
            Kind::AdamW => {
                Optimizer::AdamW(FusedAdamW::new(groups, AdamConfig { lr: LR, ..Default::default() })?)
            }
            Kind::Lamb => {
                Optimizer::Lamb(FusedLamb::new(groups, LambConfig { lr: LR, ..Default::default() })?)
            }
        })
    }

    /// AdamW as [`Kind::AdamW`], its moments in bf16 (`StateDtype::Bf16`).
    pub fn adamw_bf16_moments(groups: ParamGroups) -> amp::Result<Self> {
        let config = AdamConfig { lr: LR, state_dtype: StateDtype::Bf16, ..Default::default() };
        Ok(Optimizer::AdamW(FusedAdamW::new(groups, config)?))
    }

    /// LAMB as [`Kind::Lamb`], its moments in bf16 (`StateDtype::Bf16`).
    pub fn lamb_bf16_moments(groups: ParamGroups) -> amp::Result<Self> {
        let config = LambConfig { lr: LR, state_dtype: StateDtype::Bf16, ..Default::default() };
        Ok(Optimizer::Lamb(FusedLamb::new(groups, config)?))
    }

    /// The optimizer to step.
    pub fn fused(&mut self) -> &mut dyn FusedOptimizer {
        match self {
            Optimizer::AdamW(o) => o,
            Optimizer::Lamb(o) => o,
        }
    }

    /// Its state, for checkpoints.
    pub fn state(&self) -> &dyn TrainingState {
        match self {
            Optimizer::AdamW(o) => o,
            Optimizer::Lamb(o) => o,
        }
    }

    /// Its state, to restore.
    pub fn state_mut(&mut self) -> &mut dyn TrainingState {
        match self {
            Optimizer::AdamW(o) => o,
            Optimizer::Lamb(o) => o,
        }
    }

    /// Bytes of fp32 state it holds.
    pub fn state_bytes(&self) -> usize {
        match self {
            Optimizer::AdamW(o) => o.state_bytes(),
            Optimizer::Lamb(o) => o.state_bytes(),
        }
    }
}

/// The loss scaler of an O2 model in `half`: fp16 gets a dynamic scale that starts at 2^8 and doubles
/// every 10 finite steps (so 50 steps see it grow, and an overflow back it off); bf16 needs none.
pub fn scaler(model: &Vec<Linear>) -> amp::Result<GradScaler> {
    let config = ScalerConfig { init_scale: 256.0, growth_interval: 10, ..Default::default() };
    GradScaler::for_model(model, config)
}

/// `a` and `b` as bits, for bit-identity checks with readable failures.
pub fn same_bits(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()))
}

/// Largest `|a - b|` over every element.
pub fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (f64::from(*p) - f64::from(*q)).abs()))
        .fold(0.0, f64::max)
}
