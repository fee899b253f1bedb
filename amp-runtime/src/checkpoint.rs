//! Checkpoints of the fp32 masters, in safetensors with candle-nn's names.
//!
//! A checkpoint holds the source of truth, never the rounded half working copies, so one written under O2
//! loads into an fp32 model and back bit for bit. Loading checks every tensor before it changes any:
//! a checkpoint with a missing, unexpected, mis-shaped or mis-typed tensor is refused whole, with every
//! problem named.
//!
//! An export ([`export`]) is the other kind of file: each weight in the precision its layer computes
//! in, for inference ([`load_export`]); [`load`] refuses it.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::{AmpModule, AmpModuleExt};

mod checksum;
mod durable;
mod inference;

pub use inference::{export, load_export, ExportReport};

/// What is wrong with one tensor of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CheckpointProblem {
    /// The model has this parameter; the checkpoint does not.
    Missing {
        /// Parameter path.
        name: String,
    },
    /// The checkpoint has a tensor the model has no parameter for.
    Unexpected {
        /// Tensor name.
        name: String,
    },
    /// Shapes differ.
    Shape {
        /// Parameter path.
        name: String,
        /// The model's shape.
        expected: Vec<usize>,
        /// The checkpoint's shape.
        found: Vec<usize>,
    },
    /// Dtypes differ.
    DType {
        /// Parameter path.
        name: String,
        /// The model's master dtype.
        expected: DType,
        /// The checkpoint's dtype.
        found: DType,
    },
    /// A tensor holds inf or NaN (refused unless [`LoadOptions::allow_non_finite`]).
    NonFinite {
        /// Tensor name (`amp_state/{key}/...` for a training state's tensor).
        name: String,
        /// How many of its values are not finite.
        count: usize,
        /// How many values it has.
        of: usize,
    },
    /// Finite values that the model's storage for the parameter cannot hold (an O3 model's half
    /// parameters keep no fp32 copy): converted, they would become inf.
    Overflow {
        /// Parameter path.
        name: String,
        /// How many values overflow.
        count: usize,
        /// The parameter's storage dtype.
        dtype: DType,
    },
}

impl fmt::Display for CheckpointProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CheckpointProblem::Missing { name } => write!(f, "`{name}` is missing from the checkpoint"),
            CheckpointProblem::Unexpected { name } => {
                write!(f, "`{name}` is in the checkpoint but the model has no such parameter")
            }
            CheckpointProblem::Shape { name, expected, found } => {
                write!(f, "`{name}` has shape {found:?} in the checkpoint, the model expects {expected:?}")
            }
            CheckpointProblem::DType { name, expected, found } => write!(
                f,
                "`{name}` is {found:?} in the checkpoint, amp checkpoints hold {expected:?} \
                 masters; convert the file to f32 first"
            ),
            CheckpointProblem::NonFinite { name, count, of } => write!(
                f,
                "`{name}` holds {count} non-finite value(s) (inf/NaN) of {of}: the run had diverged when it \
                 was saved; resume from an earlier checkpoint, or load it with \
                 `LoadOptions {{ allow_non_finite: true }}` to inspect it"
            ),
            CheckpointProblem::Overflow { name, count, dtype } => write!(
                f,
                "`{name}` holds {count} value(s) beyond the range of {dtype:?}, the model's storage for it \
                 (no fp32 master): they would become inf; load it into a model with fp32 masters (O2) or \
                 fp32 parameters instead"
            ),
        }
    }
}

/// The problems of a refused checkpoint, one per line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointProblems(pub Vec<CheckpointProblem>);

impl fmt::Display for CheckpointProblems {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for problem in &self.0 {
            write!(f, "\n  - {problem}")?;
        }
        let layout = |p: &CheckpointProblem| {
            matches!(
                p,
                CheckpointProblem::Missing { .. }
                    | CheckpointProblem::Unexpected { .. }
                    | CheckpointProblem::Shape { .. }
            )
        };
        if self.0.iter().any(layout) {
            write!(
                f,
                "\n  the names and shapes are the model's: load the file into the model it was saved from, \
                 built with the same sizes (a renamed field renames its parameters)"
            )?;
        }
        Ok(())
    }
}

