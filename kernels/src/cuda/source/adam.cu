// Fused Adam / AdamW over fp32 master weights and fp32 or bf16 moments: reads the (scaled) gradient in its own
// dtype, unscales (and clips) it inline with the factor in device memory, updates m, v (and max v for
// AMSGrad) and the master, and writes the f16 / bf16 working copy in the same pass. Returns at once when
// *bad_tensor says this step overflowed: no host synchronisation to decide whether to skip.
// The step number lives on the device (`steps`: applied steps before this one), so bias correction stays
// right when steps are skipped without the host knowing.
// bf16 moments (the state kind of the table) are rounded stochastically when stored, element i with
// random_bits(stream_key([stream, t]), i), its low half for m, its high half for v; the master's update
// reads the unrounded moments. No AMSGrad with bf16 moments (the host refuses it).
// Lists: 0 grad, 1 master, 2 exp_avg, 3 exp_avg_sq, 4 max_exp_avg_sq (or null), 5 working copy (or null),
// 6 the tensor's random stream (a number).
// Formulas and rounding order: amp_kernels::reference::adam_step, adam_step_bf16_state.

template <typename G, typename W, typename S>
__device__ void amp_adam_chunk(const amp_block& blk, const amp_u64* table, int n, const amp_i64* steps,
                               const float* grad_factor, double lr, double beta1, double beta2, double eps,
                               double weight_decay, int decoupled, int bias_correction) {
    const G* grad = amp_ptr<const G>(table, n, 0, blk.tensor);
    float* master = amp_ptr<float>(table, n, 1, blk.tensor);
    S* exp_avg = amp_ptr<S>(table, n, 2, blk.tensor);
    S* exp_avg_sq = amp_ptr<S>(table, n, 3, blk.tensor);
    float* max_exp_avg_sq = amp_ptr<float>(table, n, 4, blk.tensor);
    W* working = amp_ptr<W>(table, n, 5, blk.tensor);
    const amp_u64 key_words[2] = {amp_word(table, n, 6, blk.tensor), (amp_u64)(*steps + 1)};
    const unsigned int key = amp_stream_key(key_words, 2);

    const double t = (double)(*steps + 1);
    const double bc1 = bias_correction ? 1.0 - pow(beta1, t) : 1.0;
    const double bc2 = bias_correction ? 1.0 - pow(beta2, t) : 1.0;
    const float step_size = (float)(lr / bc1);
    const float bc2_sqrt = (float)sqrt(bc2);
    const float b2 = (float)beta2, e = (float)eps, wd = (float)weight_decay;
    const float one_minus_beta1 = (float)(1.0 - beta1), one_minus_beta2 = (float)(1.0 - beta2);
    const float decay = (float)(1.0 - lr * weight_decay);
    const float factor = *grad_factor;

    for (amp_i64 i = blk.begin + threadIdx.x; i < blk.end; i += AMP_THREADS) {
        float g = amp_to_f32(grad[i]) * factor;
        float p = master[i];
        if (weight_decay != 0.0) {
            if (decoupled) {
                p *= decay;
            } else {
                g += wd * p;
            }
        }
        float m = amp_state_load(exp_avg, i);
        m = m + one_minus_beta1 * (g - m);
        const float v = amp_state_load(exp_avg_sq, i) * b2 + (one_minus_beta2 * g) * g;
        const unsigned int random = amp_state_random<S>(key, i);
        amp_state_store(exp_avg, i, m, random);
        amp_state_store(exp_avg_sq, i, v, random >> 16);
        float v_eff = v;
        if (max_exp_avg_sq != 0) {
            const float old = max_exp_avg_sq[i];
            v_eff = old > v ? old : v;
            max_exp_avg_sq[i] = v_eff;
        }
        const float denom = sqrtf(v_eff) / bc2_sqrt + e;
        p -= (step_size * m) / denom;
        master[i] = p;
        if (working != 0) working[i] = amp_from_f32<W>(p);
    }
}

extern "C" __global__ void __launch_bounds__(AMP_THREADS)
    amp_adam(const amp_u64* table, int n, const amp_i64* steps, const int* bad_tensor, const float* grad_factor,
             double lr, double beta1, double beta2, double eps, double weight_decay, int decoupled,
             int bias_correction) {
    if (amp_step_is_skipped(bad_tensor)) return;
    const amp_block blk = amp_this_block(table, n, 7);
    const int g = amp_grad_kind(table, n, 7, blk.tensor), w = amp_working_kind(table, n, 7, blk.tensor);
#define AMP_CALL(G, W)                                                                                      \
    amp_adam_chunk<G, W, S>(blk, table, n, steps, grad_factor, lr, beta1, beta2, eps, weight_decay,         \
                            decoupled, bias_correction)
    AMP_WITH_STATE(amp_state_kind(table, n, 7, blk.tensor), AMP_SWITCH_GRAD_WORKING(g, w, AMP_CALL))
#undef AMP_CALL
}
