// Sampling on the device: one block per row of logits draws one token with
// the host sampler's rules (rollout/sampler.rs) and sends back only
// out[row] = [logprob, logprob_raw, entropy, id] (four f32: the id is exact
// below 2^24), not the row.
//
// The draw is the host's inverse-CDF walk: the first token whose cumulative
// tempered weight exceeds u * total, with u the row's uniform number (drawn
// on the host from the row's generator, so a row draws the same token on
// either side). Weights are exp((l - max) / T) in f32, sums in f64.
// Without a filter the walk goes in token order; with top-k / top-p / min-p it
// goes over the survivors sorted by logit (descending, ties by id), and every
// survivor set is a prefix of that order. So instead of sorting, each prefix
// is found by a bitwise search over a 64-bit key per token that orders them
// the same way (the logit's order-preserving bits, then the complement of the
// id): 64 passes over the row, each a block-wide count or sum of the tokens
// whose key is at least the candidate.
//
// params (per call): inv_t (1/T, 0 = greedy), top_k (0 = off), top_p (1 = off),
// min_p (0 = off). An id of -1 means the row had no finite maximum or held NaN
// (the host sampler's error).

// The order of the logit `l`: larger logits give larger keys (total order, as f32::total_cmp).
__device__ __forceinline__ unsigned int order_bits(float l) {
    const unsigned int b = __float_as_uint(l);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Sorted order: by logit descending, then id ascending, as the largest keys first.
__device__ __forceinline__ u64 sorted_key(float l, int i) {
    return ((u64)order_bits(l) << 32) | (u64)(~(unsigned int)i);
}

struct SampleRow {
    const float* x;
    int v;
    float max;
    float inv_t;
    // Survivors: key >= kmin (top-k), weight >= min_p (min-p), key >= kcut (top-p).
    u64 kmin, kcut;
    double min_p;
    bool sorted;
    __device__ float weight(int i) const { return expf((x[i] - max) * inv_t); }
    __device__ u64 key(int i) const { return sorted ? sorted_key(x[i], i) : (u64)(~(unsigned int)i); }
    __device__ bool kept(int i, u64 k) const {
        return k >= kmin && k >= kcut && (min_p <= 0.0 || (double)weight(i) >= min_p);
    }
};

// The number of survivors whose key is at least `k0` (block-wide).
__device__ double count_from(const SampleRow& r, u64 k0) {
    double c = 0.0;
    for (int i = threadIdx.x; i < r.v; i += blockDim.x) {
        const u64 k = r.key(i);
        if (k >= k0 && r.kept(i, k)) c += 1.0;
    }
    return block_sum(c);
}

// The total weight of the survivors whose key is at least `k0` (block-wide).
__device__ double mass_from(const SampleRow& r, u64 k0) {
    double s = 0.0;
    for (int i = threadIdx.x; i < r.v; i += blockDim.x) {
        const u64 k = r.key(i);
        if (k >= k0 && r.kept(i, k)) s += (double)r.weight(i);
    }
    return block_sum(s);
}

// The largest key k with mass_from(k) > target (strict) or >= target, by bits
// from the top (token-order keys have 32); 0 when there is none.
__device__ u64 mass_search(const SampleRow& r, double target, bool strict) {
    u64 k = 0;
    for (int bit = r.sorted ? 63 : 31; bit >= 0; --bit) {
        const u64 c = k | (1ull << bit);
        const double m = mass_from(r, c);
        if (strict ? m > target : m >= target) k = c;
    }
    return k;
}

// The smallest key among the survivors with weight > 0 when `positive` (block-wide); ~0 if none.
__device__ u64 min_key(const SampleRow& r, bool positive) {
    __shared__ u64 red[1024];
    u64 best = ~0ull;
    for (int i = threadIdx.x; i < r.v; i += blockDim.x) {
        const u64 k = r.key(i);
        if (r.kept(i, k) && (!positive || r.weight(i) > 0.f) && k < best) best = k;
    }
    red[threadIdx.x] = best;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w && red[threadIdx.x + w] < red[threadIdx.x]) red[threadIdx.x] = red[threadIdx.x + w];
        __syncthreads();
    }
    const u64 m = red[0];
    __syncthreads();
    return m;
}

