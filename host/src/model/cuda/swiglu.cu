// SwiGLU's gating, elementwise: out = silu(gate) * up = gate / (1 + exp(-gate)) * up,
// in f32 whatever the storage type. A grid-stride loop over the n elements.

template <typename T>
__device__ void swiglu(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out, u64 n) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = to_f(gate[i]);
        store(&out[i], g / (1.f + expf(-g)) * to_f(up[i]));
    }
}

extern "C" __global__ void swiglu_f32(const float* gate, const float* up, float* out, u64 n) {
    swiglu<float>(gate, up, out, n);
}
extern "C" __global__ void swiglu_bf16(const bf16_t* gate, const bf16_t* up, bf16_t* out, u64 n) {
    swiglu<bf16_t>(gate, up, out, n);
}