/// Prefix of the tensor names and metadata keys that hold training state beside the parameters.
const STATE_PREFIX: &str = "amp_state/";

/// State saved beside the model in a checkpoint: a loss scaler's, an optimizer's.
pub trait TrainingState {
    /// A name unique among the states of one checkpoint (`"scaler"`, `"optimizer"`).
    fn state_key(&self) -> String;
    /// The state as JSON plus named tensors.
    fn save_state(&self) -> Result<SavedState>;
    /// Checks that `state` can be restored into `self`, changing nothing.
    fn check_state(&self, state: &SavedState) -> Result<()>;
    /// Restores a state that passed [`check_state`](Self::check_state).
    fn restore_state(&mut self, state: SavedState) -> Result<()>;
}

/// The saved form of a [`TrainingState`].
#[derive(Clone, Debug, Default)]
pub struct SavedState {
    /// Settings and scalars, as JSON.
    pub json: String,
    /// Named tensors (optimizer moments, ...).
    pub tensors: Vec<(String, Tensor)>,
}

/// Saves every parameter's master under its dotted path, durably: the bytes go to a temporary file
/// beside `path` with a name unique to this save, are flushed to the disk, then renamed over `path`, and
/// the directory is flushed. A save killed at any moment (`kill -9`, a power loss) leaves the previous
/// checkpoint or the new one, whole; two processes saving to one path never mix their bytes.
pub fn save<M: AmpModule + ?Sized>(model: &M, path: impl AsRef<Path>) -> Result<()> {
    save_with(model, &[], path)
}

/// [`save`] plus training states (scaler, optimizer), so that a resumed run continues exactly.
pub fn save_with<M: AmpModule + ?Sized>(
    model: &M,
    states: &[&dyn TrainingState],
    path: impl AsRef<Path>,
) -> Result<()> {
    save_with_masters(model, &HashMap::new(), states, path.as_ref())
}

/// [`save_with`], the masters of the parameters named in `masters` taken from there (ZeRO-1's sharded
/// masters, gathered from their owners) instead of from the model.
pub(crate) fn save_with_masters<M: AmpModule + ?Sized>(
    model: &M,
    masters: &HashMap<String, Tensor>,
    states: &[&dyn TrainingState],
    path: &Path,
) -> Result<()> {
    let mut tensors: Vec<(String, Tensor)> = model
        .named_params()
        .into_iter()
        .map(|(name, p)| {
            let master = masters.get(&name).unwrap_or(p.master().as_tensor());
            Ok((name, master.to_dtype(DType::F32)?))
        })
        .collect::<Result<_>>()?;
    for (name, buffer) in model.named_buffers() {
        tensors.push((name, buffer.as_tensor().to_dtype(DType::F32)?));
    }
    distinct_keys(states.iter().map(|s| s.state_key()))?;
    let mut metadata = HashMap::new();
    for state in states {
        let key = state.state_key();
        let saved = state.save_state()?;
        metadata.insert(format!("{STATE_PREFIX}{key}"), saved.json);
        tensors.extend(saved.tensors.into_iter().map(|(name, t)| (format!("{STATE_PREFIX}{key}/{name}"), t)));
    }
    write_file(path, &tensors, metadata)
}

/// Encodes `tensors` and `metadata` as safetensors with amp's checksums and writes them to `path`
/// durably (a temporary file renamed over it).
fn write_file(path: &Path, tensors: &[(String, Tensor)], metadata: HashMap<String, String>) -> Result<()> {
    let bytes = safetensors::tensor::serialize(tensors.iter().map(|(n, t)| (n.as_str(), t)), Some(metadata))
        .map_err(|source| Error::CheckpointEncode { path: path.to_path_buf(), source })?;
    let bytes = checksum::with_checksum(bytes)?;
    durable::replace_file(path, &bytes).map_err(|source| Error::CheckpointIo {
        path: path.to_path_buf(),
        action: "write",
        source,
    })
}

