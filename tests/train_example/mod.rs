//! The main job's binary (examples/train), built (or found up to date) by cargo with the calling test's
//! profile and the `mpi` feature where the test has it, so that every test of one `cargo test` run
//! shares one build.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The path of the example binary, after building it.
pub fn built() -> Result<PathBuf, Box<dyn std::error::Error>> {
    let exe = std::env::current_exe()?;
    let profile_dir =
        exe.parent().and_then(Path::parent).ok_or("test binary outside target/<profile>/deps")?;
    let target_dir = profile_dir.parent().ok_or("profile directory outside a target directory")?;
    let mut cargo = Command::new(env!("CARGO"));
    cargo
        .args(["build", "--locked", "--quiet", "--example", "train"])
        .arg("--manifest-path")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
        .arg("--target-dir")
        .arg(target_dir);
    if cfg!(feature = "mpi") {
        cargo.args(["--features", "mpi"]);
    }
    if profile_dir.file_name().is_some_and(|name| name == "release") {
        cargo.arg("--release");
    }
    let status = cargo.status()?;
    assert!(status.success(), "building the train example failed: {status}");
    Ok(profile_dir.join("examples").join("train"))
}
