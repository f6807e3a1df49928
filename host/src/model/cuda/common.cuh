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