/// Loads masters saved by [`save`] (or by candle-nn's `VarMap::save` for the same model) and refreshes
/// the half working copies. Nothing changes unless every tensor matches.
pub fn load<M: AmpModule + ?Sized>(model: &mut M, path: impl AsRef<Path>) -> Result<()> {
    load_with(model, &mut [], path)
}

/// [`load`] plus training states saved by [`save_with`]. Everything is checked before anything is
/// changed: the model and every state are restored together or not at all. A checkpoint whose tensors
/// hold inf or NaN is refused, naming them ([`load_with_options`] can load it for inspection).
pub fn load_with<M: AmpModule + ?Sized>(
    model: &mut M,
    states: &mut [&mut dyn TrainingState],
    path: impl AsRef<Path>,
) -> Result<()> {
    load_with_options(model, states, path, LoadOptions::default())
}

/// What [`load_with_options`] accepts beyond a checkpoint that matches the model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Load masters, buffers and state tensors that hold inf or NaN (refused by default): to inspect a
    /// run that diverged, never to resume training from it.
    pub allow_non_finite: bool,
}

/// [`load_with`] with [`LoadOptions`]. A file that is damaged, truncated, not safetensors, or holds
/// tensors or states that do not fit is refused with an error naming the file and the problem; the
/// model and the states are unchanged then.
pub fn load_with_options<M: AmpModule + ?Sized>(
    model: &mut M,
    states: &mut [&mut dyn TrainingState],
    path: impl AsRef<Path>,
    options: LoadOptions,
) -> Result<()> {
    let staged = stage(model, states, path.as_ref(), options, FileKind::Checkpoint)?;
    apply(model, states, staged)
}

/// A checkpoint read and checked against a model and its states, not yet applied to them.
pub(crate) struct Staged {
    tensors: HashMap<String, Tensor>,
    saved: Vec<SavedState>,
}

/// What a load expects `path` to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FileKind {
    /// A checkpoint ([`save_with`]): fp32 masters, maybe training states. An export is refused.
    Checkpoint,
    /// An export ([`export`]) or a checkpoint: parameters in f32, f16 or bf16, no training states.
    Export,
}

/// Reads `path` and checks it against `model` and `states` as [`load_with_options`] does, changing
/// nothing: what [`apply`] then writes (ZeRO-1's ranks all stage before any of them applies).
pub(crate) fn stage<M: AmpModule + ?Sized>(
    model: &M,
    states: &[&mut dyn TrainingState],
    path: &Path,
    options: LoadOptions,
    kind: FileKind,
) -> Result<Staged> {
    distinct_keys(states.iter().map(|s| s.state_key()))?;
    let unreadable = |source: Box<dyn std::error::Error + Send + Sync>| Error::CheckpointUnreadable {
        path: path.to_path_buf(),
        source,
    };
    let bytes = std::fs::read(path).map_err(|source| Error::CheckpointIo {
        path: path.to_path_buf(),
        action: "read",
        source,
    })?;
    let (header_len, header) =
        safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| unreadable(Box::new(e)))?;
    let metadata = header.metadata().clone().unwrap_or_default();
    checksum::verify(&bytes[8 + header_len..], &header, path)?;
    if kind == FileKind::Checkpoint && inference::is_export(&metadata) {
        return Err(Error::CheckpointIsExport { path: path.to_path_buf() });
    }
    // Read and checked in host memory: on a GPU the model and its optimizer state already fill the
    // device, and the checks read every value on the host anyway. Applying copies each tensor over.
    let mut tensors =
        candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).map_err(|e| unreadable(Box::new(e)))?;
    drop(bytes);
    let saved = take_states(states, &metadata, &mut tensors, path)?;

    let mut problems = check(&model.named_params(), &model.named_buffers(), &tensors, kind);
    problems.extend(convert_to_storage(&model.named_params(), &mut tensors)?);
    if !options.allow_non_finite {
        let state_tensors = states.iter().zip(&saved).flat_map(|(state, one)| {
            let key = state.state_key();
            one.tensors.iter().map(move |(name, t)| (format!("{STATE_PREFIX}{key}/{name}"), t))
        });
        let all = tensors.iter().map(|(n, t)| (n.clone(), t)).chain(state_tensors);
        problems.extend(non_finite(all)?);
    }
    if !problems.is_empty() {
        return Err(Error::CheckpointRefused {
            path: path.to_path_buf(),
            problems: CheckpointProblems(problems),
        });
    }
    Ok(Staged { tensors, saved })
}