// The id of the token with key k.
__device__ __forceinline__ int id_of(u64 k) { return (int)(~(unsigned int)(k & 0xffffffffull)); }

extern "C" __global__ void sample_rows(const float* __restrict__ logits, int v, const double* __restrict__ uniforms,
                                       float inv_t, int top_k, double top_p, double min_p,
                                       float* __restrict__ out) {
    const int row = blockIdx.x;
    const float* x = logits + (u64)row * v;
    // Raw statistics: the first maximum, sum e, sum e d (d = l - max), as the host's RawStats.
    __shared__ float smax[1024];
    __shared__ int sarg[1024];
    float mx = __int_as_float(0xff800000);
    int arg = 0;
    for (int i = threadIdx.x; i < v; i += blockDim.x) {
        if (x[i] > mx) {
            mx = x[i];
            arg = i;
        }
    }
    smax[threadIdx.x] = mx;
    sarg[threadIdx.x] = arg;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) {
            const float m2 = smax[threadIdx.x + w];
            const int a2 = sarg[threadIdx.x + w];
            if (m2 > smax[threadIdx.x] || (m2 == smax[threadIdx.x] && a2 < sarg[threadIdx.x])) {
                smax[threadIdx.x] = m2;
                sarg[threadIdx.x] = a2;
            }
        }
        __syncthreads();
    }
    mx = smax[0];
    arg = sarg[0];
    double sum = 0.0, sum_ed = 0.0;
    for (int i = threadIdx.x; i < v; i += blockDim.x) {
        const float d = x[i] - mx;
        const float e = expf(d);
        sum += (double)e;
        if (e > 0.f) sum_ed += (double)(e * d);
    }
    sum = block_sum(sum);
    sum_ed = block_sum(sum_ed);
    const bool bad = !(mx > __int_as_float(0xff800000) && mx < __int_as_float(0x7f800000)) || !(sum < 1e308);
    const double ln_sum = log(sum);
    const float entropy = (float)(ln_sum - sum_ed / sum);

    SampleRow r;
    r.x = x;
    r.v = v;
    r.max = mx;
    r.inv_t = inv_t;
    r.kmin = 0;
    r.kcut = 0;
    r.min_p = 0.0;
    r.sorted = false;
    int pick = arg;
    double logprob = 0.0;
    if (!bad && inv_t > 0.f) {
        const bool filtered = top_p < 1.0 || (top_k > 0 && top_k < v) || min_p > 0.0;
        double total;
        if (filtered) {
            r.sorted = true;
            if (top_k > 0 && top_k < v) {
                // The k-th largest key: the largest k0 with at least top_k keys >= k0.
                u64 k = 0;
                for (int bit = 63; bit >= 0; --bit) {
                    const u64 c = k | (1ull << bit);
                    if (count_from(r, c) >= (double)top_k) k = c;
                }
                r.kmin = k;
            }
            // Top-p's target: a share of the top-k survivors' mass, before min-p cuts.
            const double target = top_p * mass_from(r, 0);
            r.min_p = min_p;
            if (top_p < 1.0) r.kcut = mass_search(r, target, false);
            total = mass_from(r, 0);
        } else {
            total = inv_t == 1.f ? sum : mass_from(r, 0);
        }
        const double target = uniforms[row] * total;
        const u64 k = mass_search(r, target, true);
        if (mass_from(r, k) > target) {
            pick = id_of(k);
        } else {
            // Rounding left the walk short: the last survivor (the host's fallback).
            pick = id_of(min_key(r, !filtered));
        }
        logprob = (double)((x[pick] - mx) * inv_t) - log(total);
    }
    if (threadIdx.x == 0) {
        float* o = out + 4 * (u64)row;
        o[0] = (float)logprob;
        o[1] = (float)((double)(x[pick] - mx) - ln_sum);
        o[2] = entropy;
        o[3] = bad ? -1.f : (float)pick;
    }
}
