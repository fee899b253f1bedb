//! ZeRO-1 checkpoints: one file, in [`crate::checkpoint`]'s format, that loads on any world size.
//!
//! Saving gathers every rank's optimizer state (each rank broadcasts its serialized
//! [`SavedState`] in turn) into the state an unsharded optimizer over the whole model would save: the
//! same settings JSON, one tensor per state buffer and parameter. Rank 0 writes it with
//! [`checkpoint::save_with`](crate::checkpoint::save_with); the masters every rank keeps are the same
//! on every rank after a ZeRO-1 step, and sharded masters ([`Zero1::shard_masters`]) are gathered from
//! their owners first, so the file is the same either way. Loading needs no exchange: every rank reads the
//! file with [`checkpoint::load_with`](crate::checkpoint::load_with) and its optimizer, built from
//! [`Zero1::local_groups`], restores the entries of the tensors it owns and ignores the others'. So the
//! file loads into a plain optimizer on one process, or into ZeRO-1 on any number of ranks.

use std::path::Path;

use candle_core::{DType, Device, Tensor};

use super::data_parallel::agree_non_finite;
use super::zero::Zero1;
use crate::checkpoint::{SavedState, TrainingState};
use crate::error::{Error, Result};
use crate::AmpModule;

/// A saved optimizer state's JSON as its settings (every rank's alike) and its `group_of` map (each
/// parameter's group: a rank's own parameters only).
fn split_group_of(json: &str) -> Result<(serde_json::Value, serde_json::Map<String, serde_json::Value>)> {
    let mut settings: serde_json::Value = serde_json::from_str(json)
        .map_err(|e| Error::Internal { what: format!("an optimizer's saved settings: {e}") })?;
    let group_of = match settings.as_object_mut().and_then(|fields| fields.remove("group_of")) {
        Some(serde_json::Value::Object(map)) => map,
        _ => serde_json::Map::new(),
    };
    Ok((settings, group_of))
}

