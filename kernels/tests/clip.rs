//! Clipping by value: both paths against the reference, bit for bit, on every dtype and tail length.

mod common;

use amp_kernels::clip::clip_by_value_with;
use amp_kernels::{reference, Dtype, Isa};
use common::{assert_same_owned, tensor_set, views_mut, Owned, Rng, DTYPES};

#[test]
fn clip_by_value_matches_the_reference_and_keeps_nan() {
    let mut rng = Rng(51);
    for isa in Isa::supported() {
        for dtype in DTYPES {
            let mut ts = tensor_set(&mut rng, dtype, -4, 4);
            ts[8].set(65536, f32::NAN);
            ts[7].set(0, f32::NEG_INFINITY);
            let mut expect = ts.clone();
            clip_by_value_with(isa, &mut views_mut(&mut ts), 1.5);
            reference::clip_by_value(&mut views_mut(&mut expect), 1.5);
            for (a, b) in ts.iter().zip(&expect) {
                assert_same_owned(&format!("{isa:?} {dtype:?}"), a, b);
            }
            assert!(ts[8].get(65536).is_nan());
            assert_eq!(ts[7].get(0), -1.5);
        }
    }
}

#[test]
fn clip_by_value_known_values() {
    for isa in Isa::supported() {
        let mut t = [Owned::new(Dtype::F32, &[-3.0, -1.0, 0.5, 2.0, f32::INFINITY])];
        clip_by_value_with(isa, &mut views_mut(&mut t), 1.0);
        assert_eq!(t[0].to_f32(), [-1.0, -1.0, 0.5, 1.0, 1.0]);
    }
}
