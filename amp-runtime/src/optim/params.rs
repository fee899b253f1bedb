//! The parameters an optimizer updates, and their groups.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::VarMap;

use crate::error::{Error, Result};
use crate::param::ParamLink;
use crate::{AmpModule, ParamStorage};

/// One parameter as an optimizer sees it.
#[derive(Clone, Debug)]
pub struct OptimParam {
    /// Dotted path (or `VarMap` name, or `param.<index>` for bare variables).
    pub path: String,
    /// Layer type (`"Linear"`), or `"Var"` for bare variables.
    pub kind: &'static str,
    /// The fp32 variable the optimizer updates.
    pub(crate) master: Var,
    /// The half working copy refreshed in the same pass, if any.
    pub(crate) working: Option<Var>,
    /// The variable whose gradient the step reads.
    pub(crate) trainable: Var,
    /// Index of the parameter's group.
    pub(crate) group: usize,
    /// What the parameter's layer says about weight decay ([`crate::Layer::no_weight_decay`]).
    pub(crate) no_decay: bool,
    /// The model parameter's link, and its conversion count when the variables above were taken
    /// (none for bare variables).
    pub(crate) link: Option<(ParamLink, u64)>,
}

impl OptimParam {
    /// True for biases and the parameters of norm layers, the usual "no weight decay" set, as the
    /// parameter's layer answers it ([`crate::Layer::no_weight_decay`]); bare variables answer by shape
    /// (vectors are biases and norm scales).
    pub fn is_bias_or_norm(&self) -> bool {
        self.no_decay
    }

    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.master.elem_count()
    }

    /// This parameter's gradient in `grads` (keyed by the working copy or the master).
    ///
    /// # Errors
    /// [`Error::StaleParams`] when the model's parameter was converted after these variables were taken.
    pub(crate) fn grad<'g>(&self, grads: &'g GradStore) -> Result<Option<&'g Tensor>> {
        self.ensure_current()?;
        crate::master::gradient(grads, &self.path, &self.trainable, &self.master)
    }

    /// Refuses variables the model no longer reads: its parameter was converted
    /// ([`Param::set_storage`](crate::Param::set_storage), as `amp::initialize` does) after the
    /// optimizer took them.
    fn ensure_current(&self) -> Result<()> {
        match &self.link {
            Some((link, taken)) if link.conversions() != *taken => {
                Err(Error::StaleParams { path: self.path.clone() })
            }
            _ => Ok(()),
        }
    }

    /// The parameter as the first step's gradient check sees it.
    pub(crate) fn checked(&self) -> crate::scaler::no_grad::Checked<'_> {
        crate::scaler::no_grad::Checked {
            path: &self.path,
            kind: self.kind,
            trainable: self.trainable.as_tensor(),
            master: self.master.as_tensor(),
        }
    }
}

/// Adds, for each parameter whose gradient backward delivered both to its working copy and to its
/// master, the first to the second (what a step that ran backward itself does before reading them).
pub(crate) fn fold_split_gradients(params: &[OptimParam], grads: &mut GradStore) -> Result<()> {
    for p in params {
        if let Some(working) = &p.working {
            if grads.get(working.as_tensor()).is_some() && grads.get(p.master.as_tensor()).is_some() {
                crate::master::fold(grads, working, &p.master)?;
            }
        }
    }
    Ok(())
}

/// Hyper-parameters a group overrides; `None` keeps the optimizer's.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GroupOptions {
    /// Learning rate of the group.
    pub lr: Option<f64>,
    /// Weight decay of the group.
    pub weight_decay: Option<f64>,
}

/// Parameters with their groups: group 0 holds everything not claimed by a later group.
#[derive(Clone, Debug, Default)]
pub struct ParamGroups {
    pub(crate) params: Vec<OptimParam>,
    pub(crate) groups: Vec<GroupOptions>,
}

impl ParamGroups {
    /// Every parameter of an amp model, with its master and working copy. A parameter that several
    /// layers share (tied weights) is one parameter, at the first path it is found at
    /// ([`AmpModuleExt::unique_params`](crate::AmpModuleExt::unique_params)): updated once a step.
    pub fn from_model<M: AmpModule + ?Sized>(model: &M) -> Result<Self> {
        let mut params = Vec::new();
        let mut first_error = None;
        crate::module::for_each_unique_param(model, |site, layer, name, param| {
            let path = site.param_path(name);
            if let ParamStorage::Half(p) = param.storage() {
                first_error.get_or_insert(Error::NoFp32Master { path: path.clone(), precision: p });
            }
            params.push(OptimParam {
                path,
                kind: layer.kind(),
                master: param.master().clone(),
                working: param.working().cloned(),
                trainable: param.trainable().clone(),
                group: 0,
                no_decay: layer.no_weight_decay(name),
                link: Some((param.link().clone(), param.link().conversions())),
            });
        });
        first_error.map_or(Ok(()), Err)?;
        Ok(ParamGroups { params, groups: vec![GroupOptions::default()] })
    }

    /// Plain fp32 candle variables, so candle users can adopt the optimizer alone.
    pub fn from_vars(vars: impl IntoIterator<Item = Var>) -> Result<Self> {
        let named = vars.into_iter().enumerate().map(|(i, v)| (format!("param.{i}"), v));
        Self::from_named_vars(named)
    }

    /// The variables of a `VarMap`, by name (sorted, so state order is stable).
    pub fn from_varmap(varmap: &VarMap) -> Result<Self> {
        let data =
            varmap.data().lock().map_err(|_| Error::Internal { what: "VarMap lock poisoned".into() })?;
        let mut named: Vec<(String, Var)> = data.iter().map(|(n, v)| (n.clone(), v.clone())).collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        Self::from_named_vars(named)
    }

    /// A variable given twice is one parameter, at its first name.
    fn from_named_vars(named: impl IntoIterator<Item = (String, Var)>) -> Result<Self> {
        let mut seen = std::collections::HashSet::new();
        let params = named
            .into_iter()
            .filter(|(_, var)| seen.insert(var.as_tensor().id()))
            .map(|(path, var)| {
                if var.dtype() != DType::F32 {
                    let precision = crate::Precision::from_dtype(var.dtype())?;
                    return Err(Error::NoFp32Master { path, precision });
                }
                Ok(OptimParam {
                    path,
                    kind: "Var",
                    master: var.clone(),
                    working: None,
                    no_decay: var.rank() <= 1,
                    trainable: var,
                    group: 0,
                    link: None,
                })
            })
            .collect::<Result<_>>()?;
        Ok(ParamGroups { params, groups: vec![GroupOptions::default()] })
    }

    /// Moves the parameters for which `select` is true (and that no earlier group claimed) into a new
    /// group with `options`. `groups.with_group(OptimParam::is_bias_or_norm, no_decay)` is the usual use.
    pub fn with_group(mut self, select: impl Fn(&OptimParam) -> bool, options: GroupOptions) -> Self {
        let index = self.groups.len();
        self.groups.push(options);
        for param in self.params.iter_mut().filter(|p| p.group == 0) {
            if select(param) {
                param.group = index;
            }
        }
        self
    }

    /// Refuses to step parameters whose model converted them after they were taken
    /// ([`Error::StaleParams`]): what every step of amp's scalers checks before it runs backward.
    pub(crate) fn ensure_current(&self) -> Result<()> {
        self.params.iter().try_for_each(OptimParam::ensure_current)
    }

    /// The parameters, in order.
    pub fn params(&self) -> &[OptimParam] {
        &self.params
    }

    /// Total elements.
    pub fn elem_count(&self) -> usize {
        self.params.iter().map(OptimParam::elem_count).sum()
    }
}
