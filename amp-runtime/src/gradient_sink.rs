//! Gradients of variables handed straight to amp's own backward passes, past candle's accumulation.
//!
//! candle's backward pass adds every gradient an op returns into a fresh zero tensor of the argument's
//! shape (`GradStore::or_insert`, then `add`): for a weight matrix, a zero fill and an add over all of
//! it, every step. When amp runs the backward pass itself ([`backward`]: the scaler's and the fused
//! optimizer's steps), amp's product ops ([`deposit`]) hand the gradients of variables to a sink on
//! this thread instead, and the pass merges them into the `GradStore` at the end: the same gradients
//! (up to the sign of an exact zero, `0 + -0 = +0`, and, for a variable that candle's own ops also
//! differentiate, the order its parts are summed in), without the two extra passes over each weight. A
//! backward pass the user runs (`loss.backward()`) is untouched: outside [`backward`] the sink is off.
//!
//! A gradient deposited on the CPU is also checked for inf and NaN there, while the product that wrote
//! it has left it in cache: [`backward_checked`] names the gradients so checked, and the fused step's
//! overflow check reads only the others (`GradScaler::step_fused`; on the MLP bench the check's pass
//! over every weight gradient was 3% of a bf16 step's samples).
//!
//! A pass can also be given running sums ([`backward_adding`]: gradient accumulation's f32 sums). An op
//! that can adds a variable's gradient into its sum itself: amp's Linear runs an f32 weight's gradient
//! product into the sum (`C += A·B`, [`sum_for`]), where the gradient would otherwise be written, read
//! back and added (two passes over each weight, and one more write).

use std::cell::{Cell, RefCell};
use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, TensorId};

/// A variable, its gradient so far, and whether that gradient was found all finite when deposited
/// (`false` when not checked: off the CPU, or a sum of two deposits).
struct Deposit {
    var: Tensor,
    grad: Tensor,
    finite: bool,
}

/// Deposits so far, by variable.
type Sunk = HashMap<TensorId, Deposit>;

/// The gradient tensors (by id) that [`backward_checked`] found all finite, each when it was deposited.
#[derive(Debug, Default)]
pub(crate) struct CheckedFinite(HashSet<TensorId>);

impl CheckedFinite {
    /// Whether `grad` is one of the gradients found all finite.
    pub(crate) fn contains(&self, grad: &Tensor) -> bool {
        self.0.contains(&grad.id())
    }
}

thread_local! {
    /// `Some` while [`backward`] runs on this thread.
    static SINK: RefCell<Option<Sunk>> = const { RefCell::new(None) };
    /// Whether deposits are checked for inf/NaN ([`backward_checked`]).
    static CHECK: Cell<bool> = const { Cell::new(false) };
    /// The sums the running pass adds variables' gradients into ([`backward_adding`]), by variable.
    static SUMS: RefCell<Sums> = RefCell::new(Sums::new());
}

/// Running f32 sums, by the variable whose gradients they sum.
pub(crate) type Sums = HashMap<TensorId, Tensor>;

/// `loss.backward()`, with the gradients amp's product ops deposit merged in: what candle's pass
/// alone would return, computed with less memory traffic.
pub(crate) fn backward(loss: &Tensor) -> crate::Result<GradStore> {
    Ok(backward_pass(loss, false)?.0)
}

/// [`backward`], and which of the gradients in the store were found all finite when deposited.
pub(crate) fn backward_checked(loss: &Tensor) -> crate::Result<(GradStore, CheckedFinite)> {
    backward_pass(loss, true)
}

/// [`backward`], with the gradients of the variables in `sums` (each a contiguous f32 CPU tensor of
/// its variable's shape, sharing memory with nothing the pass reads) added into those sums where an
/// op can add them itself ([`sum_for`]): the store then holds no gradient for a variable whose every
/// part was added, and the parts it holds are still to be added. The sums are written in place as the
/// pass runs: after an error they may hold some of the parts.
pub(crate) fn backward_adding(loss: &Tensor, sums: Sums) -> crate::Result<GradStore> {
    let _given = SumsGiven(Some(SUMS.replace(sums)));
    Ok(backward_pass(loss, false)?.0)
}

/// The sums of a pass, given until it ends (or unwinds): then the sums before are back.
struct SumsGiven(Option<Sums>);

impl Drop for SumsGiven {
    fn drop(&mut self) {
        SUMS.set(self.0.take().unwrap_or_default());
    }
}

