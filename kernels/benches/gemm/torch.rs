//! PyTorch's matmul as a peer, in a child Python process (`scripts/torch_peer.py`), when
//! `AMP_BENCH_TORCH` names a Python that has PyTorch (`scripts/torch-bench.sh` sets it up). Never needed:
//! without the variable the bench runs without these columns.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use crate::{Layout, Shape};

/// The environment variable naming the Python to run PyTorch in.
const PYTHON_VAR: &str = "AMP_BENCH_TORCH";

/// A running `torch_peer.py`.
pub struct TorchPeer {
    child: Child,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
    /// What the peer said of itself: PyTorch's version and CPU capability.
    pub version: String,
}

/// A dtype PyTorch multiplies in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TorchDtype {
    Bf16,
    F32,
}

impl TorchDtype {
    fn word(self) -> &'static str {
        match self {
            TorchDtype::Bf16 => "bf16",
            TorchDtype::F32 => "f32",
        }
    }
}

impl TorchPeer {
    /// Starts the peer if `AMP_BENCH_TORCH` is set; panics with the reason if it is set and the peer
    /// cannot start (a bench asked for a column it cannot show should say so, not drop it).
    pub fn from_env() -> Option<TorchPeer> {
        let python = std::env::var_os(PYTHON_VAR)?;
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/torch_peer.py");
        let mut child = Command::new(&python)
            .arg(script)
            .env("OMP_WAIT_POLICY", "PASSIVE")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{PYTHON_VAR}={}: cannot start {script}: {e}", python.display()));
        let input = child.stdin.take().expect("piped stdin");
        let output = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut peer = TorchPeer { child, input, output, version: String::new() };
        peer.version = peer.answer();
        Some(peer)
    }

    /// Makes the shape's operands (the bench's values, stored as its layouts say).
    pub fn shape(&mut self, s: &Shape) {
        let word = |l: Layout| if l == Layout::Normal { "n" } else { "t" };
        self.send(&format!("shape {} {} {} {} {}", s.m, s.k, s.n, word(s.a), word(s.b)));
        let answer = self.answer();
        assert_eq!(answer, "ok", "torch_peer.py: {answer}");
    }

    /// One product of the current shape in `dtype`; the seconds it took, as the peer timed it.
    pub fn run(&mut self, dtype: TorchDtype) -> f64 {
        self.send(&format!("run {}", dtype.word()));
        let answer = self.answer();
        answer.parse().unwrap_or_else(|_| panic!("torch_peer.py: {answer}"))
    }

    fn send(&mut self, line: &str) {
        writeln!(self.input, "{line}").and_then(|()| self.input.flush()).expect("torch_peer.py stopped");
    }

    fn answer(&mut self) -> String {
        let mut line = String::new();
        let read = self.output.read_line(&mut line).expect("torch_peer.py's output");
        assert!(read > 0, "torch_peer.py exited (its error is above)");
        line.trim().to_string()
    }
}

impl Drop for TorchPeer {
    fn drop(&mut self) {
        let _ = writeln!(self.input, "quit");
        let _ = self.input.flush();
        let _ = self.child.wait();
    }
}
