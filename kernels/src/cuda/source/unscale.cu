// Multi-tensor unscale and non-finite check: g = g * inv_scale for every gradient, in place, rounding to the
// gradient's dtype; the smallest index of a tensor holding a stored non-finite value goes to *bad_tensor
// (left untouched when all are finite). The scale is read from device memory: no host round trip.
// Lists: 0 = gradients.

template <typename G>
__device__ void amp_unscale(const amp_u64* table, int n, const float* inv_scale, int* bad_tensor) {
    const amp_block blk = amp_this_block(table, n, 1);
    G* grad = amp_ptr<G>(table, n, 0, blk.tensor);
    const float s = *inv_scale;
    bool bad = false;
    for (amp_i64 i = blk.begin + threadIdx.x; i < blk.end; i += AMP_THREADS) {
        const G stored = amp_from_f32<G>(amp_to_f32(grad[i]) * s);
        grad[i] = stored;
        bad |= !amp_is_finite(amp_to_f32(stored));
    }
    amp_flag_bad(bad_tensor, __syncthreads_or(bad), blk.tensor);
}

// Finds non-finite values without changing anything (the check of an already unscaled step).
template <typename G>
__device__ void amp_find_non_finite(const amp_u64* table, int n, int* bad_tensor) {
    const amp_block blk = amp_this_block(table, n, 1);
    const G* grad = amp_ptr<const G>(table, n, 0, blk.tensor);
    bool bad = false;
    for (amp_i64 i = blk.begin + threadIdx.x; i < blk.end; i += AMP_THREADS) {
        bad |= !amp_is_finite(amp_to_f32(grad[i]));
    }
    amp_flag_bad(bad_tensor, __syncthreads_or(bad), blk.tensor);
}

#define AMP_UNSCALE(NAME, G)                                                                                \
    extern "C" __global__ void __launch_bounds__(AMP_THREADS)                                               \
        amp_unscale_##NAME(const amp_u64* table, int n, const float* inv_scale, int* bad_tensor) {          \
        amp_unscale<G>(table, n, inv_scale, bad_tensor);                                                    \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(AMP_THREADS)                                               \
        amp_find_non_finite_##NAME(const amp_u64* table, int n, int* bad_tensor) {                          \
        amp_find_non_finite<G>(table, n, bad_tensor);                                                       \
    }

AMP_UNSCALE(f32, float)
AMP_UNSCALE(f16, amp_f16)
AMP_UNSCALE(bf16, amp_bf16)
