// Fused LAMB in three launches over one table, none of which the host waits for:
//   1. amp_lamb_moments: inline unscale, L2 or decoupled weight decay, new m and v, and per-block f64
//      partial sums of p^2 and u^2 (u = the Adam direction plus decoupled decay);
//   2. amp_lamb_ratios: per-tensor norms (partials summed in block order: deterministic) and the
//      learning rate times the trust ratio ||p|| / ||u|| of each tensor;
//   3. amp_lamb_apply: p -= ratio * u, and the working copy.
// Every launch returns at once when *bad_tensor says the step overflowed.
// bf16 moments (the state kind of the table) are rounded stochastically when stored, element i with
// random_bits(stream_key([stream, t]), i), its low half for m, its high half for v, and u is computed from
// the rounded values, the ones amp_lamb_apply reads back.
// Lists: 0 grad, 1 master, 2 exp_avg, 3 exp_avg_sq, 4 working copy (or null), 5 the tensor's random
// stream (a number).
// Formulas and rounding order: amp_kernels::reference::lamb_step, lamb_step_bf16_state.

struct amp_lamb_consts {
    float bc1, bc2, beta1, beta2, beta3, one_minus_beta2, eps, wd;
};

__device__ __forceinline__ amp_lamb_consts amp_lamb_setup(const amp_i64* steps, double beta1, double beta2,
                                                          double eps, double weight_decay, int bias_correction,
                                                          int grad_averaging) {
    const double t = (double)(*steps + 1);
    amp_lamb_consts c;
    c.bc1 = bias_correction ? (float)(1.0 - pow(beta1, t)) : 1.0f;
    c.bc2 = bias_correction ? (float)(1.0 - pow(beta2, t)) : 1.0f;
    c.beta1 = (float)beta1;
    c.beta2 = (float)beta2;
    c.beta3 = grad_averaging ? (float)(1.0 - beta1) : 1.0f;
    c.one_minus_beta2 = (float)(1.0 - beta2);
    c.eps = (float)eps;
    c.wd = (float)weight_decay;
    return c;
}

__device__ __forceinline__ float amp_lamb_update(const amp_lamb_consts& c, int decoupled, float p, float m,
                                                 float v) {
    const float u = (m / c.bc1) / (sqrtf(v / c.bc2) + c.eps);
    return (decoupled && c.wd != 0.0f) ? u + c.wd * p : u;
}

template <typename G, typename S>
__device__ void amp_lamb_moments_chunk(const amp_block& blk, const amp_u64* table, int n, const amp_i64* steps,
                                       const amp_lamb_consts& c, int decoupled, float factor, double* sum_p,
                                       double* sum_u) {
    const G* grad = amp_ptr<const G>(table, n, 0, blk.tensor);
    const float* master = amp_ptr<const float>(table, n, 1, blk.tensor);
    S* exp_avg = amp_ptr<S>(table, n, 2, blk.tensor);
    S* exp_avg_sq = amp_ptr<S>(table, n, 3, blk.tensor);
    const amp_u64 key_words[2] = {amp_word(table, n, 5, blk.tensor), (amp_u64)(*steps + 1)};
    const unsigned int key = amp_stream_key(key_words, 2);
    for (amp_i64 i = blk.begin + threadIdx.x; i < blk.end; i += AMP_THREADS) {
        const float p = master[i];
        float g = amp_to_f32(grad[i]) * factor;
        if (!decoupled && c.wd != 0.0f) g += c.wd * p;
        const float m = amp_state_load(exp_avg, i) * c.beta1 + c.beta3 * g;
        const float v = amp_state_load(exp_avg_sq, i) * c.beta2 + (c.one_minus_beta2 * g) * g;
        const unsigned int random = amp_state_random<S>(key, i);
        const float kept_m = amp_state_store(exp_avg, i, m, random);
        const float kept_v = amp_state_store(exp_avg_sq, i, v, random >> 16);
        const double u = (double)amp_lamb_update(c, decoupled, p, kept_m, kept_v);
        *sum_p += (double)p * (double)p;
        *sum_u += u * u;
    }
}

