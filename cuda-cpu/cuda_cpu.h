// CUDA C kernels on the CPU: just enough of the CUDA programming model for
// the kernels in host/src/model/cuda/*.cu to compile with a C++17 compiler
// and run, one block at a time, with one fiber (its own stack and context)
// per thread of the block, so that barriers and warp shuffles are real
// synchronisation points: a thread that reaches `__syncthreads()` stops
// until every thread of its block has reached it, and a shuffle stops until
// every lane of its warp has posted its value.
//
// What it gives a kernel: threadIdx, blockIdx, blockDim, gridDim (built-in
// variables), __syncthreads, __syncwarp, __shared__ (one copy per block, as
// blocks run one after another), the warp shuffles (__shfl_sync,
// __shfl_xor_sync, __shfl_down_sync, __shfl_up_sync; full-warp masks only),
// __ballot_sync / __any_sync / __all_sync, atomicAdd / atomicMax /
// atomicMin / atomicCAS / atomicExch, and the float intrinsics the kernels
// use (__expf, __logf, __int_as_float, __float_as_uint, ...).
//
// What it cannot show: timing, memory coalescing or bank conflicts, races
// between threads (fibers switch only at barriers and shuffles, so a missing
// barrier before a read of shared memory that another thread writes can go
// unseen), and the reconvergence rules of divergent warps (a shuffle must be
// reached by all 32 lanes of a warp; a partial mask is refused).
#pragma once

#include <ucontext.h>

#include <math.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
    dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
// One copy per launching OS thread: the blocks of a launch run one at a time
// on the thread that launched them, so this is one copy per block.
#define __shared__ static thread_local
#define __constant__ static

// Switching between fibers: on x86-64 a few instructions that save and restore
// the callee-saved registers (no system call); elsewhere ucontext.
#if defined(__x86_64__) && !defined(CUDA_CPU_UCONTEXT)
extern "C" void cuda_cpu_switch(void** from_sp, void* to_sp);
__asm__(R"(
    .text
    .weak cuda_cpu_switch
    .type cuda_cpu_switch, @function
cuda_cpu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cuda_cpu_switch, .-cuda_cpu_switch
)");
namespace cuda_cpu {
struct Context {
    void* sp = nullptr;
};
inline void switch_to(Context& from, Context& to) { cuda_cpu_switch(&from.sp, to.sp); }
// A context that starts `f` on the stack `[stack, stack + size)`.
inline void make_context(Context& c, char* stack, std::size_t size, void (*f)()) {
    auto top = reinterpret_cast<std::uintptr_t>(stack + size) & ~std::uintptr_t(15);
    void** sp = reinterpret_cast<void**>(top);
    *--sp = nullptr;                        // `f`'s return address: it never returns
    *--sp = reinterpret_cast<void*>(f);     // where the switch's `ret` goes
    for (int i = 0; i < 6; ++i) *--sp = nullptr;  // rbp rbx r12-r15
    c.sp = sp;
}
}  // namespace cuda_cpu
#else
namespace cuda_cpu {
struct Context {
    ucontext_t uc;
};
inline void switch_to(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
__attribute__((noinline)) inline void make_context(Context& c, char* stack, std::size_t size, void (*f)()) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, f, 0);
}
}  // namespace cuda_cpu
#endif

