// CUDA emulation for the CPU: what amp's kernel sources (kernels/src/cuda/source/*.cu, common.cuh
// prepended) need to compile as plain C++20 with g++, so tests/cuda_emulated/ can run their logic
// without a GPU. Force-included (`g++ -include`) before a family's source, with -DAMP_CPU_EMULATION,
// which makes common.cuh take its f16 / bf16 conversions from here instead of inline PTX.
//
// Execution model: the host runs one block at a time. For each block it calls `amp_emu_begin_block`
// with the block's thread count, then lets that many threads (one pool per launch, reused from block to
// block) each call `amp_emu_set_thread`, the kernel, then `amp_emu_thread_exit`, and waits until all of
// them have returned before it begins the next block. So `__shared__` can be a plain `static`, and
// `__syncthreads` is a std::barrier over the block's threads.
//
// Floating point: compile with -ffp-contract=off -fno-fast-math (what -fmad=false and IEEE div / sqrt
// give on the device); x86-64 SSE arithmetic is IEEE binary32 / binary64 with one rounding per operation.

#pragma once

#include <atomic>
#include <barrier>
#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstring>

// Everything below is hidden from other libraries: without it, g++ gives inline variables and the
// static locals of inline functions (`__shared__` arrays) STB_GNU_UNIQUE binding, and the dynamic loader
// would make every family's library share one block barrier and one `amp_block_sum` scratch array.
// Only the kernels (`__global__`) and the host's entry points (AMP_EMU_EXPORT) are exported.
#pragma GCC visibility push(hidden)

#define __global__ __attribute__((visibility("default")))
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(x)
#define __shared__ static

struct amp_emu_dim3 {
    unsigned int x, y, z;
};

static thread_local amp_emu_dim3 threadIdx = {0, 0, 0};
static thread_local amp_emu_dim3 blockIdx = {0, 0, 0};
static thread_local amp_emu_dim3 blockDim = {1, 1, 1};
static thread_local amp_emu_dim3 gridDim = {1, 1, 1};

// The barrier of the block running now (one block at a time).
static std::barrier<>* amp_emu_block_barrier = nullptr;
// The accumulator of __syncthreads_or.
static std::atomic<int> amp_emu_or_accumulator{0};

inline void __syncthreads() { amp_emu_block_barrier->arrive_and_wait(); }

// Every thread of the block must call it, as on the device. Three barriers: the first keeps the
// previous call's reset before this call's contributions, the second every contribution before the
// reads, the third every read before the reset.
inline int __syncthreads_or(int predicate) {
    __syncthreads();
    if (predicate) amp_emu_or_accumulator.fetch_or(1);
    __syncthreads();
    const int any = amp_emu_or_accumulator.load();
    __syncthreads();
    if (threadIdx.x == 0) amp_emu_or_accumulator.store(0);
    return any;
}

inline int atomicMin(int* address, int value) {
    std::atomic_ref<int> target(*address);
    int old = target.load();
    while (value < old && !target.compare_exchange_weak(old, value)) {
    }
    return old;
}

inline unsigned int __float_as_uint(float x) {
    unsigned int u;
    std::memcpy(&u, &x, sizeof u);
    return u;
}

inline float __uint_as_float(unsigned int u) {
    float x;
    std::memcpy(&x, &u, sizeof x);
    return x;
}

// The math functions the sources call (pow, sqrt, fabs on double; sqrtf, fmaxf, fminf) are the C
// library's, from <math.h>: IEEE sqrt; pow is glibc's, which may differ from CUDA's by an ulp (the
// emulation cannot tell, since Rust's f64::powf is glibc's too).

// ---- f16 / bf16 conversions (software versions of cvt.f32.f16, cvt.rn.f16.f32, cvt.rn.bf16.f32) ----

