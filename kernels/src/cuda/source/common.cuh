// Shared by every amp kernel family: prepended to each family's source before NVRTC compiles it, so the
// sources need no include paths and no CUDA headers (NVRTC ships none of cuda_fp16.h / cuda_bf16.h).
//
// Multi-tensor launches (in the spirit of Apex's multi_tensor_apply) read one table in device memory,
// built by the host and reused while its addresses stay the same:
//
//   table[l * n + t]             pointer of tensor t in list l (0 where a list is absent), l < lists
//   table[lists * n + t]         element count of tensor t
//   table[lists * n + n + t]     element types of tensor t: gradient in bits 0-7, working copy in 8-15,
//                                optimizer state in 16-23 (AMP_KIND_*), so one launch serves tensors of
//                                mixed precisions
//   table[lists * n + 2n + 3b]   block b: tensor index, first element, one past the last element
//
// Every block handles one chunk (at most 64 Ki elements) of one tensor; blocks of a tensor are consecutive
// and in element order, so per-block partial sums can be reduced deterministically. A block's types are
// uniform, so the per-block type switch costs no divergence.
//
// Arithmetic mirrors the CPU reference (amp_kernels::reference) operation by operation; the host compiles
// with -fmad=false and IEEE division and square root, so elementwise results match it bit for bit.
//
// With AMP_CPU_EMULATION defined, the half conversions come from kernels/tests/emulation/cuda_emulation.h
// instead of inline PTX, so tests/cuda_emulated/ can run these sources as C++ on the CPU.

#define AMP_THREADS 512
#define AMP_NO_BAD_TENSOR 0x7fffffff
#define AMP_KIND_F32 0
#define AMP_KIND_F16 1
#define AMP_KIND_BF16 2

typedef unsigned long long amp_u64;
typedef long long amp_i64;

struct amp_f16 {
    unsigned short bits;
};
struct amp_bf16 {
    unsigned short bits;
};

__device__ __forceinline__ float amp_to_f32(float x) { return x; }
__device__ __forceinline__ float amp_to_f32(amp_f16 x) {
#ifdef AMP_CPU_EMULATION
    return amp_emu_f16_to_f32(x.bits);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
#endif
}
__device__ __forceinline__ float amp_to_f32(amp_bf16 x) { return __uint_as_float(((unsigned int)x.bits) << 16); }

template <typename T> __device__ __forceinline__ T amp_from_f32(float x);
template <> __device__ __forceinline__ float amp_from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ amp_f16 amp_from_f32<amp_f16>(float x) {
    amp_f16 h;
#ifdef AMP_CPU_EMULATION
    h.bits = amp_emu_f32_to_f16(x);
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
#endif
    return h;
}
template <> __device__ __forceinline__ amp_bf16 amp_from_f32<amp_bf16>(float x) {
    amp_bf16 h;
#ifdef AMP_CPU_EMULATION
    h.bits = amp_emu_f32_to_bf16(x);
#else
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
#endif
    return h;
}

__device__ __forceinline__ bool amp_is_finite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

// The chunk this block owns.
struct amp_block {
    int tensor;
    amp_i64 begin;
    amp_i64 end;
};

__device__ __forceinline__ amp_block amp_this_block(const amp_u64* table, int n, int lists) {
    const amp_u64* entry = table + (amp_i64)lists * n + 2 * (amp_i64)n + 3 * (amp_i64)blockIdx.x;
    amp_block b;
    b.tensor = (int)entry[0];
    b.begin = (amp_i64)entry[1];
    b.end = (amp_i64)entry[2];
    return b;
}

// Pointer of tensor `t` in list `l`, or null where the list is absent for that tensor.
template <typename T> __device__ __forceinline__ T* amp_ptr(const amp_u64* table, int n, int l, int t) {
    return reinterpret_cast<T*>(table[(amp_i64)l * n + t]);
}

__device__ __forceinline__ int amp_grad_kind(const amp_u64* table, int n, int lists, int t) {
    return (int)(table[(amp_i64)lists * n + n + t] & 0xff);
}

__device__ __forceinline__ int amp_working_kind(const amp_u64* table, int n, int lists, int t) {
    return (int)((table[(amp_i64)lists * n + n + t] >> 8) & 0xff);
}

__device__ __forceinline__ int amp_state_kind(const amp_u64* table, int n, int lists, int t) {
    return (int)((table[(amp_i64)lists * n + n + t] >> 16) & 0xff);
}

// The word of tensor `t` in list `l`, for lists that hold numbers rather than addresses.
__device__ __forceinline__ amp_u64 amp_word(const amp_u64* table, int n, int l, int t) {
    return table[(amp_i64)l * n + t];
}

// ---- Stochastic rounding of optimizer state to bf16: amp_kernels::stochastic, bit for bit ----------------

__device__ __forceinline__ unsigned int amp_mix(unsigned int x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    return x ^ (x >> 16);
}

// stream_key(words[0..count]).
__device__ __forceinline__ unsigned int amp_stream_key(const amp_u64* words, int count) {
    unsigned int key = 0x2545f491u;
    for (int i = 0; i < count; ++i) {
        key = amp_mix(amp_mix(key ^ (unsigned int)words[i]) ^ (unsigned int)(words[i] >> 32));
    }
    return key;
}

