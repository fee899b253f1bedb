// Multi-tensor unscale and non-finite check: g = g * inv_scale for every gradient, in place, rounding to the
// gradient's dtype; the smallest index of a tensor holding a stored non-finite value goes to *bad_tensor
// (left untouched when all are finite). The scale is read from device memory: no host round trip.
// Lists: 0 = gradients; `lists` says how many the table has, so an optimizer's table serves as is.

template <typename G>
__device__ bool amp_unscale_chunk(const amp_block& blk, G* grad, float s) {
    bool bad = false;
    for (amp_i64 i = blk.begin + threadIdx.x; i < blk.end; i += AMP_THREADS) {
        const G stored = amp_from_f32<G>(amp_to_f32(grad[i]) * s);
        grad[i] = stored;
        bad |= !amp_is_finite(amp_to_f32(stored));
    }
    return bad;
}

template <typename G> __device__ bool amp_find_non_finite_chunk(const amp_block& blk, const G* grad) {
    bool bad = false;
    for (amp_i64 i = blk.begin + threadIdx.x; i < blk.end; i += AMP_THREADS) {
        bad |= !amp_is_finite(amp_to_f32(grad[i]));
    }
    return bad;
}

extern "C" __global__ void __launch_bounds__(AMP_THREADS)
    amp_unscale(const amp_u64* table, int n, int lists, const float* inv_scale, int* bad_tensor) {
    const amp_block blk = amp_this_block(table, n, lists);
    const float s = *inv_scale;
    bool bad = false;
#define AMP_CALL(G) bad = amp_unscale_chunk<G>(blk, amp_ptr<G>(table, n, 0, blk.tensor), s)
    AMP_SWITCH_GRAD(amp_grad_kind(table, n, lists, blk.tensor), AMP_CALL)
#undef AMP_CALL
    amp_flag_bad(bad_tensor, __syncthreads_or(bad), blk.tensor);
}

// Finds non-finite values without changing anything (the check of a step whose optimizer unscales inline).
extern "C" __global__ void __launch_bounds__(AMP_THREADS)
    amp_find_non_finite(const amp_u64* table, int n, int lists, int* bad_tensor) {
    const amp_block blk = amp_this_block(table, n, lists);
    bool bad = false;
#define AMP_CALL(G) bad = amp_find_non_finite_chunk<G>(blk, amp_ptr<const G>(table, n, 0, blk.tensor))
    AMP_SWITCH_GRAD(amp_grad_kind(table, n, lists, blk.tensor), AMP_CALL)
#undef AMP_CALL
    amp_flag_bad(bad_tensor, __syncthreads_or(bad), blk.tensor);
}
