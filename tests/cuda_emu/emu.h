// emu.h: a small SIMT emulator that runs Colibri's CUDA kernels on the CPU, so
// that CI (which has no GPU) executes them. Used through the CUDA headers in
// tests/cuda_emu/include (cuda_runtime.h, cublasLt.h, cuda_bf16.h, cuda_fp16.h,
// cub) and tests/cuda_emu/prep.py, which copies a .cu file into the build tree
// with every launch `k<<<grid, block, smem, stream>>>(args)` rewritten as
// `emu::launch(grid, block, smem, stream, k, args)`; everything else in the
// kernels' source is compiled unchanged by the host C++ compiler.
//
// ctest runs it as cuda.emulated.dense / .ffn (tests/cuda_checks.h, the checks of
// tests/cuda_check.cu) and cuda.emulated.engine (test_cuda_engine.cpp and
// test_gpu_tier.cpp's GPU tests against colibri_core_emu); tests/CMakeLists.txt.
//
// What it does:
// - Each CUDA thread is a fiber with its own stack; the blocks of a grid run one
//   after another, in index order; the threads of a block run one after another
//   (by index) up to their next barrier. __syncthreads, __syncwarp and the warp
//   shuffles are real barriers: a barrier that not every thread of the block (or
//   lane of the warp) reaches, a partial-mask shuffle, or a deadlock aborts with a
//   message. Code relying on lanes running in lockstep without __syncwarp fails
//   here (as it may on Volta and later).
// - Kernel arguments are evaluated once and copied per thread, as on a GPU.
// - Launch configurations are checked (empty or too large grids and blocks, over
//   48 KiB of dynamic shared memory): the launch fails with
//   cudaErrorInvalidConfiguration / cudaErrorInvalidValue for cudaPeekAtLastError,
//   as on a GPU. (2-D / 3-D grids and blocks of a partial warp abort: not emulated.)
// - Dynamic shared memory starts as NaN bytes (0xff); device allocations too.
// - The runtime (cuda_runtime.h): device memory is host memory, tracked, so that
//   a copy, memset, sort or GEMM operand outside any allocation (or a copy in the
//   wrong direction) aborts and a free of an unknown pointer fails; one device of
//   8 GiB (cudaMalloc beyond it fails with cudaErrorMemoryAllocation); streams and
//   events are checked handles (a destroyed one fails). Work queued on a stream
//   runs only when something waits for it (cuda_runtime.h, "the work queues"), so
//   a missing synchronisation shows as stale data (COLIBRI_EMU_IMMEDIATE=1: all
//   work runs when queued).
// - cuBLASLt (cublasLt.h): cublasLtMatmul as a plain GEMM honouring the layouts,
//   transposes, leading dimensions, data types and the alignments the heuristic
//   was promised; CUB's radix sort as a stable sort that scribbles over its
//   temporary storage.
//
// What it does NOT prove:
// - Memory ordering and races between threads: as threads run in a fixed order,
//   a missing __syncthreads / __syncwarp shows only when that order exposes it (a
//   thread reading what a later thread has not written yet); a write-after-read
//   race, a race on global memory between blocks, a missing __threadfence or
//   atomic is not found.
// - Every ordering of streams: a missing event wait or stream synchronisation, a
//   host read before a copy completed, the reuse of a buffer that queued work
//   still reads show in the one order the emulator runs the work in (as late as
//   possible), not in every order a GPU may choose. Streams never overlap.
// - Memory accesses by kernels are plain host loads and stores: out-of-bounds
//   accesses are caught only under AddressSanitizer (a build with
//   COLIBRI_SANITIZE=address), kernels dereferencing host pointers and misaligned
//   vector (float4) accesses not at all. Static __shared__ arrays start as zeros
//   or the previous block's contents, not garbage.
// - Real cuBLASLt and CUB behaviour (algorithm choice, workspace use, accumulation
//   order, TF32), nvcc's code generation (FMA contraction: the host compiler does
//   not contract a * b + c; fast-math intrinsics), device limits (registers,
//   __launch_bounds__, occupancy), and performance: none of it is modelled.
#pragma once
#include <ucontext.h>

