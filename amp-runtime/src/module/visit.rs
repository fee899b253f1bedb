//! Traversal of a module tree: every layer with its dotted path and requested precision.

use crate::{Layer, PrecisionSpec};

/// Where a traversal is: the dotted path and the stack of requested precisions.
///
/// Generated code pushes a segment per field (`cursor.push("fc", Some(PrecisionSpec::Fp16))`), visits
/// the field, and pops it. The innermost request wins.
#[derive(Debug, Default)]
pub struct Cursor {
    path: String,
    frames: Vec<Frame>,
}

#[derive(Debug)]
struct Frame {
    path_len: usize,
    spec: Option<PrecisionSpec>,
}

impl Cursor {
    /// A cursor at the root, with nothing requested.
    pub fn new() -> Self {
        Self::default()
    }

    /// A cursor at the root, with `spec` requested for everything below that does not override it.
    pub fn with_default(spec: Option<PrecisionSpec>) -> Self {
        let mut cursor = Self::new();
        cursor.frames.push(Frame { path_len: 0, spec });
        cursor
    }

    /// Enters a named field that requests `spec` (`None`: inherit).
    pub fn push(&mut self, segment: &str, spec: Option<PrecisionSpec>) {
        self.frames.push(Frame { path_len: self.path.len(), spec });
        if !self.path.is_empty() {
            self.path.push('.');
        }
        self.path.push_str(segment);
    }

    /// Enters element `index` of a container; elements inherit.
    pub fn push_index(&mut self, index: usize) {
        use std::fmt::Write;
        self.frames.push(Frame { path_len: self.path.len(), spec: None });
        if !self.path.is_empty() {
            self.path.push('.');
        }
        // Writing to a String cannot fail.
        let _ = write!(self.path, "{index}");
    }

    /// Leaves the segment entered last.
    pub fn pop(&mut self) {
        if let Some(frame) = self.frames.pop() {
            self.path.truncate(frame.path_len);
        }
    }

    /// The dotted path of the current position (`layers.3.fc`).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The innermost precision requested on the way here, if any.
    pub fn requested(&self) -> Option<PrecisionSpec> {
        self.frames.iter().rev().find_map(|frame| frame.spec)
    }

    /// The site of a layer at the current position.
    pub fn site(&self) -> LayerSite<'_> {
        LayerSite { path: &self.path, requested: self.requested() }
    }
}

/// A layer's place in the model.
#[derive(Clone, Copy, Debug)]
pub struct LayerSite<'a> {
    /// Dotted path of the layer (`blocks.0.attn.q`); parameters append `.weight`, `.bias`.
    pub path: &'a str,
    /// The innermost precision requested for it by attributes (or the traversal's default).
    pub requested: Option<PrecisionSpec>,
}

impl LayerSite<'_> {
    /// The path of a parameter of this layer (the layer's own path for the unnamed parameter `""`).
    pub fn param_path(&self, name: &str) -> String {
        if self.path.is_empty() {
            name.to_string()
        } else if name.is_empty() {
            self.path.to_string()
        } else {
            format!("{}.{name}", self.path)
        }
    }
}

/// Receives every layer of a module tree.
pub trait Visitor {
    /// Called once per layer, in declaration order.
    fn visit_layer(&mut self, site: LayerSite<'_>, layer: &dyn Layer);
}

/// Receives every layer of a module tree, mutably.
pub trait VisitorMut {
    /// Called once per layer, in declaration order.
    fn visit_layer_mut(&mut self, site: LayerSite<'_>, layer: &mut dyn Layer);
}

impl<F: FnMut(LayerSite<'_>, &dyn Layer)> Visitor for F {
    fn visit_layer(&mut self, site: LayerSite<'_>, layer: &dyn Layer) {
        self(site, layer)
    }
}

impl<F: FnMut(LayerSite<'_>, &mut dyn Layer)> VisitorMut for F {
    fn visit_layer_mut(&mut self, site: LayerSite<'_>, layer: &mut dyn Layer) {
        self(site, layer)
    }
}