// Exact: normals, subnormals, zeros, infinities; a NaN keeps its sign and payload.
inline float amp_emu_f16_to_f32(unsigned short h) {
    const unsigned int sign = (unsigned int)(h & 0x8000u) << 16;
    unsigned int exponent = (h >> 10) & 0x1fu;
    unsigned int mantissa = h & 0x3ffu;
    if (exponent == 0x1f) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));
    if (exponent == 0) {
        if (mantissa == 0) return __uint_as_float(sign);
        // Subnormal: mantissa * 2^-24, normalised.
        int e = 1;
        while ((mantissa & 0x400u) == 0) {
            mantissa <<= 1;
            e -= 1;
        }
        return __uint_as_float(sign | ((unsigned int)(e + 112) << 23) | ((mantissa & 0x3ffu) << 13));
    }
    return __uint_as_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

// Round to nearest, ties to even; overflow gives infinity, tiny values f16 subnormals or zero; a NaN
// stays a NaN (quiet, sign and top payload bits kept).
inline unsigned short amp_emu_f32_to_f16(float x) {
    const unsigned int bits = __float_as_uint(x);
    const unsigned int sign = (bits >> 16) & 0x8000u;
    const unsigned int abs = bits & 0x7fffffffu;
    if (abs >= 0x7f800000u) {
        if (abs == 0x7f800000u) return (unsigned short)(sign | 0x7c00u);
        return (unsigned short)(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
    }
    const int e = (int)(abs >> 23) - 127;
    if (e > 15) return (unsigned short)(sign | 0x7c00u);
    if (e >= -14) {
        // Normal f16 (rounding up may carry into the exponent, up to infinity: still right).
        unsigned int h = ((unsigned int)(e + 15) << 10) | ((abs >> 13) & 0x3ffu);
        const unsigned int rest = abs & 0x1fffu;
        if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h += 1;
        return (unsigned short)(sign | h);
    }
    if (e < -25) return (unsigned short)sign;  // below half the smallest subnormal (f32 subnormals too)
    // Subnormal f16: the value is m * 2^(e - 23) with m the 24-bit significand; in units of 2^-24,
    // m >> shift with shift = -(e + 1), in 14..24.
    const unsigned int m = (abs & 0x7fffffu) | 0x800000u;
    const unsigned int shift = (unsigned int)(-(e + 1));
    unsigned int h = m >> shift;
    const unsigned int rest = m & ((1u << shift) - 1u);
    const unsigned int halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (h & 1u))) h += 1;
    return (unsigned short)(sign | h);
}

// Round to nearest, ties to even; a NaN stays a NaN (quiet, sign and top payload bits kept).
inline unsigned short amp_emu_f32_to_bf16(float x) {
    const unsigned int bits = __float_as_uint(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((bits >> 16) | 0x0040u);
    const unsigned int rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
    return (unsigned short)(rounded >> 16);
}

// ---- What the host calls ----

#define AMP_EMU_EXPORT extern "C" __attribute__((visibility("default")))

// Before a block's threads start: a barrier for `threads` threads (none may be running).
AMP_EMU_EXPORT void amp_emu_begin_block(unsigned int threads) {
    delete amp_emu_block_barrier;
    amp_emu_block_barrier = new std::barrier<>((std::ptrdiff_t)threads);
    amp_emu_or_accumulator.store(0);
}

// In each emulated thread, before it calls the kernel.
AMP_EMU_EXPORT void amp_emu_set_thread(unsigned int block, unsigned int thread, unsigned int block_threads,
                                       unsigned int grid_blocks) {
    blockIdx = {block, 0, 0};
    threadIdx = {thread, 0, 0};
    blockDim = {block_threads, 1, 1};
    gridDim = {grid_blocks, 1, 1};
}

// In each emulated thread, after the kernel returned: an exited thread no longer holds up the barriers
// of the threads still running.
AMP_EMU_EXPORT void amp_emu_thread_exit() { amp_emu_block_barrier->arrive_and_drop(); }

// The conversions, for the host to check against `half`.
AMP_EMU_EXPORT float amp_emu_test_f16_to_f32(unsigned short h) { return amp_emu_f16_to_f32(h); }
AMP_EMU_EXPORT unsigned short amp_emu_test_f32_to_f16(float x) { return amp_emu_f32_to_f16(x); }
AMP_EMU_EXPORT unsigned short amp_emu_test_f32_to_bf16(float x) { return amp_emu_f32_to_bf16(x); }
