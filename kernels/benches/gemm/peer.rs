//! Peers timed in a child process, driven over stdin and stdout one command per line (the protocol is
//! `scripts/torch_peer.py`'s), each only when its environment variable is set; without them the bench
//! runs without their columns:
//!
//! - `AMP_BENCH_TORCH` names a Python that has PyTorch: its bf16 and f32 matmul
//!   (`scripts/torch_peer.py`; `scripts/torch-bench.sh` sets it up).
//! - `AMP_BENCH_CANDLE_X86_V4` names the `candle-x86-v4-peer` binary: candle's f32 matmul built with
//!   its `gemm` dependency's `x86-v4` feature, AVX-512 kernels that candle's default build leaves out
//!   (`bench-peers/candle-x86-v4/`; `scripts/candle-x86-v4-bench.sh` builds it). A child process,
//!   because that feature would change the candle of this build, whose default is a column of its own.
//!
//! A peer is not run on a shape where its speed on the last shape it ran says a product would take
//! more than `PEER_PRODUCT_LIMIT_S` (PyTorch's bf16 on an AVX2-only CPU); the table says so.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use crate::{Layout, Shape};

/// A running peer.
pub struct ChildPeer {
    name: &'static str,
    child: Child,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
    /// What the peer said of itself (its version, what its kernels run on).
    pub version: String,
}

/// A dtype a peer multiplies in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerDtype {
    Bf16,
    F32,
}

impl PeerDtype {
    fn word(self) -> &'static str {
        match self {
            PeerDtype::Bf16 => "bf16",
            PeerDtype::F32 => "f32",
        }
    }
}

impl ChildPeer {
    /// PyTorch's matmul, if `AMP_BENCH_TORCH` is set.
    pub fn torch_from_env() -> Option<ChildPeer> {
        let python = std::env::var_os("AMP_BENCH_TORCH")?;
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/torch_peer.py");
        let mut command = Command::new(&python);
        // OpenMP's threads sleep between products instead of spinning on the cores the others use.
        command.arg(script).env("OMP_WAIT_POLICY", "PASSIVE");
        Some(ChildPeer::start("torch_peer.py", "AMP_BENCH_TORCH", python, command))
    }

    /// candle's f32 matmul with `gemm`'s `x86-v4` kernels, if `AMP_BENCH_CANDLE_X86_V4` is set.
    pub fn candle_x86_v4_from_env() -> Option<ChildPeer> {
        let binary = std::env::var_os("AMP_BENCH_CANDLE_X86_V4")?;
        let command = Command::new(&binary);
        Some(ChildPeer::start("candle-x86-v4-peer", "AMP_BENCH_CANDLE_X86_V4", binary, command))
    }

    /// Starts `command`; panics with the reason if it cannot start (a bench asked for a column it
    /// cannot show should say so, not drop it).
    fn start(name: &'static str, var: &str, value: OsString, mut command: Command) -> ChildPeer {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{var}={}: cannot start {name}: {e}", value.display()));
        let input = child.stdin.take().expect("piped stdin");
        let output = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut peer = ChildPeer { name, child, input, output, version: String::new() };
        peer.version = peer.answer();
        peer
    }

    /// Makes the shape's operands (the bench's values, stored as its layouts say).
    pub fn shape(&mut self, s: &Shape) {
        let word = |l: Layout| if l == Layout::Normal { "n" } else { "t" };
        self.send(&format!("shape {} {} {} {} {}", s.m, s.k, s.n, word(s.a), word(s.b)));
        let answer = self.answer();
        assert_eq!(answer, "ok", "{}: {answer}", self.name);
    }

    /// One product of the current shape in `dtype`; the seconds it took, as the peer timed it.
    pub fn run(&mut self, dtype: PeerDtype) -> f64 {
        self.send(&format!("run {}", dtype.word()));
        let answer = self.answer();
        answer.parse().unwrap_or_else(|_| panic!("{}: {answer}", self.name))
    }

    fn send(&mut self, line: &str) {
        let sent = writeln!(self.input, "{line}").and_then(|()| self.input.flush());
        sent.unwrap_or_else(|e| panic!("{} stopped: {e}", self.name));
    }

    fn answer(&mut self) -> String {
        let mut line = String::new();
        let read = self.output.read_line(&mut line).unwrap_or_else(|e| panic!("{}'s output: {e}", self.name));
        assert!(read > 0, "{} exited (its error is above)", self.name);
        line.trim().to_string()
    }
}

impl Drop for ChildPeer {
    fn drop(&mut self) {
        let _ = writeln!(self.input, "quit");
        let _ = self.input.flush();
        let _ = self.child.wait();
    }
}