// random_bits(key, index).
__device__ __forceinline__ unsigned int amp_random_bits(unsigned int key, amp_u64 index) {
    const unsigned int high = (unsigned int)(index >> 32);
    const unsigned int block_key = high == 0 ? key : amp_mix(key ^ high * 0x9e3779b9u);
    return amp_mix((unsigned int)index ^ block_key);
}

// round_bf16(x, r): the low 16 bits of r added to x's pattern, the top 16 kept; NaN made quiet as `half`.
__device__ __forceinline__ amp_bf16 amp_round_bf16_stochastic(float x, unsigned int r) {
    const unsigned int b = __float_as_uint(x);
    amp_bf16 h;
    h.bits = (b & 0x7fffffffu) > 0x7f800000u ? (unsigned short)((b >> 16) | 0x0040u)
                                              : (unsigned short)((b + (r & 0xffffu)) >> 16);
    return h;
}

// Optimizer state of element type S: f32, or bf16 rounded stochastically when stored.
template <typename S> struct amp_state_rounds {
    static const bool value = false;
};
template <> struct amp_state_rounds<amp_bf16> {
    static const bool value = true;
};

// Element i's random bits for state S (0 when S does not round: nothing is drawn).
template <typename S> __device__ __forceinline__ unsigned int amp_state_random(unsigned int key, amp_i64 i) {
    return amp_state_rounds<S>::value ? amp_random_bits(key, (amp_u64)i) : 0u;
}

__device__ __forceinline__ float amp_state_load(const float* s, amp_i64 i) { return s[i]; }
__device__ __forceinline__ float amp_state_load(const amp_bf16* s, amp_i64 i) { return amp_to_f32(s[i]); }

// Stores x (bf16: rounded with the low 16 bits of `random`) and returns the value stored.
__device__ __forceinline__ float amp_state_store(float* s, amp_i64 i, float x, unsigned int) {
    s[i] = x;
    return x;
}
__device__ __forceinline__ float amp_state_store(amp_bf16* s, amp_i64 i, float x, unsigned int random) {
    const amp_bf16 h = amp_round_bf16_stochastic(x, random);
    s[i] = h;
    return amp_to_f32(h);
}

// Runs BODY with the type S naming the optimizer-state element type of kind `s`.
#define AMP_WITH_STATE(s, BODY)                                                                             \
    if ((s) == AMP_KIND_BF16) {                                                                             \
        typedef amp_bf16 S;                                                                                 \
        BODY                                                                                                \
    } else {                                                                                                \
        typedef float S;                                                                                    \
        BODY                                                                                                \
    }

// CALL(G) with G the gradient element type of kind `g`.
#define AMP_SWITCH_GRAD(g, CALL)                                                                            \
    switch (g) {                                                                                            \
    case AMP_KIND_F16: CALL(amp_f16); break;                                                                \
    case AMP_KIND_BF16: CALL(amp_bf16); break;                                                              \
    default: CALL(float); break;                                                                            \
    }

// CALL(W) with W the working-copy element type of kind `w` (an absent copy takes the f16 branch; its
// pointer is null and never written).
#define AMP_SWITCH_WORKING(w, CALL)                                                                         \
    if ((w) == AMP_KIND_BF16) {                                                                             \
        CALL(amp_bf16);                                                                                     \
    } else {                                                                                                \
        CALL(amp_f16);                                                                                      \
    }

// CALL(G, W) for both.
#define AMP_SWITCH_GRAD_WORKING(g, w, CALL)                                                                 \
    switch (g) {                                                                                            \
    case AMP_KIND_F16: if ((w) == AMP_KIND_BF16) CALL(amp_f16, amp_bf16); else CALL(amp_f16, amp_f16); break; \
    case AMP_KIND_BF16: if ((w) == AMP_KIND_BF16) CALL(amp_bf16, amp_bf16); else CALL(amp_bf16, amp_f16); break; \
    default: if ((w) == AMP_KIND_BF16) CALL(float, amp_bf16); else CALL(float, amp_f16); break;              \
    }

// Sum over the block, in a fixed tree order (deterministic for a fixed AMP_THREADS). Every thread of the
// block must call it; every thread gets the total.
__device__ __forceinline__ double amp_block_sum(double x) {
    __shared__ double lanes[AMP_THREADS];
    lanes[threadIdx.x] = x;
    __syncthreads();
    for (unsigned int half = AMP_THREADS / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) lanes[threadIdx.x] += lanes[threadIdx.x + half];
        __syncthreads();
    }
    double total = lanes[0];
    __syncthreads();
    return total;
}

// Marks `tensor` as holding a non-finite value; the smallest index wins, whatever the block order.
__device__ __forceinline__ void amp_flag_bad(int* bad_tensor, bool any_bad_in_block, int tensor) {
    if (any_bad_in_block && threadIdx.x == 0) atomicMin(bad_tensor, tensor);
}

// True when this step must be skipped: a previous kernel of the step found a non-finite value.
__device__ __forceinline__ bool amp_step_is_skipped(const int* bad_tensor) {
    return *(volatile const int*)bad_tensor != AMP_NO_BAD_TENSOR;
}
