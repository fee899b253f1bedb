//! Every diagnostic of `#[derive(AmpModule)]` and every accepted form, compiled with trybuild.
//! Refresh the `.stderr` snapshots with `TRYBUILD=overwrite`, then read each one.

#[test]
fn ui() {
    // trybuild's generated project does not inherit the workspace's profiles: without this, its builds
    // of candle and friends carry full debug info (2 GB of target/ on CI, the most of any step).
    std::env::set_var("CARGO_PROFILE_DEV_DEBUG", "false");
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
