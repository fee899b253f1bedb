//! Rotary position embeddings with a backward: candle-nn's `rotary_emb::rope`, `rope_i` and `rope_thd`
//! take the same arguments, but their kernels have none, so a model that rotates its queries and keys
//! with them trains neither projection (candle 0.11; amp's first-step check names such parameters).
//!
//! On the CPU one op each way ([`amp_kernels::rope`]): the forward rotation, and backward the inverse
//! rotation of the output's gradient, in f32 with half rows widened exactly and rounded once (candle-nn's
//! kernels round each product and sum in bf16 or f16). In f32 the forward values are candle-nn's, bit
//! for bit. Elsewhere (CUDA, f64), or where `cos` or `sin` are themselves being differentiated, the
//! same rotation is written with differentiable candle ops in f32.

use amp_kernels::rope::{Direction, Pairing, Rope, RowOrder};
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor, D};

use super::elementwise::{elements, f32_elements, new_storage_in_blocks, part};

/// Rotates `xs`, `(batch, heads, positions, d)`, pairing value `i` of each row with value `i + d / 2`
/// (GPT-NeoX and Llama's layout), by the angles whose cosines and sines `cos` and `sin` hold:
/// `(positions.., d / 2)` shared by the batch (rows from the first position on), or
/// `(batch, positions, d / 2)`. The result has `xs`'s dtype; differentiable.
///
/// ```
/// use amp_runtime::ops;
/// use candle_core::{Device, Tensor};
///
/// let x = Tensor::new(&[[[[1f32, 2.0, 3.0, 4.0]]]], &Device::Cpu)?; // 1 sequence, 1 head, 1 position
/// let (cos, sin) = (Tensor::new(&[[0f32, 1.0]], &Device::Cpu)?, Tensor::new(&[[1f32, 0.0]], &Device::Cpu)?);
/// // Pair (1, 3) turned a quarter, pair (2, 4) not at all.
/// assert_eq!(ops::rope(&x, &cos, &sin)?.flatten_all()?.to_vec1::<f32>()?, [-3.0, 2.0, 1.0, 4.0]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn rope(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rotary("rope", Pairing::Halves, RowOrder::HeadsThenPositions, xs, cos, sin)
}

/// [`rope`] pairing value `2i` with value `2i + 1` (the original paper's and GPT-J's layout;
/// candle-nn's `rope_i`).
pub fn rope_i(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rotary("rope_i", Pairing::Adjacent, RowOrder::HeadsThenPositions, xs, cos, sin)
}

/// [`rope`] on `xs` laid out `(batch, positions, heads, d)` (candle-nn's `rope_thd`).
pub fn rope_thd(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rotary("rope_thd", Pairing::Halves, RowOrder::PositionsThenHeads, xs, cos, sin)
}

/// The angle tables of [`rope`]: `cos` and `sin` of `p * base^(-2i / d)` for positions `p < positions`
/// and pairs `i < d / 2`, `(positions, d / 2)` each, f32 (the defaults of Llama, Mistral and GPT-NeoX
/// with `base` 10,000 or their `rope_theta`).
///
/// The angles are computed in f64 and each value rounded once to f32. Computed in f32, as
/// candle-transformers' models do, an angle at position 100,000 is already off by up to 0.004 radians
/// (half an f32 spacing at 1e5), and so are its cosine and sine.
pub fn rope_tables(positions: usize, d: usize, base: f64, device: &Device) -> Result<(Tensor, Tensor)> {
    if d == 0 || !d.is_multiple_of(2) {
        candle_core::bail!("rope_tables: a head of {d} values is not whole pairs");
    }
    let frequencies: Vec<f64> = (0..d / 2).map(|i| base.powf(-2.0 * i as f64 / d as f64)).collect();
    rope_tables_of(positions, &frequencies, device)
}

/// [`rope_tables`] for given frequencies (radians per position, one per pair): Llama 3's scaled ones,
/// for example.
pub fn rope_tables_of(positions: usize, frequencies: &[f64], device: &Device) -> Result<(Tensor, Tensor)> {
    let table = |f: fn(f64) -> f64| -> Vec<f32> {
        (0..positions).flat_map(|p| frequencies.iter().map(move |&w| f(p as f64 * w) as f32)).collect()
    };
    let shape = (positions, frequencies.len());
    Ok((Tensor::from_vec(table(f64::cos), shape, device)?, Tensor::from_vec(table(f64::sin), shape, device)?))
}