extern "C" __global__ void __launch_bounds__(AMP_THREADS)
    amp_lamb_moments(const amp_u64* table, int n, const amp_i64* steps, const int* bad_tensor,
                     const float* grad_factor, double beta1, double beta2, double eps, double weight_decay,
                     int decoupled, int bias_correction, int grad_averaging, double* partials) {
    if (amp_step_is_skipped(bad_tensor)) return;
    const amp_block blk = amp_this_block(table, n, 6);
    const amp_lamb_consts c =
        amp_lamb_setup(steps, beta1, beta2, eps, weight_decay, bias_correction, grad_averaging);
    const float factor = *grad_factor;
    double sum_p = 0.0, sum_u = 0.0;
    const int g = amp_grad_kind(table, n, 6, blk.tensor);
#define AMP_CALL(G) amp_lamb_moments_chunk<G, S>(blk, table, n, steps, c, decoupled, factor, &sum_p, &sum_u)
    AMP_WITH_STATE(amp_state_kind(table, n, 6, blk.tensor), AMP_SWITCH_GRAD(g, AMP_CALL))
#undef AMP_CALL
    const double block_p = amp_block_sum(sum_p);
    const double block_u = amp_block_sum(sum_u);
    if (threadIdx.x == 0) {
        partials[2 * (amp_i64)blockIdx.x] = block_p;
        partials[2 * (amp_i64)blockIdx.x + 1] = block_u;
    }
}

// One thread per tensor (any grid). norms[2t] = ||p||, norms[2t+1] = ||u||; ratios[t] = lr * ||p|| / ||u||
// when the trust ratio applies (weight decay or always_adapt, both norms non-zero), else lr.
extern "C" __global__ void amp_lamb_ratios(const amp_u64* first_block, int n, const int* bad_tensor,
                                           const double* partials, double lr, double weight_decay,
                                           int always_adapt, float* norms, float* ratios) {
    if (amp_step_is_skipped(bad_tensor)) return;
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    double sum_p = 0.0, sum_u = 0.0;
    for (amp_u64 b = first_block[t]; b < first_block[t + 1]; ++b) {
        sum_p += partials[2 * b];
        sum_u += partials[2 * b + 1];
    }
    const float norm_p = (float)sqrt(sum_p), norm_u = (float)sqrt(sum_u);
    norms[2 * t] = norm_p;
    norms[2 * t + 1] = norm_u;
    const float lr_f = (float)lr;
    const bool adapt = (always_adapt || weight_decay != 0.0) && norm_p != 0.0f && norm_u != 0.0f;
    ratios[t] = adapt ? lr_f * (norm_p / norm_u) : lr_f;
}

template <typename W, typename S>
__device__ void amp_lamb_apply_chunk(const amp_block& blk, const amp_u64* table, int n, const amp_lamb_consts& c,
                                     int decoupled, float ratio) {
    float* master = amp_ptr<float>(table, n, 1, blk.tensor);
    const S* exp_avg = amp_ptr<const S>(table, n, 2, blk.tensor);
    const S* exp_avg_sq = amp_ptr<const S>(table, n, 3, blk.tensor);
    W* working = amp_ptr<W>(table, n, 4, blk.tensor);
    for (amp_i64 i = blk.begin + threadIdx.x; i < blk.end; i += AMP_THREADS) {
        const float p = master[i];
        const float m = amp_state_load(exp_avg, i), v = amp_state_load(exp_avg_sq, i);
        const float next = p - ratio * amp_lamb_update(c, decoupled, p, m, v);
        master[i] = next;
        if (working != 0) working[i] = amp_from_f32<W>(next);
    }
}

extern "C" __global__ void __launch_bounds__(AMP_THREADS)
    amp_lamb_apply(const amp_u64* table, int n, const amp_i64* steps, const int* bad_tensor, double beta1,
                   double beta2, double eps, double weight_decay, int decoupled, int bias_correction,
                   const float* ratios) {
    if (amp_step_is_skipped(bad_tensor)) return;
    const amp_block blk = amp_this_block(table, n, 6);
    const amp_lamb_consts c = amp_lamb_setup(steps, beta1, beta2, eps, weight_decay, bias_correction, 1);
    const int w = amp_working_kind(table, n, 6, blk.tensor);
#define AMP_CALL(W) amp_lamb_apply_chunk<W, S>(blk, table, n, c, decoupled, ratios[blk.tensor])
    AMP_WITH_STATE(amp_state_kind(table, n, 6, blk.tensor), AMP_SWITCH_WORKING(w, AMP_CALL))
#undef AMP_CALL
}
