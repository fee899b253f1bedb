//! The wine-quality comparison of `examples/wine_quality.rs`, shorter: fp16 and bf16 AMP reach the
//! held-out accuracy of fp32 from the same seeded weights with the same hyper-parameters.
//!
//! Tolerance: 320 held-out wines, so one wine is 0.3 points; rounding differences of half precision
//! flip the predictions of wines near a decision boundary. 4 points (13 wines) bounds that with margin,
//! while a run that failed to learn would sit near the 43% majority baseline, 20 points lower.

#[path = "../examples/wine_quality.rs"]
#[allow(dead_code)]
mod wine;

#[test]
fn mixed_precision_matches_fp32_accuracy_on_wine_quality() -> amp::Result<()> {
    let data = wine::load(7)?;
    let weights = wine::initial_weights(11)?;
    let results: Vec<_> = wine::runs()
        .into_iter()
        .map(|run| Ok((run.name, wine::train(&weights, &data, run, 150)?)))
        .collect::<amp::Result<_>>()?;
    let fp32 = results[0].1;
    println!("baseline {:.3}; {results:?}", data.majority_baseline);
    assert!(fp32.test_accuracy > data.majority_baseline + 0.1, "fp32 learns: {fp32:?}");
    for (name, outcome) in &results[1..] {
        let gap = (outcome.test_accuracy - fp32.test_accuracy).abs();
        assert!(
            gap <= 0.04,
            "{name}: accuracy {:.3} vs fp32 {:.3}",
            outcome.test_accuracy,
            fp32.test_accuracy
        );
        assert!(
            (outcome.train_loss - fp32.train_loss).abs() < 0.1 * fp32.train_loss,
            "{name}: {outcome:?} vs {fp32:?}"
        );
    }
    Ok(())
}
