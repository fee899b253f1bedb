"""PyTorch's CPU matmul as a peer column of the GEMM bench (`kernels/benches/gemm`).

Never run by CI or the tests: `scripts/torch-bench.sh` installs PyTorch in a local venv and starts the
bench with `AMP_BENCH_TORCH` naming that venv's Python, which makes the bench start this script as a
child and drive it over stdin/stdout, one command per line, so that PyTorch's products are timed in the
same rounds as the others (interleaved, on the same 2 cores):

    shape M K N A B    operands of a product (A is (M, K), B is (K, N)); A and B are "n" (stored
                       row-major) or "t" (stored as the transpose, read through a view, as the bench's
                       candle operands are); values as the bench's; answers "ok"
    run DTYPE          one product in DTYPE ("bf16" or "f32"); answers the seconds it took, measured
                       here with perf_counter around the call alone (the pipe's round trip stays out)
    quit

The first line written is PyTorch's version and CPU capability. PyTorch runs on 2 threads, with OpenMP
threads sleeping between products (OMP_WAIT_POLICY=PASSIVE, set by the bench), so that they do not spin
on the cores while the other contenders run.
"""

import sys
import time

import torch


def values(n, seed):
    """The bench's operand values: (((i * 2654435761) mod 2^32) ^ seed) >> 8, scaled to [-0.5, 0.5)."""
    i = torch.arange(n, dtype=torch.int64)
    bits = ((i * 2654435761) & 0xFFFFFFFF) ^ seed
    return (bits >> 8).to(torch.float64).div(1 << 24).sub(0.5).to(torch.float32)


def operand(n_rows, n_cols, layout, seed):
    data = values(n_rows * n_cols, seed)
    if layout == "n":
        return data.reshape(n_rows, n_cols)
    return data.reshape(n_cols, n_rows).t()


def main():
    torch.set_num_threads(2)
    print(f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})", flush=True)
    operands = {}
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "shape":
            m, k, n = (int(w) for w in words[1:4])
            a = operand(m, k, words[4], 1)
            b = operand(k, n, words[5], 2)
            operands = {"f32": (a, b), "bf16": (a.to(torch.bfloat16), b.to(torch.bfloat16))}
            print("ok", flush=True)
        elif words[0] == "run":
            a, b = operands[words[1]]
            start = time.perf_counter()
            c = a @ b
            seconds = time.perf_counter() - start
            del c
            print(f"{seconds:.9f}", flush=True)
        elif words[0] == "quit":
            return
        else:
            print(f"error: unknown command {words[0]!r}", flush=True)


if __name__ == "__main__":
    main()
