//! candle-nn's initializers from a seeded generator: reproducible initial weights.
//!
//! candle's CPU random generator cannot be seeded, so `VarMap`'s initial weights differ on every run and
//! two runs "from seed 3" are not the same experiment. [`SeededInit`] draws every initializer candle-nn
//! knows ([`candle_nn::Init`]: constants, normal, uniform, Kaiming) from the same distribution as
//! `Init::var`, but from a ChaCha8 stream of its own per parameter, keyed by the seed and the
//! parameter's name: the same name gets the same values whatever else the model holds and in whatever
//! order it is built.

use std::collections::hash_map::Entry as MapEntry;

use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::init::NormalOrUniform;
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder, VarMap};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;

/// A seed for candle-nn's initializers: every [`candle_nn::Init`] drawn from the same distribution as
/// `Init::var`, but from a ChaCha8 stream per parameter keyed by the seed and the parameter's name, so
/// that initial weights are the same on every run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SeededInit {
    seed: u64,
}

impl SeededInit {
    /// The initializers of `seed`.
    pub fn new(seed: u64) -> Self {
        SeededInit { seed }
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The f32 values of parameter `name` of `shape` under `init`, drawn from the distribution
    /// candle-nn's `Init::var` uses.
    pub fn values(
        &self,
        name: &str,
        shape: &Shape,
        init: Init,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let len = shape.elem_count();
        let mut rng = self.stream(name);
        let values: Vec<f32> = match init {
            Init::Const(value) => vec![value as f32; len],
            Init::Uniform { lo, up } => uniform(&mut rng, len, lo, up),
            Init::Randn { mean, stdev } => normal(&mut rng, len, mean, stdev),
            Init::Kaiming { dist, fan, non_linearity } => {
                let std = non_linearity.gain() / (fan.for_shape(shape) as f64).sqrt();
                match dist {
                    NormalOrUniform::Uniform => {
                        let bound = 3f64.sqrt() * std;
                        uniform(&mut rng, len, -bound, bound)
                    }
                    NormalOrUniform::Normal => normal(&mut rng, len, 0.0, std),
                }
            }
        };
        Tensor::from_vec(values, shape, device)
    }

    /// A `VarBuilder` that creates the model's variables in `varmap` (candle-nn's own map: the model
    /// trains, saves and loads as usual) with this seed's values instead of unseeded draws. A name
    /// already in the map is handed back as it is, as `VarMap`'s builder does.
    pub fn var_builder(&self, varmap: &VarMap, dtype: DType, device: &Device) -> VarBuilder<'static> {
        let backend: Box<dyn SimpleBackend> = Box::new(SeededVarMap { varmap: varmap.clone(), init: *self });
        VarBuilder::from_backend(backend, dtype, device.clone())
    }

    /// The generator of one parameter: the seed picks the key, the name's FNV-1a hash the stream.
    fn stream(&self, name: &str) -> ChaCha8Rng {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let hash = name
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        rng.set_stream(hash);
        rng
    }
}

fn uniform(rng: &mut ChaCha8Rng, len: usize, lo: f64, up: f64) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(lo..up) as f32).collect()
}

fn normal(rng: &mut ChaCha8Rng, len: usize, mean: f64, stdev: f64) -> Vec<f32> {
    (0..len).map(|_| (mean + stdev * rng.sample::<f64, _>(StandardNormal)) as f32).collect()
}

/// candle-nn's `VarMap` with seeded creation.
struct SeededVarMap {
    varmap: VarMap,
    init: SeededInit,
}