#include <cmath>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

// ---- CUDA's qualifiers and built-in types ------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __shared__ static
#define __constant__ static
#define __align__(n) alignas(n)

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) int4 {
  int x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }
constexpr int warpSize = 32;

inline uint3 threadIdx, blockIdx, blockDim, gridDim;

// ---- device intrinsics used by the kernels ------------------------------------------
inline float __int_as_float(int v) { return std::bit_cast<float>(v); }
inline int __float_as_int(float f) { return std::bit_cast<int>(f); }
inline float __uint_as_float(uint32_t v) { return std::bit_cast<float>(v); }
inline uint32_t __float_as_uint(float f) { return std::bit_cast<uint32_t>(f); }
// The _rn forms: never contracted into an FMA (by nvcc; nor by the host compiler,
// which does not contract without -ffp-contract=fast and FMA instructions).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }

// ---- the scheduler ------------------------------------------------------------------
// (AddressSanitizer: fibers' stacks are unpoisoned when reused. ThreadSanitizer
// would need to be told of every switch: the build leaves the emulator out there.)
#if defined(__SANITIZE_ADDRESS__)
#define COLIBRI_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define COLIBRI_EMU_ASAN 1
#endif
#endif
#if COLIBRI_EMU_ASAN
#include <sanitizer/asan_interface.h>
#endif
namespace emu {

// Inside the emulated CUDA runtime (an API call, a launch, queued work running):
// the allocation-counting tests (tests/test_alloc.cpp) count only the engine's
// own allocations, as the real runtime's are not on the engine's heap.
inline thread_local int runtime_depth = 0;
struct RuntimeScope {
  RuntimeScope() { ++runtime_depth; }
  ~RuntimeScope() { --runtime_depth; }
  RuntimeScope(const RuntimeScope&) = delete;
  RuntimeScope& operator=(const RuntimeScope&) = delete;
};


[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "CUDA EMULATOR: %s (block %u, thread %u)\n", what, blockIdx.x, threadIdx.x);
  std::fflush(stderr);
  std::abort();
}

enum State { Runnable, AtWarpBarrier, AtBlockBarrier, Done };

// Switching between fibers: on x86-64, a few instructions (callee-saved registers,
// the stack pointer, MXCSR and the x87 control word); elsewhere ucontext, whose
// swapcontext also saves the signal mask with a system call (much slower; also
// with -DCOLIBRI_EMU_UCONTEXT).
#if defined(__x86_64__) && !defined(COLIBRI_EMU_UCONTEXT)
#define COLIBRI_EMU_FAST_SWITCH 1
extern "C" void colibri_emu_switch(void** save_sp, void* load_sp);
__asm__(
    ".pushsection .text.colibri_emu_switch,\"axG\",@progbits,colibri_emu_switch,comdat\n"
    ".globl colibri_emu_switch\n"
    ".hidden colibri_emu_switch\n"
    ".type colibri_emu_switch,@function\n"
    "colibri_emu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  subq $8, %rsp\n  stmxcsr (%rsp)\n  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n  fldcw 4(%rsp)\n  addq $8, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n"
    ".size colibri_emu_switch, .-colibri_emu_switch\n"
    ".popsection\n");
#endif

struct Thread {
#if COLIBRI_EMU_FAST_SWITCH
  void* sp = nullptr;
#else
  ucontext_t ctx;
#endif
  std::unique_ptr<char[]> stack;  // not value-initialised: untouched pages stay unmapped
  State state = Runnable;
  unsigned tid = 0;
};

constexpr size_t kStackBytes = 256 * 1024;

