//! Checks of optimizer settings: each error names the field, its valid range and the value given.

use crate::error::{Error, Result};

fn refuse(field: &str, range: &str, value: f64) -> Error {
    Error::InvalidOptimizerConfig { reason: format!("`{field}` must be {range}, got {value}") }
}

/// A learning rate, weight decay or momentum: finite and at least 0.
pub(crate) fn non_negative(field: &str, value: f64) -> Result<()> {
    if value.is_finite() && value >= 0.0 {
        return Ok(());
    }
    Err(refuse(field, "finite and at least 0", value))
}

/// An epsilon: finite and above 0.
pub(crate) fn positive(field: &str, value: f64) -> Result<()> {
    if value.is_finite() && value > 0.0 {
        return Ok(());
    }
    Err(refuse(field, "finite and above 0", value))
}

/// A moment's decay: in [0, 1).
pub(crate) fn decay(field: &str, value: f64) -> Result<()> {
    if (0.0..1.0).contains(&value) {
        return Ok(());
    }
    Err(refuse(field, "in [0, 1)", value))
}

/// A fraction: in [0, 1].
pub(crate) fn fraction(field: &str, value: f64) -> Result<()> {
    if (0.0..=1.0).contains(&value) {
        return Ok(());
    }
    Err(refuse(field, "in [0, 1]", value))
}

/// The per-group overrides (`groups[i].lr`, `groups[i].weight_decay`).
pub(crate) fn groups(groups: &[super::GroupOptions]) -> Result<()> {
    for (i, group) in groups.iter().enumerate() {
        if let Some(lr) = group.lr {
            non_negative(&format!("groups[{i}].lr"), lr)?;
        }
        if let Some(weight_decay) = group.weight_decay {
            non_negative(&format!("groups[{i}].weight_decay"), weight_decay)?;
        }
    }
    Ok(())
}
