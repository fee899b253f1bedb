//! Mixed precision for models you already have: any model built through candle-nn's `VarBuilder`
//! (your own candle-nn code, or a candle-transformers model) trains under amp without a rewrite.
//!
//! [`AmpVarMap`] takes the place of candle-nn's `VarMap`. Its [`var_builder`](AmpVarMap::var_builder)
//! hands the model half working copies (bf16 or fp16) and keeps an fp32 master for each; the map is an
//! [`AmpModule`], so [`ParamGroups::from_model`](crate::optim::ParamGroups),
//! the fused optimizers, [`GradScaler`](crate::GradScaler), [`checkpoint`](crate::checkpoint) and the
//! precision plan work on it as on any amp model. Checkpoints hold the masters under the model's own
//! names, so candle-nn's `VarMap::load` reads them into an fp32 model.
//!
//! ```
//! use amp_runtime::optim::{AdamConfig, FusedAdamW, ParamGroups};
//! use amp_runtime::scaler::ScalerConfig;
//! use amp_runtime::varmap::AmpVarMap;
//! use amp_runtime::{AmpConfig, GradScaler, OptLevel};
//! use candle_core::{DType, Device, Module, Tensor};
//!
//! # fn main() -> amp_runtime::Result<()> {
//! let device = Device::Cpu;
//! let varmap = AmpVarMap::new(AmpConfig::new(OptLevel::O2, &device)); // bf16 on the CPU
//! let vb = varmap.var_builder(&device);
//! let model = candle_nn::seq() // any candle-nn model, unchanged
//!     .add(candle_nn::linear(8, 16, vb.pp("fc1"))?)
//!     .add(candle_nn::Activation::Relu)
//!     .add(candle_nn::linear(16, 1, vb.pp("fc2"))?);
//! let mut optimizer = FusedAdamW::new(ParamGroups::from_model(&varmap)?, AdamConfig::default())?;
//! let mut scaler = GradScaler::for_model(&varmap, ScalerConfig::default())?;
//! let x = Tensor::ones((4, 8), vb.dtype(), &device)?;
//! let loss = model.forward(&x)?.to_dtype(DType::F32)?.sqr()?.mean_all()?;
//! assert!(scaler.step_fused(&loss, &mut optimizer, None)?.applied());
//! println!("{}", amp_runtime::AmpModuleExt::precision_plan(&varmap));
//! # Ok(()) }
//! ```

mod backend;
mod entry;
mod seeded;

pub use seeded::SeededInit;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use crate::error::{Error, Result};
use crate::{AmpConfig, AmpModule, Cursor, OptLevel, Plan, PlanNode, Visitor, VisitorMut};
use entry::Entry;

/// Decides which parameters stay fp32 (the model then receives an f32 tensor for them): called with
/// the parameter's name and shape.
pub type KeepFp32 = dyn Fn(&str, &[usize]) -> bool + Send + Sync;

/// A `VarMap` for mixed precision: fp32 masters, half working copies handed to the model.
///
/// The precision is fixed when the model is built: a tensor the model holds cannot change its dtype
/// afterwards, so `amp::initialize` on this map refuses any change of storage. Build the model again
/// from another map to train it at another level.
#[derive(Clone)]
pub struct AmpVarMap {
    shared: Arc<Shared>,
}

struct Shared {
    config: AmpConfig,
    keep_fp32: Vec<Arc<KeepFp32>>,
    /// Draws the model's initializers reproducibly; `None`: candle's unseeded generator.
    seed: Option<SeededInit>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Every tensor the model asked for, in the order it asked.
    entries: Vec<Entry>,
    index: HashMap<String, usize>,
    /// Values to start from (pretrained weights, another run's initial weights), by name, until used.
    initial: HashMap<String, Tensor>,
}

impl AmpVarMap {
    /// An empty map for `config`: O2 keeps fp32 masters and hands out `config.half` working copies, O0
    /// hands out fp32 (the baseline, same code path), O3 hands out half parameters without masters.
    /// O1 casts at each use inside amp's own layers, which a candle model's code cannot do: a map for O1
    /// hands out fp32, like O0.
    pub fn new(config: AmpConfig) -> Self {
        let state = Mutex::new(State::default());
        AmpVarMap { shared: Arc::new(Shared { config, keep_fp32: Vec::new(), seed: None, state }) }
    }

    /// The map with initial values: a tensor the model asks for under one of these names starts from
    /// it (converted to f32) instead of the model's initializer. Use it for pretrained weights, or to
    /// start several runs from the same weights.
    pub fn with_initial(self, tensors: impl IntoIterator<Item = (String, Tensor)>) -> Result<Self> {
        self.lock()?.initial.extend(tensors);
        Ok(self)
    }

    /// The map starting from the current values of a candle-nn `VarMap` (of the same model).
    pub fn with_initial_from_varmap(self, varmap: &candle_nn::VarMap) -> Result<Self> {
        let data =
            varmap.data().lock().map_err(|_| Error::Internal { what: "VarMap lock poisoned".into() })?;
        let tensors: Vec<(String, Tensor)> =
            data.iter().map(|(name, var)| (name.clone(), var.as_tensor().detach())).collect();
        drop(data);
        self.with_initial(tensors)
    }