/// The running sum that the pass on this thread adds `var`'s gradient into, if it was given one.
pub(crate) fn sum_for(var: &Tensor) -> Option<Tensor> {
    if !var.is_variable() || SINK.with_borrow(Option::is_none) {
        return None;
    }
    SUMS.with_borrow(|sums| sums.get(&var.id()).cloned())
}

/// The pass, each deposit checked when `check`.
fn backward_pass(loss: &Tensor, check: bool) -> crate::Result<(GradStore, CheckedFinite)> {
    let open = Open::new(check);
    let grads = loss.backward();
    let sunk = open.close();
    let mut grads = grads.map_err(with_replacement)?;
    let mut finite = CheckedFinite::default();
    for Deposit { var, grad, finite: checked } in sunk.into_values() {
        // Another op may have given the same variable a gradient through candle's store.
        let grad = match grads.get(&var) {
            Some(other) => (other + grad)?,
            None => {
                if checked {
                    finite.0.insert(grad.id());
                }
                grad
            }
        };
        grads.insert(&var, grad);
    }
    Ok((grads, finite))
}

/// candle's backward error, naming amp's differentiable replacement where candle has no backward for
/// an op amp has (candle 0.11.1's messages).
fn with_replacement(candle: candle_core::Error) -> crate::Error {
    const REPLACEMENTS: [(&str, &str); 4] = [
        ("for conv-transpose1d", "nn::ConvTranspose1d (candle-nn's names, shapes and configuration)"),
        ("for maxpool2d", "ops::max_pool2d (any window, stride and padding; ops::max_pool1d in 1-d)"),
        ("for avgpool2d", "ops::avg_pool2d (any window, stride and padding; ops::avg_pool1d in 1-d)"),
        ("for upsample_bilinear2d", "ops::upsample_bilinear2d (candle's arguments and values)"),
    ];
    let message = candle.to_string();
    let replacement =
        message.contains("backward").then(|| REPLACEMENTS.iter().find(|(op, _)| message.contains(op)));
    match replacement.flatten() {
        Some(&(_, instead)) => crate::Error::NoBackward { candle, instead },
        None => crate::Error::Candle(candle),
    }
}

/// The gradient `grad` of an op's argument `arg`: taken into the sink (`None`) when `arg` is a
/// variable and [`backward`] runs on this thread, else returned for candle to accumulate.
pub(crate) fn deposit(arg: &Tensor, grad: Tensor) -> Result<Option<Tensor>> {
    deposit_known(arg, grad, None)
}

/// [`deposit`] of a gradient whose finiteness the op that made it knows already (`all_finite`: the
/// GEMM checked its blocks as it wrote them, [`amp_kernels::gemm::gemm_new_streamed`]), so that the
/// sink need not read it again for its check.
pub(crate) fn deposit_checked(arg: &Tensor, grad: Tensor, all_finite: bool) -> Result<Option<Tensor>> {
    deposit_known(arg, grad, Some(all_finite))
}

fn deposit_known(arg: &Tensor, grad: Tensor, all_finite: Option<bool>) -> Result<Option<Tensor>> {
    if !arg.is_variable() {
        return Ok(Some(grad));
    }
    SINK.with_borrow_mut(|sink| {
        let Some(sunk) = sink else { return Ok(Some(grad)) };
        // Detached as candle detaches the gradients it stores: the sink must not keep the graph alive.
        let grad = grad.detach();
        match sunk.entry(arg.id()) {
            Entry::Occupied(mut entry) => {
                let deposit = entry.get_mut();
                deposit.grad = (&deposit.grad + &grad)?;
                deposit.finite = false;
            }
            Entry::Vacant(entry) => {
                // Checked now, while the product that wrote it has left it in cache (CPU only: on a
                // GPU this would wait for the device).
                let finite = CHECK.get()
                    && grad.device().is_cpu()
                    && match all_finite {
                        Some(known) => known,
                        None => crate::passes::find_non_finite(&[&grad])?.is_none(),
                    };
                entry.insert(Deposit { var: arg.clone(), grad, finite });
            }
        }
        Ok(None)
    })
}

/// The sink open on this thread; dropping it unclosed (a panic in the pass) restores the state before.
struct Open {
    before: Option<Sunk>,
    checked_before: bool,
    closed: bool,
}

impl Open {
    /// Opens a sink whose deposits are checked for inf/NaN when `check`.
    fn new(check: bool) -> Open {
        Open { before: SINK.replace(Some(Sunk::new())), checked_before: CHECK.replace(check), closed: false }
    }

