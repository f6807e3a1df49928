// RMSNorm over the last dimension, alone or after a residual add:
//   h = x + r (stored: the new residual stream), y = w * h / sqrt(mean(h^2) + eps).
// One block per row; the sum of squares in f32. In bf16, h is rounded to bf16
// before it is normalised, as the separate add would leave it.

template <typename T>
__device__ void rms_norm(const T* __restrict__ x, const T* __restrict__ r, const T* __restrict__ w,
                         T* __restrict__ h, T* __restrict__ y, int n, float eps) {
    const u64 off = (u64)blockIdx.x * n;
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = to_f(x[off + i]);
        if (r) {
            v = rounded(v + to_f(r[off + i]), h);
            store(&h[off + i], v);
        }
        ss += v * v;
    }
    const float inv = 1.f / sqrtf(block_sum(ss) / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = r ? to_f(h[off + i]) : to_f(x[off + i]);
        store(&y[off + i], to_f(w[i]) * (v * inv));
    }
}

extern "C" __global__ void rms_norm_f32(const float* x, const float* w, float* y, int n, float eps) {
    rms_norm<float>(x, nullptr, w, nullptr, y, n, eps);
}
extern "C" __global__ void rms_norm_bf16(const bf16_t* x, const bf16_t* w, bf16_t* y, int n, float eps) {
    rms_norm<bf16_t>(x, nullptr, w, nullptr, y, n, eps);
}
extern "C" __global__ void add_rms_norm_f32(const float* x, const float* r, const float* w, float* h, float* y,
                                            int n, float eps) {
    rms_norm<float>(x, r, w, h, y, n, eps);
}
extern "C" __global__ void add_rms_norm_bf16(const bf16_t* x, const bf16_t* r, const bf16_t* w, bf16_t* h,
                                             bf16_t* y, int n, float eps) {
    rms_norm<bf16_t>(x, r, w, h, y, n, eps);
}