/// Writes a [`stage`]d checkpoint into the model and the states it was checked against.
pub(crate) fn apply<M: AmpModule + ?Sized>(
    model: &mut M,
    states: &mut [&mut dyn TrainingState],
    Staged { tensors, saved }: Staged,
) -> Result<()> {
    for (name, param) in &model.named_params() {
        // Exact for fp32 masters; for O3 models, which keep no fp32 copy, `stage` rounded the values
        // into their half storage dtype, refusing any that overflow it.
        param.master().set(&tensors[name].to_device(param.master().device())?)?;
        param.refresh_working()?;
    }
    for (name, buffer) in &model.named_buffers() {
        buffer.set(&tensors[name].to_dtype(buffer.dtype())?.to_device(buffer.device())?)?;
    }
    for (state, one) in states.iter_mut().zip(saved) {
        state.restore_state(one)?;
    }
    crate::CastCache::clear();
    Ok(())
}

/// Refuses two states with the same key, or one whose key is a folder of another's (`a`, `a/b`): their
/// JSON or tensors would land on each other's.
fn distinct_keys(keys: impl Iterator<Item = String>) -> Result<()> {
    let keys: Vec<String> = keys.collect();
    let covers =
        |a: &str, b: &str| b.strip_prefix(a).is_some_and(|rest| rest.is_empty() || rest.starts_with('/'));
    for (i, a) in keys.iter().enumerate() {
        if let Some(b) = keys[i + 1..].iter().find(|b| covers(a, b) || covers(b, a)) {
            return Err(Error::CheckpointStateKeys { key: a.min(b).clone() });
        }
    }
    Ok(())
}

/// Moves each state's tensors out of `tensors` and checks each state, changing nothing; every
/// `amp_state/` tensor is removed, whether a state asked for it or not.
fn take_states(
    states: &[&mut dyn TrainingState],
    metadata: &HashMap<String, String>,
    tensors: &mut HashMap<String, Tensor>,
    path: &Path,
) -> Result<Vec<SavedState>> {
    let mut saved = Vec::with_capacity(states.len());
    for state in states.iter() {
        let key = state.state_key();
        let Some(json) = metadata.get(&format!("{STATE_PREFIX}{key}")) else {
            return Err(Error::CheckpointMissingState { path: path.to_path_buf(), key });
        };
        let prefix = format!("{STATE_PREFIX}{key}/");
        let names: Vec<String> = tensors.keys().filter(|n| n.starts_with(&prefix)).cloned().collect();
        let state_tensors =
            names.into_iter().filter_map(|n| tensors.remove(&n).map(|t| (n[prefix.len()..].to_string(), t)));
        let one = SavedState { json: json.clone(), tensors: state_tensors.collect() };
        state.check_state(&one).map_err(|source| Error::CheckpointState {
            path: path.to_path_buf(),
            key,
            source: Box::new(source),
        })?;
        saved.push(one);
    }
    tensors.retain(|name, _| !name.starts_with(STATE_PREFIX));
    Ok(saved)
}

