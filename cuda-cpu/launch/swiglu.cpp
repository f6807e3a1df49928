#include "launch.h"
#include "../../host/src/model/cuda/swiglu.cu"

CPU_LAUNCHER(swiglu_f32, (const float* g, const float* u, float* o, u64 n, u64 c, u64 s), (g, u, o, n, c, s))
CPU_LAUNCHER(swiglu_bf16, (const bf16_t* g, const bf16_t* u, bf16_t* o, u64 n, u64 c, u64 s), (g, u, o, n, c, s))
