//! A checkpoint's checksums: the CRC-32 of its tensor data and its other metadata (the training
//! states' JSON), and the CRC-32 of its tensor table (each tensor's name, dtype, shape and place in the
//! data), kept in its header's metadata, so that a bit flipped on the disk after the save, which no
//! check of names, shapes or values could see, is refused on load; and so is a table edited to read
//! two same-shaped tensors from each other's bytes.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::Metadata;

use crate::error::{Error, Result};

/// The metadata key of the CRC-32 of the tensor data and the other metadata (the training states'
/// JSON), 8 lowercase hex digits, which amp writes and checks when present (files from candle-nn's
/// `VarMap::save` have none).
const CHECKSUM_KEY: &str = "amp_data_crc32";

/// The metadata key of the CRC-32 of the tensor table ([`table_checksum`]), checked when present
/// (checkpoints written before it have only [`CHECKSUM_KEY`]).
const TABLE_CHECKSUM_KEY: &str = "amp_table_crc32";

/// The CRC-32 of `data` followed by every metadata entry but the checksums' own, in key order, each
/// key and value ended by a zero byte.
fn checksum(data: &[u8], metadata: &HashMap<String, String>) -> String {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(data);
    let mut entries: Vec<(&String, &String)> =
        metadata.iter().filter(|(k, _)| *k != CHECKSUM_KEY && *k != TABLE_CHECKSUM_KEY).collect();
    entries.sort();
    for (key, value) in entries {
        for text in [key, value] {
            hasher.update(text.as_bytes());
            hasher.update(&[0]);
        }
    }
    format!("{:08x}", hasher.finalize())
}

/// The CRC-32 of every tensor's name, dtype, shape and data offsets, in name order, each field ended
/// by a zero byte.
fn table_checksum(header: &Metadata) -> String {
    let mut hasher = crc32fast::Hasher::new();
    let tensors = header.tensors();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    for name in names {
        let info = tensors[name];
        let (start, end) = info.data_offsets;
        for field in
            [name.clone(), format!("{:?}", info.dtype), format!("{:?}", info.shape), format!("{start}-{end}")]
        {
            hasher.update(field.as_bytes());
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
    let table = table_checksum(&header);
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
    if let Some(metadata) = metadata.as_object_mut() {
        metadata.insert(TABLE_CHECKSUM_KEY.into(), serde_json::Value::String(table));
    }
    let mut text = header.to_string().into_bytes();
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + text.len() + data.len());
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    out.extend_from_slice(data);
    Ok(out)
}

/// Checks `data`, `metadata` and the tensor table of `header`, read from `path`, against the
/// checksums in the metadata, where there are some. A key one bit off a checksum's name was damaged
/// too: the file would otherwise load unchecked.
pub(super) fn verify(data: &[u8], header: &Metadata, path: &Path) -> Result<()> {
    let metadata = header.metadata().clone().unwrap_or_default();
    let damaged = |saved: String, computed: String| Error::CheckpointDamaged {
        path: path.to_path_buf(),
        saved,
        computed,
    };
    for (key, computed) in
        [(CHECKSUM_KEY, checksum(data, &metadata)), (TABLE_CHECKSUM_KEY, table_checksum(header))]
    {
        if let Some(bad) = metadata.keys().find(|k| one_bit_apart(k, key)) {
            return Err(damaged(format!("under a damaged key, `{bad}`"), computed));
        }
        match metadata.get(key) {
            Some(saved) if *saved != computed => {
                return Err(damaged(format!("{saved} for `{key}`"), computed))
            }
            _ => {}
        }
    }
    Ok(())
}
