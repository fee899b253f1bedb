//! The underflow case of `examples/loss_scaling.rs`, small and fast: most fp16 gradients flush to zero,
//! fp16 without loss scaling fails to train, fp16 with the dynamic scaler matches fp32.
//!
//! Tolerance for "matches": fp32 and scaled fp16 start from the same weights with the same data and
//! hyper-parameters and both converge towards zero loss; the scaled run must end within 10x of fp32's
//! final loss (far below where the unscaled run stalls) or below 1e-3 of the initial loss, whichever is larger.

#[path = "../examples/loss_scaling.rs"]
#[allow(dead_code)]
mod demo;

use demo::Setup;

#[test]
fn fp16_underflows_without_scaling_and_matches_fp32_with_it() -> amp::Result<()> {
    let (width, depth, steps) = (32, 3, 150);
    let (weights, x, y) = demo::problem(width, depth, 0)?;
    let flushed = demo::flush_fraction(&weights, &x, &y, width, depth)?;
    assert!(
        flushed > 0.5,
        "only {:.1}% of gradients flush in fp16: the case does not underflow",
        100.0 * flushed
    );

    let fp32 = demo::train(&weights, &x, &y, width, depth, Setup::Fp32, steps)?;
    let unscaled = demo::train(&weights, &x, &y, width, depth, Setup::Fp16Unscaled, steps)?;
    let scaled = demo::train(&weights, &x, &y, width, depth, Setup::Fp16Scaled, steps)?;
    println!("flushed {flushed:.3}; fp32 {fp32:?}; unscaled {unscaled:?}; scaled {scaled:?}");

    assert!(fp32.last < 0.05 * fp32.first, "fp32 trains: {fp32:?}");
    assert!(unscaled.last > 0.2 * unscaled.first, "fp16 without scaling should stall: {unscaled:?}");
    let bound = (10.0 * fp32.last).max(1e-3 * fp32.first);
    assert!(scaled.last < bound, "fp16 with scaling should match fp32: {scaled:?} vs {fp32:?}");
    Ok(())
}