/// A problem for every float tensor that holds inf or NaN, in name order.
fn non_finite<'t>(tensors: impl Iterator<Item = (String, &'t Tensor)>) -> Result<Vec<CheckpointProblem>> {
    let mut problems = Vec::new();
    for (name, tensor) in tensors {
        let flat = tensor.flatten_all()?;
        let count = match tensor.dtype() {
            DType::F64 => flat.to_vec1::<f64>()?.iter().filter(|v| !v.is_finite()).count(),
            DType::F32 | DType::F16 | DType::BF16 => {
                flat.to_dtype(DType::F32)?.to_vec1::<f32>()?.iter().filter(|v| !v.is_finite()).count()
            }
            _ => 0,
        };
        if count > 0 {
            problems.push(CheckpointProblem::NonFinite { name, count, of: tensor.elem_count() });
        }
    }
    problems.sort_by_key(ToString::to_string);
    Ok(problems)
}

/// Converts each parameter's f32 tensor to the dtype the model stores it in (O3: half, no fp32
/// master), so that applying only copies; the values that a conversion turns from finite into inf are
/// problems.
fn convert_to_storage(
    params: &[(String, crate::Param)],
    tensors: &mut HashMap<String, Tensor>,
) -> Result<Vec<CheckpointProblem>> {
    let mut problems = Vec::new();
    for (name, param) in params {
        let dtype = param.master().dtype();
        let Some(tensor) = tensors.get(name) else { continue };
        if tensor.dtype() == dtype || tensor.dims() != param.master().dims() {
            continue;
        }
        let converted = tensor.to_dtype(dtype)?;
        let (before, after) = (finite_flags(tensor)?, finite_flags(&converted)?);
        let count = before.iter().zip(&after).filter(|(was, is)| **was && !**is).count();
        if count > 0 {
            problems.push(CheckpointProblem::Overflow { name: name.clone(), count, dtype });
        }
        tensors.insert(name.clone(), converted);
    }
    Ok(problems)
}

/// Whether each value of a float tensor is finite.
fn finite_flags(tensor: &Tensor) -> Result<Vec<bool>> {
    let values = tensor.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    Ok(values.iter().map(|v| v.is_finite()).collect())
}

fn check(
    params: &[(String, crate::Param)],
    buffers: &[(String, candle_core::Var)],
    tensors: &HashMap<String, Tensor>,
    kind: FileKind,
) -> Vec<CheckpointProblem> {
    let mut problems = Vec::new();
    // An export holds each parameter in the precision its layer computes in; buffers stay f32.
    let accepted = |is_param: bool, dtype: DType| {
        dtype == DType::F32
            || (kind == FileKind::Export && is_param && matches!(dtype, DType::F16 | DType::BF16))
    };
    let expected = params
        .iter()
        .map(|(name, p)| (name, p.master(), true))
        .chain(buffers.iter().map(|(n, b)| (n, b, false)));
    for (name, master, is_param) in expected {
        let Some(tensor) = tensors.get(name) else {
            problems.push(CheckpointProblem::Missing { name: name.clone() });
            continue;
        };
        if tensor.dims() != master.dims() {
            problems.push(CheckpointProblem::Shape {
                name: name.clone(),
                expected: master.dims().to_vec(),
                found: tensor.dims().to_vec(),
            });
        } else if !accepted(is_param, tensor.dtype()) {
            problems.push(CheckpointProblem::DType {
                name: name.clone(),
                expected: DType::F32,
                found: tensor.dtype(),
            });
        }
    }
    let known: BTreeSet<&str> =
        params.iter().map(|(name, _)| name.as_str()).chain(buffers.iter().map(|(n, _)| n.as_str())).collect();
    let mut unexpected: Vec<&String> = tensors.keys().filter(|name| !known.contains(name.as_str())).collect();
    unexpected.sort();
    problems.extend(unexpected.into_iter().map(|name| CheckpointProblem::Unexpected { name: name.clone() }));
    problems
}
