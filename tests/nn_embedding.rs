//! amp's embedding on the CPU, one graph node each way. The forward is candle's lookup (`index_select`
//! on the table rounded to the compute precision, then cast to the output dtype) bit for bit at every
//! level; the table's gradient is, row by row, the sum of the gradient rows that read it, formed in f32
//! in the order they come (against an f64 reference below), keyed by the fp32 master under O2 (and
//! rounded once to half under `GradientRoute::Working`); an id outside the table is refused by value.

use amp::nn::{embedding, Embedding};
use amp::{AmpConfig, AmpModule, GradientRoute, OptLevel, Precision};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};

mod common;

const VOCAB: usize = 151;
const HIDDEN: usize = 19;

#[derive(AmpModule)]
struct Lookup {
    table: Embedding,
}

fn lookup(level: OptLevel, half: Precision, route: GradientRoute) -> amp::Result<Lookup> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mut net = Lookup { table: embedding(VOCAB, HIDDEN, vb.pp("table"))? };
    net.table.weight().master().set(&common::uniform_in(3, &[VOCAB, HIDDEN], -2.0, 2.0, DType::F32)?)?;
    amp::initialize(&mut net, AmpConfig::new(level, &Device::Cpu).with_half(half))?;
    amp::set_gradient_route(&mut net, route);
    Ok(net)
}

/// 400 ids of a 151-row table (the op works in blocks of 64 rows, each way): 136 rows read, the first
/// and last of every block among them, up to 6 times; 15 rows never.
fn ids(dtype: DType) -> candle_core::Result<Tensor> {
    let ids: Vec<u32> = (0..400u32).map(|i| (i * 97 + i * i % 11) % VOCAB as u32).collect();
    Tensor::from_vec(ids, (4, 100), &Device::Cpu)?.to_dtype(dtype)
}

fn bits(t: &Tensor) -> candle_core::Result<Vec<u32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
}

const LEVELS: [(OptLevel, Precision); 5] = [
    (OptLevel::O0, Precision::Bf16),
    (OptLevel::O1, Precision::Bf16),
    (OptLevel::O2, Precision::Bf16),
    (OptLevel::O2, Precision::Fp16),
    (OptLevel::O3, Precision::Bf16),
];

#[test]
fn the_lookup_is_candles_bit_for_bit_at_every_level_as_one_graph_node() -> amp::Result<()> {
    for (level, half) in LEVELS {
        let net = lookup(level, half, GradientRoute::Master)?;
        for id_dtype in [DType::U32, DType::I64, DType::U8] {
            let ids = ids(id_dtype)?;
            let rows = net.table.forward(&ids)?;
            assert_eq!(rows.dims(), &[4, 100, HIDDEN], "{level:?} {half:?}");
            let compute = if level == OptLevel::O0 { DType::F32 } else { half.dtype() };
            let table = net.table.weight().master().as_tensor().to_dtype(compute)?;
            let want = table
                .index_select(&ids.flatten_all()?, 0)?
                .reshape((4, 100, HIDDEN))?
                .to_dtype(rows.dtype())?;
            assert_eq!(bits(&rows)?, bits(&want)?, "{level:?} {half:?} {id_dtype:?}");
            let expected_out = if level == OptLevel::O3 { half.dtype() } else { DType::F32 };
            assert_eq!(rows.dtype(), expected_out, "{level:?} {half:?}: the level's output dtype");
            if level == OptLevel::O2 {
                let nodes = rows.sorted_nodes().into_iter().filter(|t| !t.is_variable()).count();
                assert_eq!(nodes, 1, "{level:?} {half:?}: the lookup alone, no cast or reshape after it");
            }
        }
    }
    Ok(())
}

/// Each table row's gradient is the sum of the gradient rows that read it: within `count * 2^-24` of
/// the f64 sum's magnitude (an f32 sum of `count` terms), plus one rounding to half where it is half.
#[test]
fn the_gradient_sums_each_rows_reads_in_f32_onto_the_master() -> amp::Result<()> {
    let ids = ids(DType::U32)?;
    let id_list = ids.flatten_all()?.to_vec1::<u32>()?;
    let upstream = common::uniform_in(9, &[4, 100, HIDDEN], -3.0, 3.0, DType::F32)?;
    for (level, half) in LEVELS {
        for route in [GradientRoute::Master, GradientRoute::Working] {
            let net = lookup(level, half, route)?;
            let rows = net.table.forward(&ids)?;
            let grads = (rows.to_dtype(DType::F32)? * &upstream)?.sum_all()?.backward()?;
            // The rows' gradient as it reaches the op: in the rows' dtype (half under O3).
            let up =
                upstream.to_dtype(rows.dtype())?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            let grad = net.table.weight().grad("table.weight", &grads)?.expect("a table gradient");
            let master_keyed = grads.get(net.table.weight().master().as_tensor()).is_some();
            // Half only where the table itself is half and differentiated (O2's working route, O3's
            // half parameters); keyed apart from the master only under O2's working route.
            let want_dtype = match (level, route) {
                (OptLevel::O2, GradientRoute::Working) | (OptLevel::O3, _) => half.dtype(),
                _ => DType::F32,
            };
            let want_master = !(level == OptLevel::O2 && route == GradientRoute::Working);
            assert_eq!(
                (grad.dtype(), master_keyed),
                (want_dtype, want_master),
                "{level:?} {half:?} {route:?}"
            );
            let got = grad.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            let roundoff = if want_dtype == DType::F32 { 0.0 } else { common::unit_roundoff(want_dtype) };
            for (v, got_row) in got.iter().enumerate() {
                let reads: Vec<usize> = (0..id_list.len()).filter(|&i| id_list[i] as usize == v).collect();
                for (j, &got) in got_row.iter().enumerate() {
                    let terms = reads.iter().map(|&i| f64::from(up[i * HIDDEN + j]));
                    let (sum, magnitude) = terms.fold((0.0, 0.0), |(s, m), t| (s + t, m + t.abs()));
                    let bound = reads.len() as f64 * 2f64.powi(-24) * magnitude + roundoff * sum.abs();
                    let err = (f64::from(got) - sum).abs();
                    assert!(err <= bound, "{level:?} {half:?} {route:?} row {v} [{j}]: {got} vs {sum}");
                }
            }
        }
    }
    Ok(())
}

#[test]
fn an_id_outside_the_table_is_refused_by_value() -> amp::Result<()> {
    let net = lookup(OptLevel::O2, Precision::Bf16, GradientRoute::Master)?;
    let outside = Tensor::new(&[0u32, VOCAB as u32, 1], &Device::Cpu)?;
    let err = net.table.forward(&outside).expect_err("id 151 of a 151-row table").to_string();
    assert!(err.contains("id 151 (element 1 of the ids)") && err.contains("151 rows"), "{err}");
    let negative = Tensor::new(&[2i64, -1], &Device::Cpu)?;
    let err = net.table.forward(&negative).expect_err("a negative id").to_string();
    assert!(err.contains("id -1 (element 1 of the ids)"), "{err}");
    Ok(())
}
