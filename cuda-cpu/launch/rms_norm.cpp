#include "launch.h"
#include "../../host/src/model/cuda/rms_norm.cu"

CPU_LAUNCHER(rms_norm_f32, (const float* x, const float* w, float* y, int n, float eps), (x, w, y, n, eps))
CPU_LAUNCHER(rms_norm_bf16, (const bf16_t* x, const bf16_t* w, bf16_t* y, int n, float eps), (x, w, y, n, eps))
CPU_LAUNCHER(add_rms_norm_f32, (const float* x, const float* r, const float* w, float* h, float* y, int n, float eps),
             (x, r, w, h, y, n, eps))
CPU_LAUNCHER(add_rms_norm_bf16,
             (const bf16_t* x, const bf16_t* r, const bf16_t* w, bf16_t* h, bf16_t* y, int n, float eps),
             (x, r, w, h, y, n, eps))