/// The shape of a rotation, checked: the op's parameters but the angle tables.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    pairing: Pairing,
    order: RowOrder,
    batch: usize,
    heads: usize,
    positions: usize,
    d: usize,
    per_sequence: bool,
}

impl Geometry {
    /// The shape of `xs` and the angle tables, or an error that says what to pass.
    fn of(
        what: &str,
        pairing: Pairing,
        order: RowOrder,
        xs: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<Self> {
        let layout = match order {
            RowOrder::HeadsThenPositions => "(batch, heads, positions, d)",
            RowOrder::PositionsThenHeads => "(batch, positions, heads, d)",
        };
        let &[batch, a, b, d] = xs.dims() else {
            candle_core::bail!("{what}: x has shape {:?}; it takes {layout}", xs.dims());
        };
        let (heads, positions) = match order {
            RowOrder::HeadsThenPositions => (a, b),
            RowOrder::PositionsThenHeads => (b, a),
        };
        if d == 0 || !d.is_multiple_of(2) {
            candle_core::bail!("{what}: a head of {d} values (x's last dimension) is not whole pairs");
        }
        if cos.dims() != sin.dims() {
            candle_core::bail!(
                "{what}: cos has shape {:?} but sin {:?}; give both one shape",
                cos.dims(),
                sin.dims()
            );
        }
        let per_sequence = match *cos.dims() {
            [rows, half] if half * 2 == d && rows >= positions => false,
            [seqs, rows, half] if seqs == batch && half * 2 == d && rows >= positions => true,
            _ => candle_core::bail!(
                "{what}: x {layout} = {:?} needs cos and sin of shape (at least {positions}, {}) or ({batch}, at \
                 least {positions}, {}), got {:?}",
                xs.dims(),
                d / 2,
                d / 2,
                cos.dims()
            ),
        };
        Ok(Geometry { pairing, order, batch, heads, positions, d, per_sequence })
    }

    /// An angle table as the kernel reads it: f32, contiguous, `positions` rows a sequence.
    fn table(&self, t: &Tensor) -> Result<Tensor> {
        let t = if self.per_sequence { t.narrow(1, 0, self.positions)? } else { t.clone() };
        t.to_dtype(DType::F32)?.contiguous()
    }
}

fn rotary(
    what: &str,
    pairing: Pairing,
    order: RowOrder,
    xs: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let geometry = Geometry::of(what, pairing, order, xs, cos, sin)?;
    let kernel_runs = xs.device().is_cpu() && matches!(xs.dtype(), DType::F32 | DType::F16 | DType::BF16);
    if !kernel_runs || cos.track_op() || sin.track_op() {
        return composed(geometry, xs, cos, sin);
    }
    let (cos, sin) = (geometry.table(cos)?, geometry.table(sin)?);
    xs.contiguous()?.apply_op3(&cos, &sin, RopeOp { geometry, direction: Direction::Forward })
}

/// The rotation with differentiable candle ops, in f32, the result in `xs`'s dtype.
fn composed(g: Geometry, xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = g.d / 2;
    let x = xs.to_dtype(if xs.dtype() == DType::F64 { DType::F64 } else { DType::F32 })?;
    // The tables broadcast over x's dimensions: (1 or batch, .., positions, .., half).
    let table = |t: &Tensor| -> Result<Tensor> {
        let t = if g.per_sequence { t.narrow(1, 0, g.positions)? } else { t.narrow(0, 0, g.positions)? };
        let t = t.to_dtype(x.dtype())?;
        let seqs = if g.per_sequence { g.batch } else { 1 };
        let t = match g.order {
            RowOrder::HeadsThenPositions => t.reshape((seqs, 1, g.positions, half))?,
            RowOrder::PositionsThenHeads => t.reshape((seqs, g.positions, 1, half))?,
        };
        match g.pairing {
            Pairing::Halves => Ok(t),
            Pairing::Adjacent => t.unsqueeze(D::Minus1),
        }
    };
    let (c, s) = (table(cos)?, table(sin)?);
    let y = match g.pairing {
        Pairing::Halves => {
            let (x1, x2) = (x.narrow(D::Minus1, 0, half)?, x.narrow(D::Minus1, half, half)?);
            let y1 = (x1.broadcast_mul(&c)? - x2.broadcast_mul(&s)?)?;
            let y2 = (x1.broadcast_mul(&s)? + x2.broadcast_mul(&c)?)?;
            Tensor::cat(&[y1, y2], D::Minus1)?
        }
        Pairing::Adjacent => {
            let dims = x.dims();
            let pairs = x.reshape((dims[0], dims[1], dims[2], half, 2))?;
            let (x1, x2) = (pairs.narrow(D::Minus1, 0, 1)?, pairs.narrow(D::Minus1, 1, 1)?);
            let y1 = (x1.broadcast_mul(&c)? - x2.broadcast_mul(&s)?)?;
            let y2 = (x1.broadcast_mul(&s)? + x2.broadcast_mul(&c)?)?;
            Tensor::cat(&[y1, y2], D::Minus1)?.reshape(dims)?
        }
    };
    y.to_dtype(xs.dtype())
}

/// `(x, cos, sin) -> x rotated`, in `x`'s dtype; backward, the inverse rotation of the gradient.
#[derive(Clone, Copy, Debug)]
struct RopeOp {
    geometry: Geometry,
    direction: Direction,
}

impl CustomOp3 for RopeOp {
    fn name(&self) -> &'static str {
        match self.direction {
            Direction::Forward => "amp-rope",
            Direction::Inverse => "amp-rope-backward",
        }
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let g = self.geometry;
        let x = elements(s1, l1)?;
        let cos = f32_elements(s2, l2, "amp rope's cos")?;
        let sin = f32_elements(s3, l3, "amp rope's sin")?;
        let rope = Rope {
            pairing: g.pairing,
            order: g.order,
            heads: g.heads,
            positions: g.positions,
            d: g.d,
            cos,
            sin,
            per_sequence: g.per_sequence,
        };
        // Blocks of whole rows, about 8 Ki values each.
        let block = g.d * (8192 / g.d).max(1);
        let y = new_storage_in_blocks(x.dtype(), x.len(), block, |at, y| {
            rope.rotate(self.direction, part(x, at, y.len()), at / g.d, y);
        });
        Ok((y, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // The tables are untracked here: `rotary` composes the rotation of tracked ones.
        let inverse = RopeOp { direction: Direction::Inverse, ..*self };
        let dx = grad.to_dtype(x.dtype())?.contiguous()?.apply_op3_no_bwd(cos, sin, &inverse)?;
        Ok((Some(dx), None, None))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    fn tables(rows: usize, half: usize) -> Result<(Tensor, Tensor)> {
        let angles = Tensor::arange(0u32, (rows * half) as u32, &Device::Cpu)?.to_dtype(DType::F32)?;
        let angles = (angles * 0.37)?.reshape((rows, half))?;
        Ok((angles.cos()?, angles.sin()?))
    }

    /// In f32 the forward values are candle-nn's, bit for bit, for each variant, with more rows of angles
    /// than positions and with angles per sequence. (Per-sequence tables must have exactly `positions`
    /// rows for candle-nn: with more, its kernels read the next sequence's angles from the rows past the
    /// first sequence's `positions`; amp reads each sequence's first `positions` rows.)
    #[test]
    fn forward_is_candle_nns_bit_for_bit_in_f32() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 2.0, (2, 3, 5, 8), &dev)?;
        let (cos, sin) = tables(7, 4)?;
        let (cos3, sin3) =
            (Tensor::stack(&[&cos.narrow(0, 0, 5)?; 2], 0)?, Tensor::stack(&[&sin.narrow(0, 0, 5)?; 2], 0)?);
        let bits = |t: Tensor| -> Result<Vec<u32>> {
            Ok(t.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
        };
        for (c, s) in [(&cos, &sin), (&cos3, &sin3)] {
            assert_eq!(bits(rope(&x, c, s)?)?, bits(candle_nn::rotary_emb::rope(&x, c, s)?)?, "rope");
            assert_eq!(bits(rope_i(&x, c, s)?)?, bits(candle_nn::rotary_emb::rope_i(&x, c, s)?)?, "rope_i");
            // (batch, positions, heads, d) with the 5 positions of the tables per sequence.
            let x = x.transpose(1, 2)?.contiguous()?;
            assert_eq!(bits(rope_thd(&x, c, s)?)?, bits(candle_nn::rotary_emb::rope_thd(&x, c, s)?)?, "thd");
        }
        Ok(())
    }

    /// The op and the composed rotation agree, forward and backward, and tracked tables get gradients
    /// (through the composed rotation).
    #[test]
    fn the_op_agrees_with_the_composed_rotation_and_tracked_tables_get_gradients() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 2.0, (2, 3, 5, 8), &dev)?)?;
        let r = Tensor::randn(0f32, 1.0, (2, 3, 5, 8), &dev)?;
        let (cos, sin) = tables(5, 4)?;
        for variant in [rope, rope_i, rope_thd] {
            let ours = variant(x.as_tensor(), &cos, &sin)?;
            let (c, s) = (Var::from_tensor(&cos)?, Var::from_tensor(&sin)?);
            let composed = variant(x.as_tensor(), c.as_tensor(), s.as_tensor())?;
            let diff = |a: &Tensor, b: &Tensor| -> Result<f32> {
                (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar()
            };
            assert!(diff(&ours, &composed)? < 1e-6);
            let g1 = (ours * &r)?.sum_all()?.backward()?;
            let g2 = (composed * &r)?.sum_all()?.backward()?;
            let (dx1, dx2) = (g1.get(x.as_tensor()).expect("ours"), g2.get(x.as_tensor()).expect("composed"));
            assert!(diff(dx1, dx2)? < 1e-6);
            assert!(g2.get(c.as_tensor()).is_some() && g2.get(s.as_tensor()).is_some(), "tables' gradients");
        }
        Ok(())
    }

