// The update's log-softmax statistics over vocabulary tiles, forward and
// backward, without materialising log_softmax. Per row of logits x and target
// t: logp = x_t - lse, H = lse - sum_j p_j x_j, lse = logsumexp(x).
//
// Forward, one block per row, a tile of the vocabulary at a time (a tile is
// columns [v0, v0 + n) of the row; the whole row is one tile):
//   logp_entropy_tile_*: folds a tile into the row's running state
//     (m, s, u, x_t) in f64: m the max, s = sum e^(x - m), u = sum e^(x - m) (x - m),
//     x_t the target's logit once its tile has passed (state starts at
//     (-inf, 0, 0, 0));
//   logp_entropy_finish: state -> out (rows, 3) = [logp, H, lse].
// Backward (logp_entropy_bwd_tile_*), one block per row of a tile: with
//   p = exp(x - lse) and gradients dres (rows, 3) = (gl, ge, -) of (logp, H, lse),
//   dx_j = gl (1[j = t] - p_j) - ge p_j (x_j - lse + H).

#define NEG_INF_D __longlong_as_double(0xfff0000000000000ull)

// (m, s, u) of two partial states merged.
__device__ __forceinline__ void merge_state(double& m, double& s, double& u, double m2, double s2, double u2) {
    if (s2 == 0.0) return;
    if (s == 0.0) {
        m = m2;
        s = s2;
        u = u2;
        return;
    }
    const double mn = m > m2 ? m : m2;
    const double c1 = exp(m - mn), c2 = exp(m2 - mn);
    // u about mn: sum e^(x-mn) (x-mn) = c (u + s (m - mn)) per part.
    u = c1 * (u + s * (m - mn)) + c2 * (u2 + s2 * (m2 - mn));
    s = c1 * s + c2 * s2;
    m = mn;
}

template <typename T>
__device__ void logp_entropy_tile(const T* __restrict__ x, u64 ld, int v0, int n,
                                  const unsigned int* __restrict__ targets, double* __restrict__ state) {
    const int row = blockIdx.x;
    const T* xr = x + (u64)row * ld;
    // This thread's part of the tile, online: the max moves, the sums follow it.
    double m = NEG_INF_D, s = 0.0, u = 0.0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const double v = (double)to_f(xr[j]);
        if (v == NEG_INF_D) continue;  // p = 0: adds nothing
        if (v > m) {
            if (s > 0.0) {  // (with nothing summed yet, m = -inf would give 0 * inf)
                const double c = exp(m - v);
                u = c * (u + s * (m - v));
                s = c * s;
            }
            m = v;
        }
        const double e = exp(v - m);
        s += e;
        u += e * (v - m);
    }
    // The block's threads merged in order, through shared memory.
    __shared__ double sm[1024], ss[1024], su[1024];
    sm[threadIdx.x] = m;
    ss[threadIdx.x] = s;
    su[threadIdx.x] = u;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) {
            double a = sm[threadIdx.x], b = ss[threadIdx.x], c = su[threadIdx.x];
            merge_state(a, b, c, sm[threadIdx.x + w], ss[threadIdx.x + w], su[threadIdx.x + w]);
            sm[threadIdx.x] = a;
            ss[threadIdx.x] = b;
            su[threadIdx.x] = c;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        double* st = state + 4 * (u64)row;
        double a = st[0], b = st[1], c = st[2];
        merge_state(a, b, c, sm[0], ss[0], su[0]);
        st[0] = a;
        st[1] = b;
        st[2] = c;
        const int t = (int)targets[row] - v0;
        if (t >= 0 && t < n) st[3] = (double)to_f(xr[t]);
    }
}

extern "C" __global__ void logp_entropy_tile_f32(const float* x, u64 ld, int v0, int n, const unsigned int* targets,
                                                 double* state) {
    logp_entropy_tile<float>(x, ld, v0, n, targets, state);
}
extern "C" __global__ void logp_entropy_tile_bf16(const bf16_t* x, u64 ld, int v0, int n,
                                                  const unsigned int* targets, double* state) {
    logp_entropy_tile<bf16_t>(x, ld, v0, n, targets, state);
}

// One thread per row: out[row] = [logp, H, lse] in f32.
extern "C" __global__ void logp_entropy_finish(const double* state, float* out, int rows) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    const double* st = state + 4 * (u64)row;
    const double lse = st[0] + log(st[1]);
    out[3 * row] = (float)(st[3] - lse);
    out[3 * row + 1] = (float)(lse - (st[2] / st[1] + st[0]));
    out[3 * row + 2] = (float)lse;
}

template <typename T>
__device__ void logp_entropy_bwd_tile(const T* __restrict__ x, u64 ld, int v0, int n,
                                      const unsigned int* __restrict__ targets, const float* __restrict__ res,
                                      const float* __restrict__ dres, T* __restrict__ dx, u64 ldd) {
    const int row = blockIdx.x;
    const T* xr = x + (u64)row * ld;
    T* dr = dx + (u64)row * ldd;
    const float h = res[3 * row + 1], lse = res[3 * row + 2];
    const float gl = dres[3 * row], ge = dres[3 * row + 1];
    const float shift = h - lse;
    const int t = (int)targets[row] - v0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float v = to_f(xr[j]);
        const float p = expf(v - lse);
        float d = p > 0.f ? -p * (gl + ge * (v + shift)) : 0.f;
        if (j == t) d += gl;
        store(&dr[j], d);
    }
}

extern "C" __global__ void logp_entropy_bwd_tile_f32(const float* x, u64 ld, int v0, int n,
                                                     const unsigned int* targets, const float* res,
                                                     const float* dres, float* dx, u64 ldd) {
    logp_entropy_bwd_tile<float>(x, ld, v0, n, targets, res, dres, dx, ldd);
}
extern "C" __global__ void logp_entropy_bwd_tile_bf16(const bf16_t* x, u64 ld, int v0, int n,
                                                      const unsigned int* targets, const float* res,
                                                      const float* dres, bf16_t* dx, u64 ldd) {
    logp_entropy_bwd_tile<bf16_t>(x, ld, v0, n, targets, res, dres, dx, ldd);
}