impl SimpleBackend for SeededVarMap {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        init: Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut data =
            self.varmap.data().lock().map_err(|_| candle_core::Error::Msg("VarMap lock poisoned".into()))?;
        match data.entry(name.to_string()) {
            MapEntry::Occupied(existing) => {
                let tensor = existing.get().as_tensor();
                if tensor.shape() != &shape {
                    candle_core::bail!(
                        "{name}: the map holds shape {:?}, the model asks for {shape:?}",
                        tensor.dims()
                    );
                }
                tensor.to_dtype(dtype)
            }
            MapEntry::Vacant(slot) => {
                let values = self.init.values(name, &shape, init, device)?.to_dtype(dtype)?;
                let var = Var::from_tensor(&values)?;
                let tensor = var.as_tensor().clone();
                slot.insert(var);
                Ok(tensor)
            }
        }
    }

    fn get_unchecked(&self, name: &str, dtype: DType, _device: &Device) -> candle_core::Result<Tensor> {
        let data =
            self.varmap.data().lock().map_err(|_| candle_core::Error::Msg("VarMap lock poisoned".into()))?;
        match data.get(name) {
            Some(var) => var.as_tensor().to_dtype(dtype),
            None => candle_core::bail!("{name}: not in the map, and a read without a shape cannot create it"),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.varmap.data().lock().is_ok_and(|data| data.contains_key(name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_nn::init::{FanInOut, NonLinearity, DEFAULT_KAIMING_NORMAL};

    fn moments(t: &Tensor) -> (f64, f64, f32, f32) {
        let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let n = v.len() as f64;
        let mean = v.iter().map(|x| f64::from(*x)).sum::<f64>() / n;
        let var = v.iter().map(|x| (f64::from(*x) - mean).powi(2)).sum::<f64>() / n;
        let (lo, hi) = v.iter().fold((f32::MAX, f32::MIN), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
        (mean, var.sqrt(), lo, hi)
    }

    #[test]
    fn every_initializer_draws_its_distribution() {
        let init = SeededInit::new(7);
        let shape = Shape::from((256, 512));
        let n = shape.elem_count() as f64;
        let cases = [
            (Init::Randn { mean: 0.5, stdev: 2.0 }, 0.5, 2.0),
            (Init::Uniform { lo: -1.0, up: 3.0 }, 1.0, 4.0 / 12f64.sqrt()),
            (candle_nn::init::DEFAULT_KAIMING_UNIFORM, 0.0, 2f64.sqrt() / 512f64.sqrt()),
            (DEFAULT_KAIMING_NORMAL, 0.0, 2f64.sqrt() / 512f64.sqrt()),
            (
                Init::Kaiming {
                    dist: NormalOrUniform::Normal,
                    fan: FanInOut::FanOut,
                    non_linearity: NonLinearity::Tanh,
                },
                0.0,
                (5.0 / 3.0) / 256f64.sqrt(),
            ),
        ];
        for (hint, mean, std) in cases {
            let (m, s, _, _) = moments(&init.values("w", &shape, hint, &Device::Cpu).unwrap());
            // Sample mean within 5 standard errors; sample deviation within 2% (its standard error is
            // about std / sqrt(2n) = 0.2% here).
            assert!((m - mean).abs() < 5.0 * std / n.sqrt(), "{hint:?}: mean {m} vs {mean}");
            assert!((s / std - 1.0).abs() < 0.02, "{hint:?}: std {s} vs {std}");
        }
        let (_, _, lo, hi) =
            moments(&init.values("w", &shape, Init::Uniform { lo: -1.0, up: 3.0 }, &Device::Cpu).unwrap());
        assert!(lo >= -1.0 && hi < 3.0 && lo < -0.99 && hi > 2.99, "uniform range [{lo}, {hi}]");
        let ones = init.values("g", &shape, Init::Const(1.0), &Device::Cpu).unwrap();
        assert_eq!(moments(&ones), (1.0, 0.0, 1.0, 1.0));
    }

    #[test]
    fn same_seed_and_name_same_values_whatever_the_order() {
        let shape = Shape::from((8, 16));
        let draw = |seed, name| {
            SeededInit::new(seed)
                .values(name, &shape, DEFAULT_KAIMING_NORMAL, &Device::Cpu)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap()
        };
        assert_eq!(draw(3, "fc1.weight"), draw(3, "fc1.weight"));
        assert_ne!(draw(3, "fc1.weight"), draw(4, "fc1.weight"));
        assert_ne!(draw(3, "fc1.weight"), draw(3, "fc2.weight"));

        let build = |first: &str, second: &str| {
            let varmap = VarMap::new();
            let vb = SeededInit::new(3).var_builder(&varmap, DType::F32, &Device::Cpu);
            candle_nn::linear(16, 8, vb.pp(first)).unwrap();
            candle_nn::linear(16, 8, vb.pp(second)).unwrap();
            let data = varmap.data().lock().unwrap();
            data.get("fc1.weight").unwrap().as_tensor().to_vec2::<f32>().unwrap()
        };
        assert_eq!(build("fc1", "fc2"), build("fc2", "fc1"));
        assert_eq!(build("fc1", "fc2"), draw(3, "fc1.weight"));
    }

    #[test]
    fn the_var_builder_fills_a_varmap_and_hands_back_what_it_holds() {
        let varmap = VarMap::new();
        let vb = SeededInit::new(1).var_builder(&varmap, DType::F32, &Device::Cpu);
        let layer = candle_nn::linear(4, 3, vb.pp("fc")).unwrap();
        assert_eq!(varmap.all_vars().len(), 2);
        // A second model over the same map shares the variables (tied or reloaded weights).
        let again = candle_nn::linear(4, 3, vb.pp("fc")).unwrap();
        assert_eq!(layer.weight().to_vec2::<f32>().unwrap(), again.weight().to_vec2::<f32>().unwrap());
        let wrong = candle_nn::linear(5, 3, vb.pp("fc")).unwrap_err().to_string();
        assert!(wrong.contains("fc.weight") && wrong.contains("shape"), "{wrong}");
        // The variables train: they are the map's own.
        let grads = layer.weight().sum_all().unwrap().backward().unwrap();
        assert!(
            grads.get(varmap.all_vars()[0].as_tensor()).is_some()
                || grads.get(varmap.all_vars()[1].as_tensor()).is_some()
        );
    }
}