struct Sched {
  std::mutex mu;  // one launch at a time (host threads may launch concurrently)
  std::vector<Thread> threads;
  int cur = 0;
#if COLIBRI_EMU_FAST_SWITCH
  void* main_sp = nullptr;
#else
  ucontext_t main_ctx;
#endif
  std::function<void()> body;
  uint64_t xchg[32][32];  // shuffle exchange: [warp][lane]
  std::vector<char> dyn_smem;
  long long launches = 0;
};
inline Sched sched;
inline void* dyn_smem = nullptr;

inline void yield(State s) {
  Thread& t = sched.threads[static_cast<size_t>(sched.cur)];
  t.state = s;
#if COLIBRI_EMU_FAST_SWITCH
  colibri_emu_switch(&t.sp, sched.main_sp);
#else
  swapcontext(&t.ctx, &sched.main_ctx);
#endif
}

inline void entry() {
  sched.body();
  sched.threads[static_cast<size_t>(sched.cur)].state = Done;
#if COLIBRI_EMU_FAST_SWITCH
  void* dead = nullptr;
  colibri_emu_switch(&dead, sched.main_sp);  // never resumed
  std::abort();
#endif
}

// A fresh fiber for thread t, starting at entry().
inline void start(Thread& t) {
  if (!t.stack) t.stack.reset(new char[kStackBytes]);
#if COLIBRI_EMU_ASAN
  // (Frames that never returned, entry()'s, left their redzones poisoned.)
  __asan_unpoison_memory_region(t.stack.get(), kStackBytes);
#endif
#if COLIBRI_EMU_FAST_SWITCH
  uintptr_t top = (reinterpret_cast<uintptr_t>(t.stack.get()) + kStackBytes) & ~uintptr_t{15};
  uint64_t* p = reinterpret_cast<uint64_t*>(top);
  *--p = 0;                                      // entry()'s return address (it never returns)
  *--p = reinterpret_cast<uint64_t>(&entry);     // where colibri_emu_switch returns to
  for (int i = 0; i < 6; ++i) *--p = 0;          // rbp, rbx, r12..r15
  *--p = 0;
  uint32_t mxcsr;
  uint16_t fpucw;
  __asm__ volatile("stmxcsr %0" : "=m"(mxcsr));
  __asm__ volatile("fnstcw %0" : "=m"(fpucw));
  std::memcpy(p, &mxcsr, 4);
  std::memcpy(reinterpret_cast<char*>(p) + 4, &fpucw, 2);
  t.sp = p;
#else
  getcontext(&t.ctx);
  t.ctx.uc_stack.ss_sp = t.stack.get();
  t.ctx.uc_stack.ss_size = kStackBytes;
  t.ctx.uc_link = &sched.main_ctx;
  makecontext(&t.ctx, entry, 0);
#endif
}

inline void resume(Thread& t) {
#if COLIBRI_EMU_FAST_SWITCH
  colibri_emu_switch(&sched.main_sp, t.sp);
#else
  swapcontext(&sched.main_ctx, &t.ctx);
#endif
}

template <class T>
T exchange(T v, int src_lane) {
  static_assert(sizeof(T) <= 8, "shuffle of a value over 8 bytes");
  const unsigned lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof v);
  sched.xchg[w][lane] = b;
  yield(AtWarpBarrier);
  const uint64_t r = sched.xchg[w][src_lane & 31];
  yield(AtWarpBarrier);  // nobody overwrites the slots before every lane read
  T out;
  std::memcpy(&out, &r, sizeof out);
  return out;
}

// The launch error of a configuration (0: none), as a GPU would report it.
inline int check_launch(dim3 grid, dim3 block, size_t smem) {
  if (grid.x < 1 || grid.y < 1 || grid.z < 1 || block.x < 1 || block.y < 1 || block.z < 1 ||
      block.x * block.y * block.z > 1024 || grid.y > 65535 || grid.z > 65535)
    return 9;  // cudaErrorInvalidConfiguration
  if (smem > 48 * 1024) return 1;  // cudaErrorInvalidValue (over the default limit without opt-in)
  if (grid.y != 1 || grid.z != 1 || block.y != 1 || block.z != 1) fail("2-D and 3-D grids are not emulated");
  if (block.x % 32) fail("a block that is not a whole number of warps is not emulated");
  return 0;
}