    /// What was deposited since [`Open::new`]; the state before is back.
    fn close(mut self) -> Sunk {
        self.closed = true;
        CHECK.set(self.checked_before);
        SINK.replace(self.before.take()).unwrap_or_default()
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        if !self.closed {
            CHECK.set(self.checked_before);
            SINK.set(self.before.take());
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Result, Tensor, Var};

    use crate::dispatch::{with_override, GemmPath, Override};
    use crate::{ops, Precision};

    fn fp32() -> Precision {
        Precision::Fp32
    }

    #[test]
    fn candles_missing_backwards_name_amps_replacements() -> Result<()> {
        let x = Var::from_tensor(&Tensor::ones((1, 2, 6, 6), DType::F32, &Device::Cpu)?)?;
        let x = x.as_tensor();
        let k1 = Tensor::ones((2, 3, 3), DType::F32, &Device::Cpu)?;
        let cases = [
            (x.flatten_from(2)?.conv_transpose1d(&k1, 0, 0, 1, 1, 1)?, "nn::ConvTranspose1d"),
            (x.max_pool2d_with_stride(3, 2)?, "ops::max_pool2d"),
            (x.avg_pool2d_with_stride(3, 1)?, "ops::avg_pool2d"),
            (x.upsample_bilinear2d(12, 12, false)?, "ops::upsample_bilinear2d"),
        ];
        for (y, instead) in cases {
            let err = super::backward(&y.sum_all()?).expect_err("candle 0.11.1 has no backward for it");
            let crate::Error::NoBackward { instead: named, .. } = &err else { panic!("{err}") };
            assert!(named.starts_with(instead), "{err}");
        }
        // Any other stays candle's.
        let y = x.upsample_nearest2d(9, 9)?;
        let err = super::backward(&y.sum_all()?).expect_err("candle 0.11.1: nearest by whole factors only");
        assert!(matches!(err, crate::Error::Candle(_)), "{err}");
        Ok(())
    }

    /// A weight used twice, a bias, a variable input and a variable right operand of a product.
    fn loss(x: &Var, w: &Var, b: &Var, m: &Var, r: &Tensor) -> Result<Tensor> {
        let fp32 = Precision::Fp32;
        let y = ops::linear(x, w, Some(b), fp32)?.relu()?;
        let y = ops::linear(&y, w, Some(b), fp32)?;
        (ops::matmul(&y, m, fp32)? * r)?.sum_all()
    }

    #[test]
    fn a_linear_without_bias_deposits_its_weights_gradient() -> Result<()> {
        let dev = Device::Cpu;
        let (x, w) = (
            Tensor::randn(0f32, 1.0, (5, 3), &dev)?,
            Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 3), &dev)?)?,
        );
        with_override(Override::Path(GemmPath::Portable), || -> Result<()> {
            let loss = || ops::linear(&x, &w, None, Precision::Fp32)?.sqr()?.sum_all();
            let theirs = loss()?.backward()?;
            let open = super::Open::new(true);
            let grads = loss()?.backward()?;
            let sunk = open.close();
            assert!(grads.get(w.as_tensor()).is_none(), "not through candle's store");
            let ours = &sunk.get(&w.id()).expect("deposited").grad;
            let want = theirs.get(w.as_tensor()).expect("a gradient");
            assert_eq!(ours.flatten_all()?.to_vec1::<f32>()?, want.flatten_all()?.to_vec1::<f32>()?);
            Ok(())
        })
        .expect("a valid override")
    }

    #[test]
    fn amps_pass_returns_candles_gradients_and_leaves_user_passes_alone() -> Result<()> {
        let dev = Device::Cpu;
        let var = |shape: &[usize]| Var::from_tensor(&Tensor::randn(0f32, 1.0, shape, &dev)?);
        let (x, w, b, m) = (var(&[5, 3])?, var(&[3, 3])?, var(&[3])?, var(&[3, 2])?);
        let r = Tensor::randn(0f32, 1.0, (5, 2), &dev)?;
        with_override(Override::Path(GemmPath::Portable), || -> Result<()> {
            let theirs = loss(&x, &w, &b, &m, &r)?.backward()?;
            let ours = super::backward(&loss(&x, &w, &b, &m, &r)?)?;
            for v in [&x, &w, &b, &m] {
                let get = |g: &candle_core::backprop::GradStore| -> Result<Vec<f32>> {
                    g.get(v.as_tensor()).expect("a gradient").flatten_all()?.to_vec1()
                };
                assert_eq!(get(&ours)?, get(&theirs)?, "shape {:?}", v.shape());
            }
            // Every one of them went through the sink, none through candle's store.
            let open = super::Open::new(true);
            let grads = loss(&x, &w, &b, &m, &r)?.backward()?;
            let sunk = open.close();
            for v in [&x, &w, &b, &m] {
                assert!(sunk.contains_key(&v.id()) && grads.get(v.as_tensor()).is_none());
            }
            // A gradient deposited once was checked (all finite here); the weight's and the bias's are
            // sums of two deposits (each is used twice), which are not.
            let (grads, checked) = super::backward_checked(&loss(&x, &w, &b, &m, &r)?)?;
            let named =
                [&x, &w, &b, &m].map(|v| checked.contains(grads.get(v.as_tensor()).expect("a gradient")));
            assert_eq!(named, [true, false, false, true]);
            // A NaN in the last product's right operand reaches every gradient before it (x's), not
            // its own (`y^T r`).
            let poisoned = Var::from_tensor(&m.as_tensor().affine(1.0, f64::NAN)?)?;
            let (grads, checked) = super::backward_checked(&loss(&x, &w, &b, &poisoned, &r)?)?;
            assert!(!checked.contains(grads.get(x.as_tensor()).expect("a gradient")), "x's gradient is NaN");
            assert!(checked.contains(grads.get(poisoned.as_tensor()).expect("a gradient")));
            let twice = |x: &Var| -> Result<Tensor> {
                let y = ops::matmul(x, &x.as_tensor().t()?, fp32())?;
                (y + x.as_tensor().matmul(&x.as_tensor().t()?)?)?.sum_all()
            };
            let (grads, checked) = super::backward_checked(&twice(&x)?)?;
            assert!(!checked.contains(grads.get(x.as_tensor()).expect("a gradient")), "a sum is not checked");
            // The scaler's other passes (`backward`) do not check.
            let open = super::Open::new(false);
            loss(&x, &w, &b, &m, &r)?.backward()?;
            assert!(open.close().values().all(|deposit| !deposit.finite), "checked unasked");
            // Closed again: a variable's gradient goes back to candle.
            assert!(super::deposit(w.as_tensor(), w.as_tensor().ones_like()?)?.is_some());
            Ok(())
        })
        .expect("a valid override")
    }

    /// On the paths whose products outrun memory (the bf16 dot and tile kernels; here their models,
    /// which run anywhere) an f32 weight's gradient is written past the caches and checked as the GEMM
    /// writes it: the same bits as the product on its own, found finite, and not when `x` holds a NaN.
    /// C of 300 x 40 takes three of the AMX kernel's blocks.
    #[test]
    fn a_weights_gradient_from_a_bf16_product_is_checked_as_the_gemm_writes_it() -> Result<()> {
        use amp_kernels::gemm::{gemm_new, Compute, Dims, MatRef, NewOutput, OutputType};
        let dev = Device::Cpu;
        let (rows, inputs, outputs) = (37, 40, 300);
        let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, (outputs, inputs), &dev)?)?;
        let r = Tensor::randn(0f32, 1.0, (rows, outputs), &dev)?;
        let weight = ops::Operand::of(w.as_tensor());
        for path in [GemmPath::AmxBf16Model, GemmPath::Avx512Bf16Model] {
            for poisoned in [false, true] {
                let mut xs = Tensor::randn(0f32, 1.0, rows * inputs, &dev)?.to_vec1::<f32>()?;
                if poisoned {
                    xs[3 * inputs + 7] = f32::NAN;
                }
                let x = Tensor::from_vec(xs.clone(), (rows, inputs), &dev)?;
                with_override(Override::Path(path), || -> Result<()> {
                    let y = ops::linear_to(
                        &x,
                        &weight,
                        None,
                        Precision::Bf16,
                        DType::F32,
                        ops::Epilogue::Identity,
                    )?;
                    let (grads, checked) = super::backward_checked(&(y * &r)?.sum_all()?)?;
                    let dw = grads.get(w.as_tensor()).expect("a gradient");
                    assert_eq!(checked.contains(dw), !poisoned, "{path:?} poisoned {poisoned}");
                    let rs = r.flatten_all()?.to_vec1::<f32>()?;
                    // dY^T x, dY = r: r's rows read as columns.
                    let r_t = MatRef {
                        data: (&rs[..]).into(),
                        row_stride: 1,
                        col_stride: outputs,
                        batch_stride: 0,
                    };
                    let x_rows = MatRef::row_major(&xs[..], inputs);
                    let dims = Dims::new(outputs, inputs, rows);
                    let want = gemm_new(path, dims, r_t, x_rows, OutputType::F32, Compute::Bf16, None);
                    let Ok(NewOutput::F32(want)) = want else { panic!("an f32 product") };
                    let bits = |v: &[f32]| {
                        v.iter().map(|x| if x.is_nan() { u32::MAX } else { x.to_bits() }).collect::<Vec<_>>()
                    };
                    assert_eq!(bits(&dw.flatten_all()?.to_vec1::<f32>()?), bits(&want), "{path:?}");
                    Ok(())
                })
                .expect("a valid override")?;
            }
        }
        Ok(())
    }

    /// Given running sums, the pass leaves no gradient in the store for a weight that only amp's
    /// Linears use (both of them added into its sum), gives back the other variables' gradients bit for
    /// bit, and the sum holds its start plus the weight's gradient (within f32's rounding of the terms'
    /// order), on every kernel this CPU runs; outside such a pass nothing is added, and a half weight's
    /// gradient is never added (it is rounded to half first).
    #[test]
    fn a_linear_adds_its_weights_gradient_into_the_sum_it_is_given() -> Result<()> {
        let dev = Device::Cpu;
        let var = |shape: &[usize]| Var::from_tensor(&Tensor::randn(0f32, 1.0, shape, &dev)?);
        let (x, w, b, m) = (var(&[5, 3])?, var(&[3, 3])?, var(&[3])?, var(&[3, 2])?);
        let r = Tensor::randn(0f32, 1.0, (5, 2), &dev)?;
        for path in GemmPath::supported() {
            with_override(Override::Path(path), || -> Result<()> {
                let want = super::backward(&loss(&x, &w, &b, &m, &r)?)?;
                let want_w = want.get(w.as_tensor()).expect("a gradient").flatten_all()?.to_vec1::<f32>()?;
                for start in [0.0f32, 0.75] {
                    let sum = Tensor::full(start, (3, 3), &dev)?;
                    let sums = [(w.id(), sum.clone())].into_iter().collect();
                    let grads = super::backward_adding(&loss(&x, &w, &b, &m, &r)?, sums)?;
                    assert!(grads.get(w.as_tensor()).is_none(), "{path}: w's gradient added into its sum");
                    for v in [&x, &b, &m] {
                        let (ours, theirs) = (grads.get(v.as_tensor()), want.get(v.as_tensor()));
                        let [ours, theirs] = [ours, theirs].map(|g| g.expect("a gradient").flatten_all());
                        assert_eq!(ours?.to_vec1::<f32>()?, theirs?.to_vec1::<f32>()?, "{path}");
                    }
                    // Each Linear's products are added into the sum as they come, where the pass
                    // without sums adds the two Linears' gradients: the same terms, summed in another
                    // order (a few roundings of the largest gradient's size).
                    let got = sum.flatten_all()?.to_vec1::<f32>()?;
                    let largest = want_w.iter().fold(0f32, |m, g| m.max(g.abs()));
                    let bound = 8.0 * f32::EPSILON * (start + largest);
                    for (g, w) in got.iter().zip(&want_w) {
                        assert!((g - (start + w)).abs() <= bound, "{path}: {g} against {start} + {w}");
                    }
                }
                // After that pass, a pass given no sums writes none of them.
                let sum = Tensor::zeros((3, 3), DType::F32, &dev)?;
                let sums = [(w.id(), sum.clone())].into_iter().collect();
                super::backward_adding(&loss(&x, &w, &b, &m, &r)?, sums)?;
                let after = sum.flatten_all()?.to_vec1::<f32>()?;
                let grads = super::backward(&loss(&x, &w, &b, &m, &r)?)?;
                assert!(grads.get(w.as_tensor()).is_some(), "{path}: w's gradient returned");
                assert_eq!(sum.flatten_all()?.to_vec1::<f32>()?, after, "{path}: a sum written afterwards");
                assert!(super::sum_for(w.as_tensor()).is_none());
                // A half weight's gradient is rounded to half (as its route asks), not added into the
                // sum in f32: it comes back in the store and the sum stays as it was.
                let w16 = Var::from_tensor(&w.as_tensor().to_dtype(DType::BF16)?)?;
                let half_loss = ops::linear(&x, &w16, None, Precision::Bf16)?.sqr()?.sum_all()?;
                let sum = Tensor::zeros((3, 3), DType::F32, &dev)?;
                let grads =
                    super::backward_adding(&half_loss, [(w16.id(), sum.clone())].into_iter().collect())?;
                let g = grads.get(w16.as_tensor()).expect("a half weight's gradient in the store");
                assert_eq!(g.dtype(), DType::BF16, "{path}");
                assert_eq!(sum.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0, "{path}: a half gradient added");
                Ok(())
            })
            .expect("a supported path")?;
        }
        Ok(())
    }
}
