//! Every diagnostic of `#[derive(AmpModule)]` and every accepted form, compiled with trybuild.
//! Refresh the `.stderr` snapshots with `TRYBUILD=overwrite`, then read each one.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    for category in [
        "half_on_fp32_layer",
        "unknown_precision",
        "duplicate_attribute",
        "conflicting_attribute",
        "misplaced_attribute",
        "not_a_module",
        "unsupported_item",
        "several_errors",
        "loss_scaling",
    ] {
        t.compile_fail(format!("tests/ui/{category}/*.rs"));
    }
}