// Runs every block of a (checked) grid.
// (swapcontext "returns twice" as far as GCC knows, but it saves and restores the
// registers itself: nothing here is clobbered.)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wclobbered"
#endif
inline void run_grid(dim3 grid, dim3 block, size_t smem, std::function<void()> body) {
  std::lock_guard<std::mutex> lock(sched.mu);
  ++sched.launches;
  sched.body = std::move(body);
  gridDim = uint3{grid.x, 1, 1};
  blockDim = uint3{block.x, 1, 1};
  const int n = static_cast<int>(block.x), nw = n / 32;
  if (sched.threads.size() < static_cast<size_t>(n)) sched.threads.resize(static_cast<size_t>(n));
  for (unsigned b = 0; b < grid.x; ++b) {
    blockIdx = uint3{b, 0, 0};
    sched.dyn_smem.assign(smem ? smem : 1, static_cast<char>(0xff));  // NaN floats
    dyn_smem = sched.dyn_smem.data();
    for (int i = 0; i < n; ++i) {
      Thread& t = sched.threads[static_cast<size_t>(i)];
      start(t);
      t.state = Runnable;
      t.tid = static_cast<unsigned>(i);
    }
    for (;;) {
      bool ran = false;
      for (int i = 0; i < n; ++i) {
        Thread& t = sched.threads[static_cast<size_t>(i)];
        if (t.state != Runnable) continue;
        sched.cur = i;
        threadIdx = uint3{t.tid, 0, 0};
        resume(t);
        ran = true;
      }
      int done = 0, at_block = 0;
      for (int i = 0; i < n; ++i) {
        const State s = sched.threads[static_cast<size_t>(i)].state;
        done += s == Done, at_block += s == AtBlockBarrier;
      }
      if (done == n) break;
      bool released = false;
      for (int w = 0; w < nw; ++w) {
        int c[4] = {0, 0, 0, 0};
        for (int l = 0; l < 32; ++l) ++c[sched.threads[static_cast<size_t>(w * 32 + l)].state];
        if (c[AtWarpBarrier] == 32) {
          for (int l = 0; l < 32; ++l) sched.threads[static_cast<size_t>(w * 32 + l)].state = Runnable;
          released = true;
        } else if (c[AtWarpBarrier] > 0 && c[Runnable] == 0) {
          threadIdx = uint3{static_cast<unsigned>(w * 32), 0, 0};
          fail("a warp barrier or shuffle that not every lane of the warp reaches");
        }
      }
      if (at_block == n) {
        for (int i = 0; i < n; ++i) sched.threads[static_cast<size_t>(i)].state = Runnable;
        released = true;
      } else if (at_block > 0 && done > 0 && at_block + done == n) {
        fail("__syncthreads that some threads of the block exited before reaching");
      }
      if (!ran && !released) fail("deadlock: threads wait at different barriers");
    }
  }
  sched.body = nullptr;
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace emu

inline void __syncthreads() { emu::yield(emu::AtBlockBarrier); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) emu::fail("__syncwarp with a partial mask is not emulated");
  emu::yield(emu::AtWarpBarrier);
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  if (mask != 0xffffffffu || width != 32) emu::fail("a partial-mask or sub-warp shuffle is not emulated");
  return emu::exchange(v, static_cast<int>(threadIdx.x & 31) ^ lane_mask);
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  if (mask != 0xffffffffu || width != 32) emu::fail("a partial-mask or sub-warp shuffle is not emulated");
  return emu::exchange(v, src_lane);
}
