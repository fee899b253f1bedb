//! Holds the trybuild ui cases of `#[derive(AmpModule)]` under `tests/ui`.
