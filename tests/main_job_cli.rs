//! The main job's command line (examples/train) as a user meets it: bad input is refused at once, before
//! any training, by a message that names what is wrong and what is accepted; never a `Debug` dump.

mod train_example;

use std::path::Path;
use std::process::{Command, Output};

type Outcome = Result<(), Box<dyn std::error::Error>>;

fn train(args: &[&str], out: &Path) -> Result<Output, Box<dyn std::error::Error>> {
    let exe = train_example::built()?;
    Ok(Command::new(exe).args(["--size", "tiny"]).args(args).arg("--out").arg(out).output()?)
}

fn refusal(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn an_output_folder_that_cannot_be_made_is_refused_before_training() -> Outcome {
    // A folder inside a file: no user's permissions make that creatable (root's included).
    let file =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("main_job_cli_file_{}", std::process::id()));
    std::fs::write(&file, b"not a folder")?;
    let out = file.join("out");
    let output = train(&[], &out)?;
    let (stdout, stderr) = refusal(&output);
    std::fs::remove_file(&file)?;
    assert_eq!(output.status.code(), Some(1), "{stdout}{stderr}");
    let want = format!("error: --out {}: cannot create the folder: ", out.display());
    assert!(stderr.starts_with(&want), "{stderr}");
    assert!(!stderr.contains("Os {"), "a Debug dump: {stderr}");
    // Refused before the first step: no progress line, no table.
    assert!(!stdout.contains("step") && !stdout.contains("tokens/s"), "{stdout}");
    Ok(())
}

#[test]
fn an_unknown_precision_is_refused_with_the_names_accepted() -> Outcome {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("main_job_cli_{}", std::process::id()));
    let output = train(&["--precision", "fp32,bf17"], &out)?;
    let (stdout, stderr) = refusal(&output);
    assert!(!output.status.success(), "{stdout}{stderr}");
    assert!(
        stderr.contains("unknown precision `bf17`") && stderr.contains("expected one of fp32"),
        "{stderr}"
    );
    assert!(!out.exists(), "nothing written for a refused command");
    Ok(())
}

#[test]
#[cfg(target_os = "linux")]
fn an_output_folder_that_cannot_be_written_is_refused_before_training() -> Outcome {
    // sysfs refuses a new file in its root to every user, root included: a folder that exists (so
    // creating it succeeds) but takes no files.
    let out = Path::new("/sys");
    if !out.is_dir() {
        eprintln!("skipped: no /sys here");
        return Ok(());
    }
    let output = train(&[], out)?;
    let (stdout, stderr) = refusal(&output);
    assert_eq!(output.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stderr.starts_with("error: --out /sys: cannot write files there: "), "{stderr}");
    assert!(!stdout.contains("step") && !stdout.contains("tokens/s"), "{stdout}");
    Ok(())
}
