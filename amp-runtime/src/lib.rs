//! The runtime of amp, re-exported by the `amp` crate: precisions and policies, the [`AmpModule`] trait
//! and its traversal, precision-aware layers ([`nn`]), parameters with fp32 masters, and
//! [`initialize()`].
#![warn(missing_docs)]

mod cast_cache;
pub mod checkpoint;
pub mod cuda;
pub mod dispatch;
pub mod distributed;
pub mod error;
mod gradient_sink;
mod initialize;
mod layer;
mod master;
pub mod memory;
pub mod module;
pub mod nn;
pub mod ops;
pub mod optim;
mod param;
mod passes;
mod policy;
mod precision;
pub mod scaler;
mod storage;
pub mod threads;
pub mod varmap;

pub use cast_cache::CastCache;
pub use error::{Error, Result};
pub use initialize::initialize;
pub use layer::{Layer, LayerPrecision};
pub use master::{grads_to_masters, refresh_working_copies, set_gradient_route};
pub use module::{
    AmpModule, AmpModuleExt, AskFp16, AskWide, Cursor, HalfSafe, Inherit, LayerSite, NoFp16Under, Plan,
    PlanField, PlanNode, PlanRow, PrecisionPlan, Request, Visitor, VisitorMut,
};
pub use param::{GradientRoute, Param, ParamStorage};
pub use policy::{AmpConfig, LossScaling, OptLevel, Policy};
pub use precision::{Precision, PrecisionSpec};
pub use scaler::GradScaler;
