// Shared by every kernel source of this folder (prepended to each one before
// NVRTC compiles it, and before the CPU harness compiles it with g++). Types
// are spelled without CUDA headers: NVRTC at run time has none. bf16 is its 16
// bits, widened by a shift and narrowed with round-to-nearest-even.
typedef unsigned short bf16_t;
typedef unsigned long long u64;
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16_t x) { return __uint_as_float(((unsigned int)x) << 16); }
__device__ __forceinline__ void store(float* o, float x) { *o = x; }
__device__ __forceinline__ void store(bf16_t* o, float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) { *o = (bf16_t)((u >> 16) | 0x40u); return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    *o = (bf16_t)(u >> 16);
}

// The value of `x` once stored as a `T` (rounding to bf16 for bf16).
__device__ __forceinline__ float rounded(float x, const float*) { return x; }
__device__ __forceinline__ float rounded(float x, const bf16_t*) {
    bf16_t b;
    store(&b, x);
    return to_f(b);
}

#define FULL_MASK 0xffffffffu

// The sum of `v` over the 32 lanes of a warp; every lane gets it.
template <typename F>
__device__ __forceinline__ F warp_sum(F v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// The sum of `v` over the block (blockDim.x a multiple of 32); every thread
// gets it, the warps' sums added in the same order. Every thread of the block
// must call it.
template <typename F>
__device__ F block_sum(F v) {
    __shared__ F red[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // an earlier call's readers are done with `red`
    if (lane == 0) red[warp] = v;
    __syncthreads();
    F s = red[0];
    for (int w = 1; w < nw; ++w) s += red[w];
    return s;
}
