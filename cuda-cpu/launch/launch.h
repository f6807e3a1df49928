// C entry points for the CPU harness: `cpu_<kernel>(grid, block, args...)`
// launches `<kernel>` with the grid and block given as three numbers each.
#pragma once
#include "../cuda_cpu.h"
#include "../../host/src/model/cuda/common.cuh"

#define CPU_UNPAREN(...) __VA_ARGS__
#define CPU_LAUNCHER(name, params, args)                                                            \
    extern "C" void cpu_##name(const unsigned int* cpu_grid, const unsigned int* cpu_block, CPU_UNPAREN params) { \
        cuda_cpu::launch(#name, dim3(cpu_grid[0], cpu_grid[1], cpu_grid[2]), dim3(cpu_block[0], cpu_block[1], cpu_block[2]),                    \
                         [&] { name(CPU_UNPAREN args); });                                         \
    }
