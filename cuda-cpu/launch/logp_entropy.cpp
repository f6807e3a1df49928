#include "launch.h"
#include "../../host/src/model/cuda/logp_entropy.cu"

#define TILE_PARAMS(T) (const T* x, u64 ld, int v0, int n, const unsigned int* targets, double* state)
#define TILE_ARGS (x, ld, v0, n, targets, state)
CPU_LAUNCHER(logp_entropy_tile_f32, TILE_PARAMS(float), TILE_ARGS)
CPU_LAUNCHER(logp_entropy_tile_bf16, TILE_PARAMS(bf16_t), TILE_ARGS)
CPU_LAUNCHER(logp_entropy_finish, (const double* state, float* out, int rows), (state, out, rows))
#define BWD_PARAMS(T)                                                                                           \
    (const T* x, u64 ld, int v0, int n, const unsigned int* targets, const float* res, const float* dres, T* dx, \
     u64 ldd)
#define BWD_ARGS (x, ld, v0, n, targets, res, dres, dx, ldd)
CPU_LAUNCHER(logp_entropy_bwd_tile_f32, BWD_PARAMS(float), BWD_ARGS)
CPU_LAUNCHER(logp_entropy_bwd_tile_bf16, BWD_PARAMS(bf16_t), BWD_ARGS)
