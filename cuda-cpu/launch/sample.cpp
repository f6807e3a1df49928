#include "launch.h"
#include "../../host/src/model/cuda/sample.cu"

CPU_LAUNCHER(sample_rows,
             (const float* logits, int v, const double* uniforms, float inv_t, int top_k, double top_p, double min_p,
              float* out),
             (logits, v, uniforms, inv_t, top_k, top_p, min_p, out))
