// SwiGLU's gating, elementwise: out = silu(gate) * up = gate / (1 + exp(-gate)) * up,
// in f32 whatever the storage type. A grid-stride loop over the n elements of
// out (rows of `cols`, contiguous); row r of the gate and of up start at
// r * stride: stride = cols for tensors of their own, 2 * cols when gate and
// up are the two halves of each row of one product over [Wgate; Wup] (then
// up = gate + cols).

template <typename T>
__device__ void swiglu(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out, u64 n,
                       u64 cols, u64 stride) {
    const u64 step = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        const u64 r = i / cols, at = r * stride + (i - r * cols);
        const float g = to_f(gate[at]);
        store(&out[i], g / (1.f + expf(-g)) * to_f(up[at]));
    }
}

extern "C" __global__ void swiglu_f32(const float* gate, const float* up, float* out, u64 n, u64 cols, u64 stride) {
    swiglu<float>(gate, up, out, n, cols, stride);
}
extern "C" __global__ void swiglu_bf16(const bf16_t* gate, const bf16_t* up, bf16_t* out, u64 n, u64 cols,
                                       u64 stride) {
    swiglu<bf16_t>(gate, up, out, n, cols, stride);
}
