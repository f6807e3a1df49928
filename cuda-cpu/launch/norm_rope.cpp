#include "launch.h"
#include "../../host/src/model/cuda/norm_rope.cu"

#define NR_PARAMS(T) (const T* x, const T* w, const T* cs, const T* sn, T* out, int l, int nh, int d, u64 xs, float eps)
#define NR_ARGS (x, w, cs, sn, out, l, nh, d, xs, eps)
CPU_LAUNCHER(norm_rope_f32, NR_PARAMS(float), NR_ARGS)
CPU_LAUNCHER(norm_rope_bf16, NR_PARAMS(bf16_t), NR_ARGS)
#define KV_PARAMS(T, P)                                                                                      \
    (const T* k, const T* v, const T* w, const T* cs, const T* sn, const unsigned int* slots, P* pk, P* pv, \
     int nh, int d, u64 kvs, float eps)
#define KV_ARGS (k, v, w, cs, sn, slots, pk, pv, nh, d, kvs, eps)
CPU_LAUNCHER(norm_rope_write_kv_f32, KV_PARAMS(float, float), KV_ARGS)
CPU_LAUNCHER(norm_rope_write_kv_f32_bf16pool, KV_PARAMS(float, bf16_t), KV_ARGS)
CPU_LAUNCHER(norm_rope_write_kv_bf16, KV_PARAMS(bf16_t, bf16_t), KV_ARGS)
