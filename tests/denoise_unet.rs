//! The U-Net of `examples/denoise_unet.rs`, shorter: convolutions, batch norm, overlapping max pooling,
//! a transposed convolution and bilinear upsampling train in bf16 O2 and fp16 O2 as in fp32, from the
//! same seeded weights and data.
//!
//! Tolerance: after 60 steps fp32's held-out error is about a third of the noise's (0.09); the mixed
//! runs' differ from it by 0.1-0.5% in the example's runs (half rounding in every layer, the same
//! hyper-parameters). 10% of fp32's error bounds that with margin, while a run whose gradients stopped
//! anywhere (a pool or the upsampling without a backward) would stay near the noise's error.

#[path = "../examples/denoise_unet.rs"]
#[allow(dead_code)]
mod unet;

#[test]
fn the_unet_trains_in_both_half_precisions_as_in_fp32() -> amp::Result<()> {
    let (train_set, test_set) = (unet::images(128, 1)?, unet::images(64, 2)?);
    let results: Vec<_> = unet::runs()
        .into_iter()
        .map(|(name, config)| Ok((name, unet::train(0, config, &train_set, &test_set, 60)?.0)))
        .collect::<amp::Result<_>>()?;
    println!("{results:?}");
    let fp32 = results[0].1;
    let noise = f64::from(unet::NOISE * unet::NOISE) as f32;
    assert!(fp32.test_loss < 0.6 * noise, "fp32 learns to denoise: {fp32:?}");
    for (name, outcome) in &results[1..] {
        let gap = (outcome.test_loss - fp32.test_loss).abs();
        assert!(gap <= 0.1 * fp32.test_loss, "{name}: {outcome:?} vs fp32 {fp32:?}");
    }
    Ok(())
}