    /// Far along a sequence the tables hold the f64 cosine and sine rounded once; from angles rounded
    /// to f32 first, the cosines at position 123,456 are off by up to 3.4e-3.
    #[test]
    fn tables_far_along_a_sequence_are_rounded_once_from_f64() -> Result<()> {
        let (positions, d, base) = (123_457, 64, 10_000.0);
        let (cos, sin) = rope_tables(positions, d, base, &Device::Cpu)?;
        assert_eq!((cos.dims(), sin.dims()), ([positions, d / 2].as_slice(), [positions, d / 2].as_slice()));
        let last = |t: &Tensor| -> Result<Vec<f32>> { t.get(positions - 1)?.to_vec1() };
        let (cos_row, sin_row) = (last(&cos)?, last(&sin)?);
        let p = (positions - 1) as f64;
        let mut worst_f32_angle = 0f64;
        for i in 0..d / 2 {
            let w = base.powf(-2.0 * i as f64 / d as f64);
            assert_eq!(cos_row[i], (p * w).cos() as f32, "cos pair {i}");
            assert_eq!(sin_row[i], (p * w).sin() as f32, "sin pair {i}");
            let angle32 = f64::from(p as f32 * w as f32);
            worst_f32_angle = worst_f32_angle.max((angle32.cos() - (p * w).cos()).abs());
        }
        eprintln!("cosines from f32 angles: off by up to {worst_f32_angle:e}");
        assert!(worst_f32_angle > 1e-4, "f32 angles: {worst_f32_angle:e}");
        let odd = rope_tables(4, 7, base, &Device::Cpu).expect_err("odd d").to_string();
        assert!(odd.contains("not whole pairs"), "{odd}");
        Ok(())
    }