namespace cuda_cpu {

// Shuffles carry up to 8 bytes.
using word = std::uint64_t;

struct Lane {
    Context ctx;
    uint3 tid;
    unsigned int linear;  // x + y * bx + z * bx * by
    bool done;
};

struct Block {
    std::vector<Lane> lanes;
    std::unique_ptr<char[]> stacks;  // not zeroed: only the top of each is touched
    Context sched;
    unsigned int cur = 0;
    unsigned int nthreads = 0;
    // Barrier of the whole block.
    unsigned int bar_count = 0, bar_gen = 0;
    // Barriers and exchange slots of each warp.
    std::vector<unsigned int> warp_count, warp_gen;
    std::vector<word> slots;
    // Arrivals, barrier completions and exits: a round of the scheduler
    // without any is a deadlock.
    unsigned long long progress = 0;
    void (*body)(void*) = nullptr;
    void* arg = nullptr;
    const char* kernel = "";
};

inline thread_local Block* g_block = nullptr;
inline thread_local uint3 g_block_idx{0, 0, 0};
inline thread_local dim3 g_block_dim, g_grid_dim;

[[noreturn]] inline void fail(const char* what) {
    Block* b = g_block;
    std::fprintf(stderr, "cuda_cpu: %s (kernel %s, block (%u,%u,%u), thread %u)\n", what, b ? b->kernel : "?",
                 g_block_idx.x, g_block_idx.y, g_block_idx.z, b ? b->lanes[b->cur].linear : 0u);
    std::abort();
}

inline Lane& me() { return g_block->lanes[g_block->cur]; }

// Back to the scheduler; it resumes this fiber in its next round.
inline void yield() {
    Block* b = g_block;
    switch_to(b->lanes[b->cur].ctx, b->sched);
}

inline void sync_block() {
    Block* b = g_block;
    ++b->progress;
    unsigned int gen = b->bar_gen;
    if (++b->bar_count == b->nthreads) {
        b->bar_count = 0;
        ++b->bar_gen;
        return;
    }
    while (b->bar_gen == gen) yield();
}

inline unsigned int warp_size_of(unsigned int w) {
    unsigned int n = g_block->nthreads - w * 32;
    return n < 32 ? n : 32;
}

inline void sync_warp() {
    Block* b = g_block;
    ++b->progress;
    unsigned int w = me().linear / 32;
    unsigned int gen = b->warp_gen[w];
    if (++b->warp_count[w] == warp_size_of(w)) {
        b->warp_count[w] = 0;
        ++b->warp_gen[w];
        return;
    }
    while (b->warp_gen[w] == gen) yield();
}

inline void check_mask(unsigned int mask) {
    unsigned int w = me().linear / 32, n = warp_size_of(w);
    unsigned int full = n == 32 ? 0xffffffffu : ((1u << n) - 1u);
    if ((mask & full) != full) fail("a warp operation with a partial mask (not emulated)");
}

// Every lane posts `v`; each gets the value lane `src(lane)` posted.
template <typename T, typename F>
inline T exchange(unsigned int mask, T v, F src) {
    static_assert(sizeof(T) <= sizeof(word), "shuffles carry at most 8 bytes");
    check_mask(mask);
    Block* b = g_block;
    unsigned int w = me().linear / 32, lane = me().linear % 32;
    word bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    b->slots[w * 32 + lane] = bits;
    sync_warp();
    unsigned int s = src(lane);
    if (s >= warp_size_of(w)) s = lane;
    bits = b->slots[w * 32 + s];
    sync_warp();
    T r;
    std::memcpy(&r, &bits, sizeof(T));
    return r;
}

inline void entry() {
    Block* b = g_block;
    b->body(b->arg);
    ++b->progress;
    me().done = true;
    switch_to(me().ctx, b->sched);
    fail("a finished thread was resumed");
}

constexpr std::size_t STACK = 64 * 1024;

// Every thread of the block at the start of the kernel.
inline void start_lanes(Block& b, dim3 block) {
    for (unsigned int i = 0; i < b.nthreads; ++i) {
        Lane& l = b.lanes[i];
        l.linear = i;
        l.tid = uint3{i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
        l.done = false;
        make_context(l.ctx, b.stacks.get() + STACK * i, STACK, entry);
    }
}

// Runs `body(arg)` as every thread of every block of `grid` x `block`.
inline void launch(const char* kernel, dim3 grid, dim3 block, void (*body)(void*), void* arg) {
    Block b;
    b.kernel = kernel;
    b.body = body;
    b.arg = arg;
    b.nthreads = block.x * block.y * block.z;
    if (b.nthreads == 0 || b.nthreads > 1024) {
        std::fprintf(stderr, "cuda_cpu: kernel %s launched with %u threads per block\n", kernel, b.nthreads);
        std::abort();
    }
    unsigned int warps = (b.nthreads + 31) / 32;
    b.lanes.resize(b.nthreads);
    b.stacks.reset(new char[STACK * b.nthreads]);
    b.warp_count.assign(warps, 0);
    b.warp_gen.assign(warps, 0);
    b.slots.assign(warps * 32, 0);
    Block* outer = g_block;
    uint3 outer_idx = g_block_idx;
    dim3 outer_dim = g_block_dim, outer_grid = g_grid_dim;
    g_block = &b;
    g_block_dim = block;
    g_grid_dim = grid;
    for (unsigned int bz = 0; bz < grid.z; ++bz)
        for (unsigned int by = 0; by < grid.y; ++by)
            for (unsigned int bx = 0; bx < grid.x; ++bx) {
                g_block_idx = uint3{bx, by, bz};
                b.bar_count = 0;
                start_lanes(b, block);
                unsigned int live = b.nthreads;
                while (live > 0) {
                    unsigned long long before = b.progress;
                    for (unsigned int i = 0; i < b.nthreads; ++i) {
                        if (b.lanes[i].done) continue;
                        b.cur = i;
                        switch_to(b.sched, b.lanes[i].ctx);
                        if (b.lanes[i].done) --live;
                    }
                    if (live > 0 && b.progress == before)
                        fail("deadlock: threads wait at a barrier or shuffle that others never reach");
                }
                for (unsigned int w = 0; w < warps; ++w)
                    if (b.warp_count[w] != 0) fail("a warp finished with lanes waiting at a shuffle");
                if (b.bar_count != 0) fail("a block finished with threads waiting at __syncthreads");
            }
    g_block = outer;
    g_block_idx = outer_idx;
    g_block_dim = outer_dim;
    g_grid_dim = outer_grid;
}

template <typename F>
inline void launch(const char* kernel, dim3 grid, dim3 block, F f) {
    launch(kernel, grid, block, [](void* p) { (*static_cast<F*>(p))(); }, &f);
}

inline float bits_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned int float_bits(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}

}  // namespace cuda_cpu

#define threadIdx (cuda_cpu::me().tid)
#define blockIdx (cuda_cpu::g_block_idx)
#define blockDim (cuda_cpu::g_block_dim)
#define gridDim (cuda_cpu::g_grid_dim)
#define warpSize 32

inline void __syncthreads() { cuda_cpu::sync_block(); }
inline void __syncwarp(unsigned int mask = 0xffffffffu) {
    cuda_cpu::check_mask(mask);
    cuda_cpu::sync_warp();
}

template <typename T>
inline T __shfl_sync(unsigned int mask, T v, int src, int width = 32) {
    return cuda_cpu::exchange(mask, v, [=](unsigned int l) { return (l & ~(width - 1)) + (src & (width - 1)); });
}
template <typename T>
inline T __shfl_xor_sync(unsigned int mask, T v, int lane_mask, int width = 32) {
    return cuda_cpu::exchange(mask, v, [=](unsigned int l) {
        unsigned int s = l ^ (unsigned int)lane_mask;
        return s < (l & ~(width - 1)) + width ? s : l;
    });
}
template <typename T>
inline T __shfl_down_sync(unsigned int mask, T v, unsigned int delta, int width = 32) {
    return cuda_cpu::exchange(mask, v,
                              [=](unsigned int l) { return (l & (width - 1)) + delta < (unsigned)width ? l + delta : l; });
}
template <typename T>
inline T __shfl_up_sync(unsigned int mask, T v, unsigned int delta, int width = 32) {
    return cuda_cpu::exchange(mask, v, [=](unsigned int l) { return (l & (width - 1)) >= delta ? l - delta : l; });
}
inline unsigned int __ballot_sync(unsigned int mask, int pred) {
    unsigned int lane = cuda_cpu::me().linear % 32, w = cuda_cpu::me().linear / 32;
    unsigned int r = 0;
    for (unsigned int i = 0; i < cuda_cpu::warp_size_of(w); ++i) {
        int p = cuda_cpu::exchange(mask, pred ? 1 : 0, [=](unsigned int) { return i; });
        if (p) r |= 1u << i;
    }
    (void)lane;
    return r;
}
inline int __any_sync(unsigned int mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned int mask, int pred) {
    unsigned int w = cuda_cpu::me().linear / 32, n = cuda_cpu::warp_size_of(w);
    unsigned int full = n == 32 ? 0xffffffffu : ((1u << n) - 1u);
    return __ballot_sync(mask, pred) == full;
}

// Fibers switch only at barriers and shuffles, so a read-modify-write is atomic.
template <typename T>
inline T atomicAdd(T* p, T v) {
    T o = *p;
    *p = o + v;
    return o;
}
template <typename T>
inline T atomicMax(T* p, T v) {
    T o = *p;
    *p = o > v ? o : v;
    return o;
}
template <typename T>
inline T atomicMin(T* p, T v) {
    T o = *p;
    *p = o < v ? o : v;
    return o;
}
template <typename T>
inline T atomicExch(T* p, T v) {
    T o = *p;
    *p = v;
    return o;
}
template <typename T>
inline T atomicCAS(T* p, T cmp, T v) {
    T o = *p;
    if (o == cmp) *p = v;
    return o;
}

inline float __int_as_float(int i) { return cuda_cpu::bits_float((unsigned int)i); }
inline float __uint_as_float(unsigned int u) { return cuda_cpu::bits_float(u); }
inline int __float_as_int(float f) { return (int)cuda_cpu::float_bits(f); }
inline unsigned int __float_as_uint(float f) { return cuda_cpu::float_bits(f); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __powf(float x, float y) { return std::pow(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline double __longlong_as_double(long long i) {
    double d;
    std::memcpy(&d, &i, 8);
    return d;
}
inline long long __double_as_longlong(double d) {
    long long i;
    std::memcpy(&i, &d, 8);
    return i;
}
