// C entry points for the CPU harness: `cpu_<kernel>(grid, block, args...)`
// launches `<kernel>` with the grid and block given as three numbers each.
#pragma once
#include "../cuda_cpu.h"
#include "../../host/src/model/cuda/common.cuh"

#define CPU_UNPAREN(...) __VA_ARGS__
#define CPU_LAUNCHER(name, params, args)                                                            \
    extern "C" void cpu_##name(const unsigned int* g, const unsigned int* b, CPU_UNPAREN params) { \
        cuda_cpu::launch(#name, dim3(g[0], g[1], g[2]), dim3(b[0], b[1], b[2]),                    \
                         [&] { name(CPU_UNPAREN args); });                                         \
    }