    #[test]
    fn shapes_that_do_not_fit_are_refused_with_what_to_pass() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::zeros((2, 3, 5, 8), DType::F32, &dev)?;
        let (cos, sin) = tables(5, 4)?;
        let message = |r: Result<Tensor>| r.expect_err("refused").to_string();
        let short = message(rope(&x, &cos.narrow(0, 0, 4)?, &sin.narrow(0, 0, 4)?));
        assert!(short.contains("(at least 5, 4)"), "{short}");
        let odd = message(rope(&Tensor::zeros((2, 3, 5, 7), DType::F32, &dev)?, &cos, &sin));
        assert!(odd.contains("not whole pairs"), "{odd}");
        let (empty_cos, empty_sin) =
            (Tensor::zeros((5, 0), DType::F32, &dev)?, Tensor::zeros((5, 0), DType::F32, &dev)?);
        let empty = message(rope(&Tensor::zeros((2, 3, 5, 0), DType::F32, &dev)?, &empty_cos, &empty_sin));
        assert!(empty.contains("a head of 0 values"), "{empty}");
        // No positions: nothing to rotate, an empty result.
        let none = rope(&Tensor::zeros((2, 3, 0, 8), DType::F32, &dev)?, &cos, &sin)?;
        assert_eq!(none.dims(), [2, 3, 0, 8]);
        let rank = message(rope_thd(&x.flatten_to(1)?, &cos, &sin));
        assert!(rank.contains("(batch, positions, heads, d)"), "{rank}");
        let mismatched = message(rope(&x, &cos, &sin.narrow(0, 0, 4)?));
        assert!(mismatched.contains("give both one shape"), "{mismatched}");
        Ok(())
    }
}
