// The dynamic loss scale's state machine on the device, so the scaler never waits for the host in the
// steady state: the host reads the state (and so the step report) only when asked.
// Mirrors amp_runtime's ScaleState::update exactly (growth interval, backoff, hysteresis, floor, ceiling).

// Field order and types match the words of amp_kernels::cuda::ScaleState (state.rs).
struct amp_scale_state {
    float scale;
    float inv_scale;
    unsigned int growth_tracker;
    unsigned int hysteresis_left;
    unsigned long long steps;
    unsigned long long skipped;
    unsigned long long applied;
    int bad_tensor;       // written by the step's kernels; AMP_NO_BAD_TENSOR when all was finite
    int last_bad_tensor;  // bad_tensor of the most recent skipped step, kept for the report
    int last_change;      // 0 kept, 1 grew, 2 backed off, 3 tolerated (hysteresis), 4 at the floor
    unsigned int floor_hits;  // overflows at the floor so far (the host stops training on a new one)
};

#define AMP_KEPT 0
#define AMP_GREW 1
#define AMP_BACKED_OFF 2
#define AMP_TOLERATED 3
#define AMP_AT_FLOOR 4

__device__ int amp_scale_transition(amp_scale_state* s, bool overflow, int dynamic, float growth_factor,
                                    float backoff_factor, unsigned int growth_interval,
                                    unsigned int hysteresis, float min_scale, float max_scale) {
    if (!dynamic) return AMP_KEPT;
    if (overflow) {
        s->growth_tracker = 0;
        if (s->hysteresis_left > 1) {
            s->hysteresis_left -= 1;
            return AMP_TOLERATED;
        }
        if (s->scale <= min_scale) return AMP_AT_FLOOR;
        s->scale = fmaxf(s->scale * backoff_factor, min_scale);
        return AMP_BACKED_OFF;
    }
    s->growth_tracker += 1;
    if (s->growth_tracker < growth_interval) return AMP_KEPT;
    s->growth_tracker = 0;
    const float grown = s->scale * growth_factor;
    if (!amp_is_finite(grown) || s->scale >= max_scale) return AMP_KEPT;
    s->scale = fminf(grown, max_scale);
    s->hysteresis_left = hysteresis;
    return AMP_GREW;
}

// One thread. Records the step that just ran (skipped when bad_tensor is set), moves the scale, and
// clears bad_tensor for the next step. What the host's lazy report needs survives any number of steps:
// the counters, the reason of the most recent skip, and how often the floor was hit.
extern "C" __global__ void amp_scale_update(amp_scale_state* s, int dynamic, float growth_factor,
                                            float backoff_factor, unsigned int growth_interval,
                                            unsigned int hysteresis, float min_scale, float max_scale) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const bool overflow = s->bad_tensor != AMP_NO_BAD_TENSOR;
    s->steps += 1;
    if (overflow) {
        s->skipped += 1;
    } else {
        s->applied += 1;
    }
    s->last_change = amp_scale_transition(s, overflow, dynamic, growth_factor, backoff_factor,
                                          growth_interval, hysteresis, min_scale, max_scale);
    if (s->last_change == AMP_AT_FLOOR) s->floor_hits += 1;
    s->inv_scale = 1.0f / s->scale;
    if (overflow) s->last_bad_tensor = s->bad_tensor;
    s->bad_tensor = AMP_NO_BAD_TENSOR;
}

// One thread. Counts an applied step of one optimizer (its bias correction and first-step logic read it).
extern "C" __global__ void amp_count_step(amp_i64* steps, const int* bad_tensor) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    if (!amp_step_is_skipped(bad_tensor)) *steps += 1;
}

// One thread. Marks the step as skipped from the host's side (a non-finite loss seen before backward).
extern "C" __global__ void amp_mark_skipped(int* bad_tensor, int reason) {
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicMin(bad_tensor, reason);
}
