// q/k preparation: per-head RMSNorm over D with weight w, then rotate-half
// rotary embedding ([a c - b s, b c + a s] over the halves a, b of a head),
// in one pass. One block per (token, head), each thread one or more pairs
// (j, j + D/2); sums in f32.
//
// Each thread keeps its pairs in registers: the loops over them run to
// MAX_PAIRS (unrolled, so the arrays need no local memory), a pair past the
// head's half skipped; the host keeps d <= 2 * MAX_PAIRS * blockDim.x.
//
// norm_rope_*: x (N, H, D) as the projection leaves it (N = B * L tokens),
//   token n's heads at x + n * xs (xs = H * D for a projection of its own,
//   the fused q/k/v row's width when x points at the queries inside the
//   output of one product over [Wq; Wk; Wv]), cos/sin (N, D/2),
//   out (B, H, L, D) contiguous.
// norm_rope_write_kv_*: the same for the keys, then the keys and the values
//   (N, H, D) are written into their cache slots: pools (slots, H, D),
//   slot[N] per token (the paged cache's layout, model/paged.rs), rounded
//   once to the pools' type. Token n's keys and values start at k + n * kvs
//   and v + n * kvs (kvs = H * D, or the fused q/k/v row's width).

#define MAX_PAIRS 4

template <typename T>
__device__ __forceinline__ void norm_rope_head(const T* __restrict__ xr, const T* __restrict__ w,
                                               const T* __restrict__ cs, const T* __restrict__ sn, int d,
                                               float eps, float* a_out, float* b_out) {
    const int half = d / 2;
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < MAX_PAIRS; ++k) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j < half) {
            const float a = to_f(xr[j]), b = to_f(xr[j + half]);
            ss += a * a + b * b;
        }
    }
    const float inv = 1.f / sqrtf(block_sum(ss) / (float)d + eps);
#pragma unroll
    for (int k = 0; k < MAX_PAIRS; ++k) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j < half) {
            const float a = to_f(w[j]) * (to_f(xr[j]) * inv), b = to_f(w[j + half]) * (to_f(xr[j + half]) * inv);
            const float c = to_f(cs[j]), s = to_f(sn[j]);
            a_out[k] = a * c - b * s;
            b_out[k] = b * c + a * s;
        }
    }
}

template <typename T>
__device__ void norm_rope(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ cs,
                          const T* __restrict__ sn, T* __restrict__ out, int l, int nh, int d, u64 xs,
                          float eps) {
    const int tok = blockIdx.x, h = blockIdx.y, half = d / 2;
    float a[MAX_PAIRS], b[MAX_PAIRS];
    norm_rope_head(x + (u64)tok * xs + (u64)h * d, w, cs + (u64)tok * half, sn + (u64)tok * half, d, eps, a, b);
    const int bi = tok / l, li = tok % l;
    T* o = out + (((u64)bi * nh + h) * l + li) * d;
#pragma unroll
    for (int k = 0; k < MAX_PAIRS; ++k) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j < half) {
            store(&o[j], a[k]);
            store(&o[j + half], b[k]);
        }
    }
}

template <typename T, typename P>
__device__ void norm_rope_write_kv(const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ w,
                                   const T* __restrict__ cs, const T* __restrict__ sn,
                                   const unsigned int* __restrict__ slots, P* __restrict__ pk, P* __restrict__ pv,
                                   int nh, int d, u64 kvs, float eps) {
    const int tok = blockIdx.x, h = blockIdx.y, half = d / 2;
    float a[MAX_PAIRS], b[MAX_PAIRS];
    const u64 src = (u64)tok * kvs + (u64)h * d, dst = ((u64)slots[tok] * nh + h) * d;
    norm_rope_head(k + src, w, cs + (u64)tok * half, sn + (u64)tok * half, d, eps, a, b);
#pragma unroll
    for (int kk = 0; kk < MAX_PAIRS; ++kk) {
        const int j = threadIdx.x + kk * blockDim.x;
        if (j < half) {
            store(&pk[dst + j], a[kk]);
            store(&pk[dst + j + half], b[kk]);
        }
    }
    for (int j = threadIdx.x; j < d; j += blockDim.x) store(&pv[dst + j], to_f(v[src + j]));
}

extern "C" __global__ void norm_rope_f32(const float* x, const float* w, const float* cs, const float* sn,
                                         float* out, int l, int nh, int d, u64 xs, float eps) {
    norm_rope<float>(x, w, cs, sn, out, l, nh, d, xs, eps);
}
extern "C" __global__ void norm_rope_bf16(const bf16_t* x, const bf16_t* w, const bf16_t* cs, const bf16_t* sn,
                                          bf16_t* out, int l, int nh, int d, u64 xs, float eps) {
    norm_rope<bf16_t>(x, w, cs, sn, out, l, nh, d, xs, eps);
}
extern "C" __global__ void norm_rope_write_kv_f32(const float* k, const float* v, const float* w, const float* cs,
                                                  const float* sn, const unsigned int* slots, float* pk, float* pv,
                                                  int nh, int d, u64 kvs, float eps) {
    norm_rope_write_kv<float, float>(k, v, w, cs, sn, slots, pk, pv, nh, d, kvs, eps);
}
extern "C" __global__ void norm_rope_write_kv_f32_bf16pool(const float* k, const float* v, const float* w,
                                                           const float* cs, const float* sn,
                                                           const unsigned int* slots, bf16_t* pk, bf16_t* pv,
                                                           int nh, int d, u64 kvs, float eps) {
    norm_rope_write_kv<float, bf16_t>(k, v, w, cs, sn, slots, pk, pv, nh, d, kvs, eps);
}
extern "C" __global__ void norm_rope_write_kv_bf16(const bf16_t* k, const bf16_t* v, const bf16_t* w,
                                                   const bf16_t* cs, const bf16_t* sn, const unsigned int* slots,
                                                   bf16_t* pk, bf16_t* pv, int nh, int d, u64 kvs, float eps) {
    norm_rope_write_kv<bf16_t, bf16_t>(k, v, w, cs, sn, slots, pk, pv, nh, d, kvs, eps);
}