impl Zero1<'_> {
    /// The whole optimizer state, as an unsharded optimizer over every parameter would save it, on every
    /// rank: each rank's `optimizer` (its shard) saved and broadcast in turn, tensors sorted by name. A
    /// collective: every rank calls it.
    ///
    /// # Errors
    /// [`Error::ZeroShard`] when the ranks' optimizers have different settings or step counts; those of
    /// `save_state` and of the communicator.
    pub fn gather_state(&self, optimizer: &dyn TrainingState) -> Result<SavedState> {
        let comm = self.communicator();
        let mine = optimizer.save_state()?;
        let (mut whole, mut settings, mut group_of) = (SavedState::default(), None, serde_json::Map::new());
        for root in 0..comm.world_size() {
            let state = if root == comm.rank() {
                broadcast_vec(comm, encode(&mine)?, root)?;
                mine.clone()
            } else {
                decode(&broadcast_vec(comm, Vec::new(), root)?)?
            };
            // Every rank's settings alike; each rank's parameters' groups, merged.
            let (rank_settings, rank_groups) = split_group_of(&state.json)?;
            match &settings {
                None => settings = Some(rank_settings),
                Some(first) if *first != rank_settings => {
                    return Err(Error::ZeroShard {
                        reason: format!(
                            "rank {root}'s optimizer settings or step count differ from rank 0's ({rank_settings} vs \
                             {first}): every rank must build the same optimizer and step it with \
                             `Zero1::step_fused`"
                        ),
                    });
                }
                Some(_) => {}
            }
            group_of.extend(rank_groups);
            whole.tensors.extend(state.tensors);
        }
        let mut settings = settings.unwrap_or_default();
        if let serde_json::Value::Object(fields) = &mut settings {
            fields.insert("group_of".into(), serde_json::Value::Object(group_of));
        }
        whole.json = settings.to_string();
        whole.tensors.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(whole)
    }

    /// Saves one checkpoint of the whole run to `path`: the model, the gathered optimizer state
    /// ([`gather_state`](Self::gather_state)) under `optimizer`'s key, and `others` (states every rank
    /// holds alike, such as the loss scaler), written by rank 0 with
    /// [`checkpoint::save_with`](crate::checkpoint::save_with). A collective; returns on every rank once
    /// the file is written. Load it with [`load_checkpoint`](Self::load_checkpoint) on any number of
    /// ranks, or with `checkpoint::load_with` and a plain optimizer on one process.
    ///
    /// # Errors
    /// Rank 0's write error on rank 0, and [`Error::ZeroShard`] naming it on the others; those of
    /// [`gather_state`](Self::gather_state).
    pub fn save_checkpoint<M: AmpModule + ?Sized>(
        &self,
        model: &M,
        optimizer: &dyn TrainingState,
        others: &[&dyn TrainingState],
        path: impl AsRef<Path>,
    ) -> Result<()> {
        let comm = self.communicator();
        let gathered = Gathered { key: optimizer.state_key(), state: self.gather_state(optimizer)? };
        // Sharded masters (`shard_masters`) come from their owners; the others are rank 0's own.
        let masters = self.gathered_masters()?;
        let written = if comm.rank() == 0 {
            let mut states: Vec<&dyn TrainingState> = vec![&gathered];
            states.extend_from_slice(others);
            crate::checkpoint::save_with_masters(model, &masters, &states, path.as_ref())
        } else {
            Ok(())
        };
        match (agree_non_finite(comm, written.is_err())?, written) {
            (None, written) => written,
            (Some(_), Err(e)) => Err(e),
            (Some(rank), Ok(())) => Err(Error::ZeroShard {
                reason: format!(
                    "rank {rank} could not write {}: its error says why",
                    path.as_ref().display()
                ),
            }),
        }
    }

    /// Loads a checkpoint written by [`save_checkpoint`](Self::save_checkpoint) (by any number of ranks)
    /// on every rank, with [`checkpoint::load_with`](crate::checkpoint::load_with): `model` and `states`,
    /// among them this rank's optimizer (built from [`local_groups`](Self::local_groups): it takes the
    /// entries of the tensors it owns and leaves the others'). A collective: every rank reads and checks
    /// the file, and only when all of them can load it does any change its model and states; otherwise
    /// all fail with nothing changed.
    ///
    /// # Errors
    /// The load error on the ranks that failed, and [`Error::ZeroShard`] naming the lowest on the others.
    pub fn load_checkpoint<M: AmpModule + ?Sized>(
        &self,
        model: &mut M,
        states: &mut [&mut dyn TrainingState],
        path: impl AsRef<Path>,
    ) -> Result<()> {
        // Every rank reads and checks the file first (its optimizer checks the tensors it owns); only
        // when all of them can load it does any of them change its model and states.
        let options = crate::checkpoint::LoadOptions::default();
        let staged = crate::checkpoint::stage(
            model,
            states,
            path.as_ref(),
            options,
            crate::checkpoint::FileKind::Checkpoint,
        );
        match (agree_non_finite(self.communicator(), staged.is_err())?, staged) {
            (None, Ok(staged)) => crate::checkpoint::apply(model, states, staged),
            (_, Err(e)) => Err(e),
            (Some(rank), Ok(_)) => Err(Error::ZeroShard {
                reason: format!(
                    "rank {rank} could not load {}: its error says why (every rank must reach the file); \
                     nothing was changed on any rank",
                    path.as_ref().display()
                ),
            }),
        }
    }
}

/// A gathered optimizer state handed to `save_with` on rank 0 (which only saves it).
struct Gathered {
    key: String,
    state: SavedState,
}

impl TrainingState for Gathered {
    fn state_key(&self) -> String {
        self.key.clone()
    }

    fn save_state(&self) -> Result<SavedState> {
        Ok(self.state.clone())
    }

    fn check_state(&self, _: &SavedState) -> Result<()> {
        Err(Error::Internal { what: "a gathered ZeRO-1 state is only saved".into() })
    }

    fn restore_state(&mut self, _: SavedState) -> Result<()> {
        Err(Error::Internal { what: "a gathered ZeRO-1 state is only saved".into() })
    }
}

/// `bytes` of rank `root` on every rank: its length first, then its bytes.
fn broadcast_vec(comm: &dyn super::Communicator, mut bytes: Vec<u8>, root: usize) -> Result<Vec<u8>> {
    let mut len = (bytes.len() as u64).to_le_bytes();
    comm.broadcast_bytes(&mut len, root)?;
    bytes.resize(u64::from_le_bytes(len) as usize, 0);
    comm.broadcast_bytes(&mut bytes, root)?;
    Ok(bytes)
}