    /// The map with reproducible initial weights: a parameter the model initialises (one without an
    /// initial value) is drawn by [`SeededInit`] from `seed` and its name, under the model's own
    /// initializer, instead of candle's unseeded generator.
    ///
    /// Call it before building the model; a map already shared with a model is refused.
    pub fn with_seed(mut self, seed: u64) -> Result<Self> {
        let shared = Arc::get_mut(&mut self.shared).ok_or_else(|| Error::InvalidVarMapUse {
            reason: "`with_seed` must be called before the map is cloned or handed to a model".into(),
        })?;
        shared.seed = Some(SeededInit::new(seed));
        Ok(self)
    }

    /// The map with a rule that keeps matching parameters fp32 (no half copy: the model receives an
    /// f32 tensor and must compute with it in f32, as a norm that casts its input does). Rules add up.
    ///
    /// Call it before building the model; a map already shared with a model is refused.
    pub fn keep_fp32(
        mut self,
        rule: impl Fn(&str, &[usize]) -> bool + Send + Sync + 'static,
    ) -> Result<Self> {
        let shared = Arc::get_mut(&mut self.shared).ok_or_else(|| Error::InvalidVarMapUse {
            reason: "`keep_fp32` must be called before the map is cloned or handed to a model".into(),
        })?;
        shared.keep_fp32.push(Arc::new(rule));
        Ok(self)
    }

    /// [`keep_fp32`](Self::keep_fp32) for parameters whose name contains one of `patterns`
    /// (`["norm", "ln_"]`).
    pub fn keep_fp32_names(self, patterns: &[&str]) -> Result<Self> {
        let patterns: Vec<String> = patterns.iter().map(|p| p.to_string()).collect();
        self.keep_fp32(move |name, _| patterns.iter().any(|p| name.contains(p.as_str())))
    }

    /// A `VarBuilder` that builds the model's parameters in this map, with the working precision as its
    /// dtype (so that the model's own constants, masks and inputs follow it).
    pub fn var_builder(&self, device: &Device) -> VarBuilder<'static> {
        let backend: Box<dyn candle_nn::var_builder::SimpleBackend> =
            Box::new(backend::Backend(self.clone()));
        VarBuilder::from_backend(backend, self.working_dtype(), device.clone())
    }

    /// The dtype the model's parameters are handed out in (unless a rule keeps them fp32).
    pub fn working_dtype(&self) -> DType {
        match self.shared.config.opt_level {
            OptLevel::O2 | OptLevel::O3 => self.shared.config.half.dtype(),
            OptLevel::O0 | OptLevel::O1 => DType::F32,
        }
    }

    /// The level and half type of the map.
    pub fn config(&self) -> AmpConfig {
        self.shared.config
    }

    /// Names of the parameters and buffers the model asked for, in order.
    pub fn names(&self) -> Result<Vec<String>> {
        Ok(self.lock()?.entries.iter().map(|e| e.name.clone()).collect())
    }

    /// Initial values given with [`with_initial`](Self::with_initial) that the model never asked for
    /// (a misspelt name, or weights of another model).
    pub fn unused_initial(&self) -> Result<Vec<String>> {
        let mut names: Vec<String> = self.lock()?.initial.keys().cloned().collect();
        names.sort();
        Ok(names)
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.shared.state.lock().map_err(|_| Error::Internal { what: "AmpVarMap lock poisoned".into() })
    }

    fn keeps_fp32(&self, name: &str, shape: &[usize]) -> bool {
        self.shared.keep_fp32.iter().any(|rule| rule(name, shape))
    }
}

impl fmt::Debug for AmpVarMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tensors = self.shared.state.lock().map(|s| s.entries.len()).unwrap_or(0);
        f.debug_struct("AmpVarMap")
            .field("config", &self.shared.config)
            .field("keep_fp32_rules", &self.shared.keep_fp32.len())
            .field("tensors", &tensors)
            .finish()
    }
}

impl AmpModule for AmpVarMap {
    type Module = Self;
    const PLAN: Plan = Plan { type_name: "AmpVarMap", node: PlanNode::Struct { default: None, fields: &[] } };

    fn visit(&self, cursor: &mut Cursor, visitor: &mut dyn Visitor) {
        // A poisoned lock means a panic elsewhere already; there is nothing left to visit safely.
        let Ok(state) = self.shared.state.lock() else { return };
        for entry in &state.entries {
            cursor.push(&entry.name, None);
            visitor.visit_layer(cursor.site(), entry);
            cursor.pop();
        }
    }

    fn visit_mut(&mut self, cursor: &mut Cursor, visitor: &mut dyn VisitorMut) {
        let Ok(mut state) = self.shared.state.lock() else { return };
        for entry in &mut state.entries {
            cursor.push(&entry.name, None);
            visitor.visit_layer_mut(cursor.site(), entry);
            cursor.pop();
        }
    }
}
