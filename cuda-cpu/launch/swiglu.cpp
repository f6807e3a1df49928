#include "launch.h"
#include "../../host/src/model/cuda/swiglu.cu"

CPU_LAUNCHER(swiglu_f32, (const float* g, const float* u, float* o, u64 n), (g, u, o, n))
CPU_LAUNCHER(swiglu_bf16, (const bf16_t* g, const bf16_t* u, bf16_t* o, u64 n), (g, u, o, n))
