//! A checkpoint's checksum: the CRC-32 of its tensor data and its other metadata (the training
//! states' JSON), kept in its header's metadata, so that a bit flipped on the disk after the save, which
//! no check of names, shapes or values could see, is refused on load.

use std::collections::HashMap;
use std::path::Path;

use crate::error::{Error, Result};

/// The metadata key of the CRC-32 of the tensor data and the other metadata (the training states'
/// JSON), 8 lowercase hex digits, which amp writes and checks when present (files from candle-nn's
/// `VarMap::save` have none).
const CHECKSUM_KEY: &str = "amp_data_crc32";

/// The CRC-32 of `data` followed by every metadata entry but the checksum's own, in key order, each
/// key and value ended by a zero byte.
fn checksum(data: &[u8], metadata: &HashMap<String, String>) -> String {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(data);
    let mut entries: Vec<(&String, &String)> = metadata.iter().filter(|(k, _)| *k != CHECKSUM_KEY).collect();
    entries.sort();
    for (key, value) in entries {
        for text in [key, value] {
            hasher.update(text.as_bytes());
            hasher.update(&[0]);
        }
    }
    format!("{:08x}", hasher.finalize())
}

/// Whether `a` and `b` differ in exactly one bit.
fn one_bit_apart(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).map(|(x, y)| (x ^ y).count_ones()).sum::<u32>() == 1
}

/// `file`, a safetensors file, with the [`checksum`] of its tensor data and metadata added to its
/// header's metadata: the header is rewritten (padded with spaces to 8 bytes, as safetensors pads it)
/// before the same data.
pub(super) fn with_checksum(file: Vec<u8>) -> Result<Vec<u8>> {
    let internal = |what: String| Error::Internal { what: format!("checkpoint checksum: {what}") };
    let (header_len, header) =
        safetensors::SafeTensors::read_metadata(&file).map_err(|e| internal(e.to_string()))?;
    let data = &file[8 + header_len..];
    let sum = checksum(data, &header.metadata().clone().unwrap_or_default());
    let mut header: serde_json::Value =
        serde_json::from_slice(&file[8..8 + header_len]).map_err(|e| internal(e.to_string()))?;
    let metadata = header
        .as_object_mut()
        .ok_or_else(|| internal("the header is not an object".into()))?
        .entry("__metadata__")
        .or_insert_with(|| serde_json::Value::Object(serde_json::Map::new()));
    metadata
        .as_object_mut()
        .ok_or_else(|| internal("no metadata object".into()))?
        .insert(CHECKSUM_KEY.into(), serde_json::Value::String(sum));
    let mut text = header.to_string().into_bytes();
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + text.len() + data.len());
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    out.extend_from_slice(data);
    Ok(out)
}

/// Checks `data` and `metadata`, read from `path`, against the checksum in the metadata, if there is
/// one. A key one bit off the checksum's name was damaged too: the file would otherwise load unchecked.
pub(super) fn verify(data: &[u8], metadata: &HashMap<String, String>, path: &Path) -> Result<()> {
    let damaged = |saved: String| Error::CheckpointDamaged {
        path: path.to_path_buf(),
        saved,
        computed: checksum(data, metadata),
    };
    if let Some(key) = metadata.keys().find(|k| one_bit_apart(k, CHECKSUM_KEY)) {
        return Err(damaged(format!("under a damaged key, `{key}`")));
    }
    match metadata.get(CHECKSUM_KEY) {
        Some(saved) if *saved != checksum(data, metadata) => Err(damaged(saved.clone())),
        _ => Ok(()),
    }
}
