//! Runs a test of the calling binary on N MPI ranks: the test, started by cargo, launches
//! `mpirun -np N <this binary> --exact <test>` and checks the job; started by mpirun (the child marker
//! set), it is one rank and does that rank's work.
#![allow(dead_code)]

use std::io::Read;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use amp::distributed::{Communicator, Mpi};

/// Set by the parent in every rank's environment.
pub const CHILD: &str = "AMP_MPI_RANK_CHILD";
/// No job may take longer: mpirun ends it itself after this (`--timeout`), the parent kills it a little
/// later if it did not.
pub const JOB_TIMEOUT: Duration = Duration::from_secs(60);
/// A rank's line that starts with this is printed again by the parent (measurements to show).
pub const REPORT: &str = "amp-mpi-report:";
/// What each rank prints when its work returned: the parent counts them.
const DONE: &str = "amp-mpi-rank-done";

/// One job at a time: the ranks of parallel tests would oversubscribe the cores many times over.
static ONE_JOB: Mutex<()> = Mutex::new(());

/// How a job ended.
#[derive(Debug)]
pub struct Job {
    /// mpirun's exit status; `None` when the parent had to kill it.
    pub status: Option<ExitStatus>,
    /// From launch to exit.
    pub elapsed: Duration,
    /// Everything the ranks and mpirun printed.
    pub output: String,
}

/// True in a rank started by [`launch`].
pub fn is_rank() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// Launches `mpirun -np ranks` on the test `test` of this binary and waits, at most [`JOB_TIMEOUT`]
/// plus a grace period.
pub fn launch(test: &str, ranks: usize) -> std::io::Result<Job> {
    launch_with_env(test, ranks, &[])
}

/// [`launch`] with `env` set in every rank's environment.
pub fn launch_with_env(test: &str, ranks: usize, env: &[(&str, &str)]) -> std::io::Result<Job> {
    let _one = ONE_JOB.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let exe = std::env::current_exe()?;
    let mut command = Command::new("mpirun");
    command
        .args(["--allow-run-as-root", "--oversubscribe", "-np", &ranks.to_string()])
        .args(["--timeout", &JOB_TIMEOUT.as_secs().to_string(), "-x", CHILD])
        .args(env.iter().flat_map(|(key, _)| ["-x", key]))
        .envs(env.iter().copied())
        .arg(exe)
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = command.spawn().map_err(|e| {
        std::io::Error::new(e.kind(), format!("cannot run mpirun ({e}): install openmpi-bin (see .ci/run)"))
    })?;
    let readers = [read_all(child.stdout.take()), read_all(child.stderr.take())];
    let status = wait_until(&mut child, start + JOB_TIMEOUT + Duration::from_secs(15))?;
    let elapsed = start.elapsed();
    let output = readers.into_iter().map(|r| r.join().unwrap_or_default()).collect::<Vec<_>>().join("");
    Ok(Job { status, elapsed, output })
}

fn read_all(stream: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut stream) = stream {
            let _ = stream.read_to_string(&mut text);
        }
        text
    })
}

/// The child's status, or `None` after killing it at `deadline` (SIGTERM first, so that mpirun takes
/// its ranks down with it, SIGKILL 5 s later).
fn wait_until(child: &mut Child, deadline: Instant) -> std::io::Result<Option<ExitStatus>> {
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
            std::thread::sleep(Duration::from_secs(5));
            let _ = child.kill();
            let _ = child.wait();
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Pins the GEMM path from the CPU's features alone. Left automatic, bf16 products go to `vdpbf16ps`
/// or to the FMA path by a rate each process measures (`amp_kernels::gemm::dot_product_speedup`), and
/// the tests compare one rank's gradient of some rows with another's of the same rows bit for bit: two
/// processes must not be able to choose differently (a loaded machine could make the measurement
/// differ; once in CI a rank's bf16 gradients differed from the other's on the same rows).
fn same_kernels_on_every_rank() -> Outcome {
    use amp::dispatch::{Compute, GemmPath, Override};
    let path = GemmPath::choose_for(Compute::Bf16, amp_kernels::Isa::detect());
    amp::dispatch::set_override(Override::Path(path))?;
    Ok(())
}

/// In the parent: runs `test` on `ranks` ranks and asserts that every rank finished its work and the
/// job succeeded. In a rank: `work` on MPI's world; an error ends the whole job at once (MPI_Abort), as
/// does a panic (`Mpi` aborts when dropped while unwinding), so that no rank waits for a failed one.
pub fn on_ranks(test: &str, ranks: usize, work: impl FnOnce(&Mpi) -> Outcome) -> Outcome {
    on_ranks_with_env(test, ranks, &[], work)
}

/// [`on_ranks`] with `env` set in every rank's environment.
pub fn on_ranks_with_env(
    test: &str,
    ranks: usize,
    env: &[(&str, &str)],
    work: impl FnOnce(&Mpi) -> Outcome,
) -> Outcome {
    if is_rank() {
        let comm = Mpi::init()?;
        same_kernels_on_every_rank()?;
        if let Err(e) = work(&comm) {
            eprintln!("rank {} of `{test}` failed: {e}", comm.rank());
            comm.abort(1);
        }
        comm.barrier()?;
        println!("{DONE} {} of {}", comm.rank(), comm.world_size());
        return Ok(());
    }
    let job = launch_with_env(test, ranks, env)?;
    let done = job.output.lines().filter(|l| l.contains(DONE)).count();
    assert!(
        job.status.is_some_and(|s| s.success()) && done == ranks,
        "`{test}` on {ranks} ranks: {:?} after {:.1?}, {done} of {ranks} ranks finished:\n{}",
        job.status,
        job.elapsed,
        job.output
    );
    for line in job.output.lines().filter_map(|l| l.split_once(REPORT).map(|(_, rest)| rest.trim())) {
        println!("`{test}`: {line}");
    }
    println!("`{test}`: {ranks} ranks passed in {:.2?}", job.elapsed);
    Ok(())
}

/// The result of a test or of a rank's work.
pub type Outcome<T = ()> = Result<T, Box<dyn std::error::Error>>;
