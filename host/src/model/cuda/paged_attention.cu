// Attention over a paged KV cache (model/paged_cuda.rs launches it): one
// thread block per (token, query head); its warps take the keys in turn
// through the block table, each with an online softmax, merged at the end.
// Sums in f32 for f32 and bf16 pools alike.

#define MAXC 8
#define MAXW 8

// q: (Hq, T, D); pools: (slots, Hkv, D); out: (T, Hq, D) in q's type.
// meta: row[T] | pos[T] | tables[R * maxb] (each sequence's block ids).
template <typename T, typename K>
__device__ void paged_attention(const T* __restrict__ q, const K* __restrict__ kp, const K* __restrict__ vp,
                                T* __restrict__ out, const unsigned int* __restrict__ meta, int nt, int hq,
                                int hkv, int d, int bs, int maxb, float scale) {
    const int t = blockIdx.x, h = blockIdx.y;
    const int row = (int)meta[t], pos = (int)meta[nt + t];
    const unsigned int* table = meta + 2 * nt + (u64)row * maxb;
    const int kvh = h / (hq / hkv);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const float neg_inf = __int_as_float(0xff800000);

    float qr[MAXC], acc[MAXC];
#pragma unroll
    for (int c = 0; c < MAXC; ++c) {
        const int i = lane + 32 * c;
        qr[c] = i < d ? to_f(q[((u64)h * nt + t) * d + i]) * scale : 0.f;
        acc[c] = 0.f;
    }
    float m = neg_inf, l = 0.f;
    for (int p = warp; p <= pos; p += nw) {
        const u64 slot = (u64)table[p / bs] * bs + p % bs;
        const K* kr = kp + (slot * hkv + kvh) * d;
        const K* vr = vp + (slot * hkv + kvh) * d;
        float s = 0.f;
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
            const int i = lane + 32 * c;
            if (i < d) s += qr[c] * to_f(kr[i]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        const float mn = fmaxf(m, s);
        const float a = __expf(m - mn), b = __expf(s - mn);
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
            const int i = lane + 32 * c;
            if (i < d) acc[c] = acc[c] * a + b * to_f(vr[i]);
        }
        l = l * a + b;
        m = mn;
    }

    __shared__ float sm[MAXW], sl[MAXW];
    __shared__ float sacc[MAXW * MAXC * 32];
    if (lane == 0) { sm[warp] = m; sl[warp] = l; }
#pragma unroll
    for (int c = 0; c < MAXC; ++c) {
        const int i = lane + 32 * c;
        if (i < d) sacc[warp * d + i] = acc[c];
    }
    __syncthreads();
    float mx = neg_inf;
    for (int w = 0; w < nw; ++w) mx = fmaxf(mx, sm[w]);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float num = 0.f, den = 0.f;
        for (int w = 0; w < nw; ++w) {
            if (sl[w] == 0.f) continue;  // a warp that saw no key
            const float f = __expf(sm[w] - mx);
            num += sacc[w * d + i] * f;
            den += sl[w] * f;
        }
        store(&out[((u64)t * hq + h) * d + i], num / den);
    }
}

extern "C" __global__ void paged_attention_f32(const float* q, const float* kp, const float* vp, float* out,
                                               const unsigned int* meta, int nt, int hq, int hkv, int d, int bs,
                                               int maxb, float scale) {
    paged_attention<float, float>(q, kp, vp, out, meta, nt, hq, hkv, d, bs, maxb, scale);
}

extern "C" __global__ void paged_attention_f32_bf16kv(const float* q, const bf16_t* kp, const bf16_t* vp, float* out,
                                                      const unsigned int* meta, int nt, int hq, int hkv, int d,
                                                      int bs, int maxb, float scale) {
    paged_attention<float, bf16_t>(q, kp, vp, out, meta, nt, hq, hkv, d, bs, maxb, scale);
}

extern "C" __global__ void paged_attention_bf16(const bf16_t* q, const bf16_t* kp, const bf16_t* vp, bf16_t* out,
                                                const unsigned int* meta, int nt, int hq, int hkv, int d, int bs,
                                                int maxb, float scale) {
    paged_attention<bf16_t, bf16_t>(q, kp, vp, out, meta, nt, hq, hkv, d, bs, maxb, scale);
}
