//! The derive (a proc-macro crate, which can export no constant) and the runtime list the same
//! precision spellings: the derive's error, pinned by the ui test's expected output, must contain the
//! runtime's `PrecisionSpec::SPELLINGS`.

#[test]
fn the_derive_lists_the_spellings_the_runtime_accepts() {
    let derive_error = include_str!("ui/unknown_precision/field_precision.stderr");
    assert!(
        derive_error.contains(amp::PrecisionSpec::SPELLINGS),
        "PrecisionSpec::SPELLINGS changed: update SPELLINGS_HELP in amp-macros/src/symbol.rs and the ui outputs"
    );
}