/// The JSON, then per tensor its name, dims, dtype ([`BF16_TAG`] for bf16, [`F32_TAG`] for f32 and any
/// other dtype, widened) and values, little-endian, lengths as u64.
fn encode(state: &SavedState) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    let put = |out: &mut Vec<u8>, n: usize| out.extend_from_slice(&(n as u64).to_le_bytes());
    put(&mut out, state.json.len());
    out.extend_from_slice(state.json.as_bytes());
    put(&mut out, state.tensors.len());
    for (name, tensor) in &state.tensors {
        put(&mut out, name.len());
        out.extend_from_slice(name.as_bytes());
        put(&mut out, tensor.rank());
        tensor.dims().iter().for_each(|&d| put(&mut out, d));
        if tensor.dtype() == DType::BF16 {
            put(&mut out, BF16_TAG);
            let values = tensor.flatten_all()?.to_vec1::<half::bf16>()?;
            values.iter().for_each(|v| out.extend_from_slice(&v.to_bits().to_le_bytes()));
        } else {
            put(&mut out, F32_TAG);
            let values = tensor.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            values.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        }
    }
    Ok(out)
}

/// [`encode`]'s dtype tags: a state tensor travels in f32 (state kept with `StateDtype::Bf16`: in
/// bf16, so that the gathered state saves as the optimizer would save it).
const F32_TAG: usize = 0;
const BF16_TAG: usize = 1;

/// The inverse of [`encode`].
fn decode(bytes: &[u8]) -> Result<SavedState> {
    let mut reader = Reader { bytes, at: 0 };
    let json = reader.text()?;
    let count = reader.word()?;
    let mut tensors = Vec::with_capacity(count.min(bytes.len()));
    for _ in 0..count {
        let name = reader.text()?;
        let rank = reader.word()?;
        let dims = (0..rank).map(|_| reader.word()).collect::<Result<Vec<usize>>>()?;
        let n: usize = dims.iter().product();
        let tensor = match reader.word()? {
            BF16_TAG => {
                let bytes = reader.take(2 * n)?.chunks_exact(2);
                let values: Vec<half::bf16> =
                    bytes.map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect();
                Tensor::from_vec(values, dims, &Device::Cpu)?
            }
            F32_TAG => {
                let bytes = reader.take(4 * n)?.chunks_exact(4);
                let values: Vec<f32> = bytes.map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                Tensor::from_vec(values, dims, &Device::Cpu)?
            }
            tag => {
                return Err(Error::Internal {
                    what: format!("a ZeRO-1 state tensor of unknown dtype tag {tag}"),
                })
            }
        };
        tensors.push((name, tensor));
    }
    Ok(SavedState { json, tensors })
}

/// Reads [`encode`]'s fields in order.
struct Reader<'b> {
    bytes: &'b [u8],
    at: usize,
}

impl<'b> Reader<'b> {
    fn take(&mut self, n: usize) -> Result<&'b [u8]> {
        let piece = self.at.checked_add(n).and_then(|end| self.bytes.get(self.at..end));
        let piece = piece
            .ok_or_else(|| Error::Internal { what: "a ZeRO-1 state from another rank ended early".into() })?;
        self.at += n;
        Ok(piece)
    }

    fn word(&mut self) -> Result<usize> {
        let mut le = [0u8; 8];
        le.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(le) as usize)
    }

    fn text(&mut self) -> Result<String> {
        let len = self.word()?;
        String::from_utf8(self.take(len)?.to_vec()).map_err(|e| Error::Internal { what: e.to_string() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_survives_encoding_bit_for_bit() -> Result<()> {
        let tensors = vec![
            ("a/exp_avg".to_string(), Tensor::new(&[1.5f32, -0.0, f32::MIN_POSITIVE], &Device::Cpu)?),
            ("b/exp_avg_sq".to_string(), Tensor::new(&[[1f32, 2.0], [3.0, 1e-30]], &Device::Cpu)?),
            (
                "c/exp_avg".to_string(),
                Tensor::new(&[1.5f32, -3e-39, 3e38], &Device::Cpu)?.to_dtype(DType::BF16)?,
            ),
        ];
        let state = SavedState { json: "{\"step\":3}".into(), tensors };
        let back = decode(&encode(&state)?)?;
        assert_eq!(back.json, state.json);
        for ((n0, t0), (n1, t1)) in state.tensors.iter().zip(&back.tensors) {
            assert_eq!((n0, t0.dims(), t0.dtype()), (n1, t1.dims(), t1.dtype()));
            let bits = |t: &Tensor| -> Result<Vec<u32>> {
                let t = t.to_dtype(DType::F32)?.flatten_all()?;
                Ok(t.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
            };
            assert_eq!(bits(t0)?, bits(t1)?);
        }
        let bytes = encode(&state)?;
        assert!(decode(&bytes[..bytes.len() - 1]).is_err(), "a truncated state is refused");
        Ok(())
    }
}
