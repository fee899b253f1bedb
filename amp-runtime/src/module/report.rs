//! The run-time precision plan of a model instance: every layer with its compute precision, parameter
//! count and memory.

use std::fmt;

use crate::{Layer, LayerSite, ParamStorage, Precision};

/// One layer of a [`PrecisionPlan`].
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PlanRow {
    /// Dotted path of the layer.
    pub path: String,
    /// Layer type (`"Linear"`).
    pub kind: &'static str,
    /// Precision the layer computes in.
    pub compute: Precision,
    /// How its parameters are stored.
    pub storage: ParamStorage,
    /// Number of parameter values.
    pub params: usize,
    /// Bytes the parameters would take in fp32.
    pub bytes_fp32: usize,
    /// Bytes they take as stored (fp32 master plus half working copy under O2).
    pub bytes_planned: usize,
}

impl PlanRow {
    pub(crate) fn of(site: LayerSite<'_>, layer: &dyn Layer) -> Self {
        let params = layer.params();
        let count: usize = params.iter().map(|(_, p)| p.elem_count()).sum();
        let planned = params.iter().map(|(_, p)| p.elem_count() * p.storage().bytes_per_element()).sum();
        PlanRow {
            path: site.path.to_string(),
            kind: layer.kind(),
            compute: layer.precision().compute,
            storage: params.first().map_or(ParamStorage::Fp32, |(_, p)| p.storage()),
            params: count,
            bytes_fp32: count * 4,
            bytes_planned: planned,
        }
    }
}

/// The precision plan of a model instance, as `AmpModule::precision_plan` returns it. Its `Display` is a
/// table with totals.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct PrecisionPlan {
    /// One row per layer, in declaration order.
    pub rows: Vec<PlanRow>,
    /// Bytes of optimizer state, once an optimizer is accounted with [`PrecisionPlan::with_optimizer_state`].
    pub optimizer_state_bytes: usize,
}

impl PrecisionPlan {
    /// Total parameter values.
    pub fn params(&self) -> usize {
        self.rows.iter().map(|r| r.params).sum()
    }

    /// Total parameter bytes in fp32.
    pub fn bytes_fp32(&self) -> usize {
        self.rows.iter().map(|r| r.bytes_fp32).sum()
    }

    /// Total parameter bytes as stored.
    pub fn bytes_planned(&self) -> usize {
        self.rows.iter().map(|r| r.bytes_planned).sum()
    }

    /// The same plan with `bytes` of optimizer state (`FusedOptimizer::state_bytes`) in its totals.
    pub fn with_optimizer_state(mut self, bytes: usize) -> Self {
        self.optimizer_state_bytes = bytes;
        self
    }

    /// True when some layer computes in fp16 now.
    pub fn computes_in_fp16(&self) -> bool {
        self.rows.iter().any(|r| r.compute == Precision::Fp16)
    }
}

fn storage_label(storage: ParamStorage) -> String {
    match storage {
        ParamStorage::Fp32 => "fp32".into(),
        ParamStorage::MasterAndWorking(p) => format!("fp32 master + {p}"),
        ParamStorage::Half(p) => p.to_string(),
    }
}

impl fmt::Display for PrecisionPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path_width = self.rows.iter().map(|r| r.path.len()).chain([4]).max().unwrap_or(4);
        let header =
            ["path", "layer", "compute", "params stored as", "params", "fp32 bytes", "planned bytes"];
        writeln!(
            f,
            "{:<path_width$}  {:<10}  {:<7}  {:<20}  {:>10}  {:>12}  {:>13}",
            header[0], header[1], header[2], header[3], header[4], header[5], header[6]
        )?;
        for row in &self.rows {
            writeln!(
                f,
                "{:<path_width$}  {:<10}  {:<7}  {:<20}  {:>10}  {:>12}  {:>13}",
                row.path,
                row.kind,
                row.compute,
                storage_label(row.storage),
                row.params,
                row.bytes_fp32,
                row.bytes_planned
            )?;
        }
        let ratio = self.bytes_planned() as f64 / self.bytes_fp32().max(1) as f64;
        if self.optimizer_state_bytes > 0 {
            writeln!(
                f,
                "{:<path_width$}  {:<10}  {:<7}  {:<20}  {:>10}  {:>12}  {:>13}",
                "optimizer state", "", "", "", "", "", self.optimizer_state_bytes
            )?;
        }
        write!(
            f,
            "{:<path_width$}  {:<10}  {:<7}  {:<20}  {:>10}  {:>12}  {:>13}  ({ratio:.2}x of fp32)",
            "total",
            "",
            "",
            "",
            self.params(),
            self.bytes_fp32(),
            self.bytes_planned()
        )
    }
}
