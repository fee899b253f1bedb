//! The static precision plan: what `#[derive(AmpModule)]` knows at compile time.

use std::fmt;

use crate::PrecisionSpec;

/// The compile-time description of a module type.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    /// The type's name as written in its definition.
    pub type_name: &'static str,
    /// What the type is made of.
    pub node: PlanNode,
}

/// The shape of a module type.
#[derive(Clone, Copy, Debug)]
pub enum PlanNode {
    /// A leaf layer with parameters.
    Layer {
        /// True for layers that always compute in fp32 (norms, softmax, losses).
        pinned_fp32: bool,
    },
    /// A struct deriving `AmpModule`.
    Struct {
        /// The struct's `#[amp(default = ...)]`, if any.
        default: Option<PrecisionSpec>,
        /// Its module fields, in declaration order (skipped fields are absent).
        fields: &'static [PlanField],
    },
    /// A `Vec`, `Option`, `Box` or array of one module type.
    Repeated {
        /// `"Vec"`, `"Option"`, `"Box"` or `"array"`.
        container: &'static str,
        /// The element's plan.
        item: &'static Plan,
    },
}

/// One module field of a struct's plan.
#[derive(Clone, Copy, Debug)]
pub struct PlanField {
    /// The field's name, or its index for tuple structs.
    pub name: &'static str,
    /// The field's type as written.
    pub ty: &'static str,
    /// The precision the field asks for: its own attribute, else the struct's default, else none
    /// (it inherits).
    pub precision: Option<PrecisionSpec>,
    /// The field type's plan.
    pub plan: &'static Plan,
}

impl Plan {
    /// True if some path through this plan reaches a layer fixed to fp16 or `half`.
    pub const fn needs_loss_scaling(&self) -> bool {
        self.fp16_reachable(None)
    }

    const fn fp16_reachable(&self, inherited: Option<PrecisionSpec>) -> bool {
        match self.node {
            PlanNode::Layer { pinned_fp32 } => {
                !pinned_fp32 && matches!(inherited, Some(spec) if spec.may_be_fp16())
            }
            PlanNode::Repeated { item, .. } => item.fp16_reachable(inherited),
            PlanNode::Struct { fields, .. } => {
                let mut i = 0;
                while i < fields.len() {
                    let field = &fields[i];
                    let spec = match field.precision {
                        Some(spec) => Some(spec),
                        None => inherited,
                    };
                    if field.plan.fp16_reachable(spec) {
                        return true;
                    }
                    i += 1;
                }
                false
            }
        }
    }

    fn write_tree(&self, f: &mut fmt::Formatter<'_>, depth: usize) -> fmt::Result {
        if let PlanNode::Struct { fields, .. } = self.node {
            for field in fields {
                let precision = field.precision.map_or("(inherits)", PrecisionSpec::name);
                writeln!(f, "{:indent$}{}: {} {}", "", field.name, field.ty, precision, indent = depth * 2)?;
                field.plan.write_tree(f, depth + 1)?;
            }
        } else if let PlanNode::Repeated { item, .. } = self.node {
            item.write_tree(f, depth)?;
        }
        Ok(())
    }
}

impl fmt::Display for Plan {
    /// An indented tree of fields with their requested precisions.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.node {
            PlanNode::Struct { default: Some(d), .. } => writeln!(f, "{} (default {d})", self.type_name)?,
            _ => writeln!(f, "{}", self.type_name)?,
        }
        self.write_tree(f, 1)
    }
}
