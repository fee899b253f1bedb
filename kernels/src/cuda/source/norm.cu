// Multi-tensor L2 norms, deterministic: stage 1 writes one f64 partial sum of squares per block (a fixed
// tree within the block), stage 2 sums each tensor's partials in block order and the tensors in a fixed
// tree. The same launch configuration always gives the same bits. Stage 1 doubles as the overflow check:
// a non-finite gradient marks *bad_tensor, so clipping needs no separate pass.
// Lists: 0 = gradients; `lists` says how many the table has, so an optimizer's table serves as is.

template <typename G> __device__ double amp_sum_squares_chunk(const amp_block& blk, const G* grad, bool* bad) {
    double acc = 0.0;
    for (amp_i64 i = blk.begin + threadIdx.x; i < blk.end; i += AMP_THREADS) {
        const float x = amp_to_f32(grad[i]);
        acc += (double)x * (double)x;
        *bad |= !amp_is_finite(x);
    }
    return acc;
}

// Stage 1: partials[b] = sum of squares of block b's chunk.
extern "C" __global__ void __launch_bounds__(AMP_THREADS)
    amp_sum_squares(const amp_u64* table, int n, int lists, double* partials, int* bad_tensor) {
    const amp_block blk = amp_this_block(table, n, lists);
    double acc = 0.0;
    bool bad = false;
#define AMP_CALL(G) acc = amp_sum_squares_chunk<G>(blk, amp_ptr<const G>(table, n, 0, blk.tensor), &bad)
    AMP_SWITCH_GRAD(amp_grad_kind(table, n, lists, blk.tensor), AMP_CALL)
#undef AMP_CALL
    const double total = amp_block_sum(acc);
    if (threadIdx.x == 0) partials[blockIdx.x] = total;
    amp_flag_bad(bad_tensor, __syncthreads_or(bad), blk.tensor);
}

// Stage 2, one block of AMP_THREADS threads. `first_block[t]` is the first block of tensor t, with
// first_block[n] the number of blocks. Writes per_tensor[t] = sqrt(sum_t) * |inv_scale| and
// out[0] = the global norm times |inv_scale|, out[1] = the factor the optimizer multiplies gradients by:
// inv_scale times the clip coefficient min(1, max_norm / (norm + 1e-6)) (computed in f64, as the CPU
// does), or inv_scale alone when max_norm <= 0. A global norm that overflows f32 while every element is
// finite is as much an overflow as an infinite element: *bad_tensor becomes n when still unset.
extern "C" __global__ void __launch_bounds__(AMP_THREADS) amp_norm_finish(
    const amp_u64* first_block, int n, const double* partials, const float* inv_scale, float max_norm,
    float* per_tensor, float* out, int* bad_tensor) {
    const double s = fabs((double)*inv_scale);
    double mine = 0.0;
    for (int t = threadIdx.x; t < n; t += AMP_THREADS) {
        double sum = 0.0;
        for (amp_u64 b = first_block[t]; b < first_block[t + 1]; ++b) sum += partials[b];
        if (per_tensor != 0) per_tensor[t] = (float)(sqrt(sum) * s);
        mine += sum;
    }
    const double total = amp_block_sum(mine);
    if (threadIdx.x == 0) {
        const float norm = (float)(sqrt(total) * s);
        out[0] = norm;
        float factor = *inv_scale;
        if (max_norm > 0.0f) {
            double coef = (double)max_norm / ((double)norm + 1e-6);
            coef = coef > 1.0 ? 1.0 : coef;
            factor = *inv_scale * (float)coef;
        }
        out[1] = factor;
        if (!amp_is_finite(norm)) atomicMin(bad_tensor, n);
    }
}
