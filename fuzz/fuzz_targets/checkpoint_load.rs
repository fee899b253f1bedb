//! `amp::checkpoint::load_with` on arbitrary bytes (seeded with real checkpoints and their mutations
//! from `tests/corpus/checkpoint/`): it must return, and a refusal must name the file and change
//! nothing (`tests/corpus/checkpoint_case.rs`). A panic, an abort, an allocation over libFuzzer's
//! `-malloc_limit_mb` or a broken promise is a finding.
#![no_main]

#[path = "../../tests/corpus/checkpoint_case.rs"]
mod checkpoint_case;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    thread_local! {
        static FILE: std::path::PathBuf =
            std::env::temp_dir().join(format!("amp-fuzz-{}.safetensors", std::process::id()));
    }
    FILE.with(|file| {
        if let Err(broken) = checkpoint_case::check_case(bytes, file) {
            panic!("{broken}");
        }
    });
});
