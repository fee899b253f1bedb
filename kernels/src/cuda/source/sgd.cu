// Fused SGD with momentum (PyTorch semantics: dampening, Nesterov, L2 weight decay) over fp32 master
// weights and an fp32 or bf16 momentum buffer, inline unscale, and the working copy written in the same
// pass. A bf16 buffer (the state kind of the table) is rounded stochastically when stored, element i with
// the low half of random_bits(stream_key([stream, t, 0x00534744]), i) (t: this step's number, from 1); the
// step reads the unrounded buffer.
// Skipped steps return at once (*bad_tensor). The momentum buffer takes the first gradient as is on the
// first applied step, which the device counter `steps` (applied steps before this one) tells.
// Lists: 0 grad, 1 master, 2 momentum buffer (or null: no momentum), 3 working copy (or null), 4 the
// tensor's random stream (a number).
// Formulas and rounding order: amp_kernels::reference::sgd_step, sgd_step_bf16_state.

template <typename G, typename W, typename S>
__device__ void amp_sgd_chunk(const amp_block& blk, const amp_u64* table, int n, const amp_i64* steps,
                              const float* grad_factor, double lr, double weight_decay, double momentum,
                              double dampening, int nesterov) {
    const G* grad = amp_ptr<const G>(table, n, 0, blk.tensor);
    float* master = amp_ptr<float>(table, n, 1, blk.tensor);
    S* buffer = amp_ptr<S>(table, n, 2, blk.tensor);
    W* working = amp_ptr<W>(table, n, 3, blk.tensor);
    const amp_u64 key_words[3] = {amp_word(table, n, 4, blk.tensor), (amp_u64)(*steps + 1), 0x00534744ull};
    const unsigned int key = amp_stream_key(key_words, 3);

    const bool first_step = *steps == 0;
    const float lr_f = (float)lr, wd = (float)weight_decay, mom = (float)momentum;
    const float one_minus_dampening = (float)(1.0 - dampening);
    const float factor = *grad_factor;

    for (amp_i64 i = blk.begin + threadIdx.x; i < blk.end; i += AMP_THREADS) {
        float d = amp_to_f32(grad[i]) * factor;
        if (weight_decay != 0.0) d += wd * master[i];
        if (buffer != 0) {
            const float b = first_step ? d : amp_state_load(buffer, i) * mom + one_minus_dampening * d;
            amp_state_store(buffer, i, b, amp_state_random<S>(key, i));
            d = nesterov ? d + mom * b : b;
        }
        const float p = master[i] - lr_f * d;
        master[i] = p;
        if (working != 0) working[i] = amp_from_f32<W>(p);
    }
}

extern "C" __global__ void __launch_bounds__(AMP_THREADS)
    amp_sgd(const amp_u64* table, int n, const amp_i64* steps, const int* bad_tensor, const float* grad_factor,
            double lr, double weight_decay, double momentum, double dampening, int nesterov) {
    if (amp_step_is_skipped(bad_tensor)) return;
    const amp_block blk = amp_this_block(table, n, 5);
    const int g = amp_grad_kind(table, n, 5, blk.tensor), w = amp_working_kind(table, n, 5, blk.tensor);
#define AMP_CALL(G, W)                                                                                      \
    amp_sgd_chunk<G, W, S>(blk, table, n, steps, grad_factor, lr, weight_decay, momentum, dampening, nesterov)
    AMP_WITH_STATE(amp_state_kind(table, n, 5, blk.tensor), AMP_SWITCH_GRAD_WORKING(g, w, AMP_CALL))
#undef AMP_CALL
}
