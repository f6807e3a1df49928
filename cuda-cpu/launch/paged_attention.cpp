#include "launch.h"
#include "../../host/src/model/cuda/paged_attention.cu"

#define PA_PARAMS(T, K)                                                                                        \
    (const T* q, const K* kp, const K* vp, T* out, const unsigned int* meta, int nt, int hq, int hkv, int d, \
     int bs, int maxb, float scale)
#define PA_ARGS (q, kp, vp, out, meta, nt, hq, hkv, d, bs, maxb, scale)
CPU_LAUNCHER(paged_attention_f32, PA_PARAMS(float, float), PA_ARGS)
CPU_LAUNCHER(paged_attention_f32_bf16kv, PA_PARAMS(float, bf16_t), PA_ARGS)
CPU_LAUNCHER(paged_attention_bf16, PA_PARAMS(bf16_t, bf16_t), PA_ARGS)
