//! The regression corpus of bad checkpoints (`tests/corpus/checkpoint/`): the structured cases of
//! `tests/checkpoint_corruption.rs` and what the fuzzer (`scripts/fuzz.sh`) kept because it reached new
//! code or broke a promise once. Each is loaded into a fresh model with its optimizer and scaler: no
//! panic, and a refusal names the file and changes nothing. The undamaged seed loads.

#[path = "corpus/checkpoint_case.rs"]
mod checkpoint_case;

use std::path::Path;

#[test]
fn every_case_of_the_bad_checkpoint_corpus_is_refused_cleanly() -> Result<(), Box<dyn std::error::Error>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/checkpoint");
    let mut files: Vec<_> =
        std::fs::read_dir(&dir)?.map(|e| e.map(|e| e.path())).collect::<Result<_, _>>()?;
    files.sort();
    let scratch = std::env::temp_dir().join(format!("amp-corpus-{}.safetensors", std::process::id()));
    let (mut loaded, mut refused) = (Vec::new(), 0);
    for file in &files {
        let bytes = std::fs::read(file)?;
        let name = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        match checkpoint_case::check_case(&bytes, &scratch) {
            Ok(true) => loaded.push(name),
            Ok(false) => refused += 1,
            Err(broken) => panic!("{name}: {broken}"),
        }
    }
    std::fs::remove_file(&scratch).ok();
    println!(
        "bad-checkpoint corpus: {} cases, {refused} refused cleanly, {} loaded",
        files.len(),
        loaded.len()
    );
    assert!(loaded.contains(&"valid.safetensors".to_string()), "the undamaged seed loads: {loaded:?}");
    assert!(files.len() >= 90, "the corpus is in place ({} files)", files.len());
    Ok(())
}
