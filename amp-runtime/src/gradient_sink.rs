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

use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, TensorId};

/// Variables and their gradients deposited so far, by variable.
type Sunk = HashMap<TensorId, (Tensor, Tensor)>;

thread_local! {
    /// `Some` while [`backward`] runs on this thread.
    static SINK: RefCell<Option<Sunk>> = const { RefCell::new(None) };
}

/// `loss.backward()`, with the gradients amp's product ops deposit merged in: what candle's pass
/// alone would return, computed with less memory traffic.
pub(crate) fn backward(loss: &Tensor) -> Result<GradStore> {
    let open = Open::new();
    let grads = loss.backward();
    let sunk = open.close();
    let mut grads = grads?;
    for (var, grad) in sunk.into_values() {
        // Another op may have given the same variable a gradient through candle's store.
        let grad = match grads.get(&var) {
            Some(other) => (other + grad)?,
            None => grad,
        };
        grads.insert(&var, grad);
    }
    Ok(grads)
}

/// The gradient `grad` of an op's argument `arg`: taken into the sink (`None`) when `arg` is a
/// variable and [`backward`] runs on this thread, else returned for candle to accumulate.
pub(crate) fn deposit(arg: &Tensor, grad: Tensor) -> Result<Option<Tensor>> {
    if !arg.is_variable() {
        return Ok(Some(grad));
    }
    SINK.with_borrow_mut(|sink| {
        let Some(sunk) = sink else { return Ok(Some(grad)) };
        // Detached as candle detaches the gradients it stores: the sink must not keep the graph alive.
        let grad = grad.detach();
        match sunk.entry(arg.id()) {
            Entry::Occupied(mut entry) => {
                let sum = (&entry.get().1 + &grad)?;
                entry.get_mut().1 = sum;
            }
            Entry::Vacant(entry) => {
                entry.insert((arg.clone(), grad));
            }
        }
        Ok(None)
    })
}

/// The sink open on this thread; dropping it unclosed (a panic in the pass) restores the state before.
struct Open {
    before: Option<Sunk>,
    closed: bool,
}

impl Open {
    fn new() -> Open {
        Open { before: SINK.replace(Some(Sunk::new())), closed: false }
    }

    /// What was deposited since [`Open::new`]; the state before is back.
    fn close(mut self) -> Sunk {
        self.closed = true;
        SINK.replace(self.before.take()).unwrap_or_default()
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        if !self.closed {
            SINK.set(self.before.take());
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Result, Tensor, Var};

    use crate::dispatch::{with_override, GemmPath, Override};
    use crate::{ops, Precision};

    /// A weight used twice, a bias, a variable input and a variable right operand of a product.
    fn loss(x: &Var, w: &Var, b: &Var, m: &Var, r: &Tensor) -> Result<Tensor> {
        let fp32 = Precision::Fp32;
        let y = ops::linear(x, w, Some(b), fp32)?.relu()?;
        let y = ops::linear(&y, w, Some(b), fp32)?;
        (ops::matmul(&y, m, fp32)? * r)?.sum_all()
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
            let open = super::Open::new();
            let grads = loss(&x, &w, &b, &m, &r)?.backward()?;
            let sunk = open.close();
            for v in [&x, &w, &b, &m] {
                assert!(sunk.contains_key(&v.id()) && grads.get(v.as_tensor()).is_none());
            }
            // Closed again: a variable's gradient goes back to candle.
            assert!(super::deposit(w.as_tensor(), w.as_tensor().ones_like()?)?.is_some());
            Ok(())
        })
        .expect("a valid override")
    }
}
