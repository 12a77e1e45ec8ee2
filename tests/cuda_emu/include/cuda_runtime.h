// cuda_runtime.h of the CPU emulator (tests/cuda_emu/emu.h says what it does and
// does not prove): the part of the CUDA runtime API that Colibri uses, on host
// memory. One device (0) of 8 GiB; device allocations are tracked, so copies,
// memsets and GEMM operands outside them abort; streams and events are checked
// handles; work queued on a stream runs when something waits for it ("the work
// queues" below). Errors are returned, and kept for cudaGetLastError /
// cudaPeekAtLastError, as the real runtime does.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <stdlib.h>  // posix_memalign

#include "../emu.h"
#include "library_types.h"

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInvalidMemcpyDirection = 21,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
};
typedef cudaError_t cudaError;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

struct CUstream_st;
struct CUevent_st;
typedef CUstream_st* cudaStream_t;
typedef CUevent_st* cudaEvent_t;
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal = 0, cudaStreamCaptureModeThreadLocal = 1, cudaStreamCaptureModeRelaxed = 2 };

constexpr unsigned cudaStreamDefault = 0, cudaStreamNonBlocking = 1;
constexpr unsigned cudaEventDefault = 0, cudaEventBlockingSync = 1, cudaEventDisableTiming = 2;
constexpr unsigned cudaHostAllocDefault = 0, cudaHostAllocPortable = 1, cudaHostAllocMapped = 2;

struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  int multiProcessorCount;
  int major, minor;
  int warpSize;
  int maxThreadsPerBlock;
  size_t sharedMemPerBlock;
  int l2CacheSize;
  int clockRate;
  int memoryClockRate;
  int memoryBusWidth;
};

namespace emu {

constexpr size_t kDeviceBytes = size_t{8} << 30;

struct Runtime {
  std::mutex mu;
  std::map<uintptr_t, size_t> device;  // start -> bytes
  std::map<uintptr_t, size_t> pinned;  // start -> bytes
  std::set<const void*> streams, events;
  std::map<const void*, unsigned> event_flags;
  size_t used = 0;
  int current = 0;
};
inline Runtime rt;
inline thread_local cudaError_t last_error = cudaSuccess;

inline cudaError_t err(cudaError_t e) {
  if (e != cudaSuccess) last_error = e;
  return e;
}

inline bool in_range(const std::map<uintptr_t, size_t>& m, const void* p, size_t n) {
  std::lock_guard<std::mutex> lock(rt.mu);
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = m.upper_bound(a);
  if (it == m.begin()) return false;
  --it;
  return a >= it->first && a + n <= it->first + it->second;
}
// Whether [p, p + n) lies inside one device allocation.
inline bool in_device(const void* p, size_t n) { return in_range(rt.device, p, n); }
// Whether [p, p + n) lies inside one page-locked host allocation.
inline bool in_pinned(const void* p, size_t n) { return in_range(rt.pinned, p, n); }
// Whether p points into a device allocation at all.
inline bool is_device(const void* p) { return in_device(p, 1); }

inline void require_device(const void* p, size_t n, const char* what) {
  if (n && !in_device(p, n)) {
    std::fprintf(stderr, "CUDA EMULATOR: %s: [%p, +%zu) is not inside one device allocation\n", what, p, n);
    std::fflush(stderr);
    std::abort();
  }
}
inline void require_host(const void* p, size_t n, const char* what) {
  if (n && is_device(p)) {
    std::fprintf(stderr, "CUDA EMULATOR: %s: %p is device memory where host memory was said\n", what, p);
    std::fflush(stderr);
    std::abort();
  }
}

inline bool valid_stream(cudaStream_t s) {
  if (!s) return true;  // the legacy default stream
  std::lock_guard<std::mutex> lock(rt.mu);
  return rt.streams.count(s) != 0;
}
inline bool valid_event(cudaEvent_t e) {
  std::lock_guard<std::mutex> lock(rt.mu);
  return e && rt.events.count(e) != 0;
}

// ---- the work queues of the streams ----
// Work queued on a stream (kernels, asynchronous copies and memsets, GEMMs,
// sorts) runs only when something waits for it: a stream or event
// synchronisation, a stream waiting for an event of another stream (when the
// waiting stream gets there), cudaDeviceSynchronize, cudaFree / cudaFreeHost
// (which synchronise the device), a synchronous copy or memset (the legacy
// stream's work first; not the non-blocking streams'), a copy to pageable host
// memory (its stream's work first). So the host reading a result before waiting
// for it, a stream using another's result without an event, or the host
// overwriting pinned memory that a queued copy still reads, all see stale data.
// Copies from pageable memory take their source at once (CUDA stages it).
// COLIBRI_EMU_IMMEDIATE=1 in the environment runs all work when it is queued.
inline bool deferred() {
  static const bool d = [] {
    const char* e = std::getenv("COLIBRI_EMU_IMMEDIATE");
    return !(e && *e && *e != '0');
  }();
  return d;
}
struct Queue {
  std::deque<std::function<void()>> ops;
  uint64_t queued = 0, done = 0;
};
// A stream being captured into a graph: what is queued on it is recorded, not
// run (cudaStreamBeginCapture .. cudaStreamEndCapture); a graph launch queues
// the recorded work again (the same operations with the same arguments).
struct Graph {
  std::vector<std::function<void()>> ops;
  bool invalid = false;  // something not permitted happened while capturing
};
struct Queues {
  std::recursive_mutex mu;
  std::map<const void*, Queue> q;                                 // nullptr: the legacy default stream
  std::map<const void*, std::pair<const void*, uint64_t>> marks;  // event -> (stream, position)
  std::map<const void*, Graph> capturing;                         // stream -> the graph being captured
};
inline Queues queues;

// The capture of `stream`, or null when it is not being captured.
inline Graph* capture_of(const void* stream) {
  std::lock_guard<std::recursive_mutex> lock(queues.mu);
  auto it = queues.capturing.find(stream);
  return it == queues.capturing.end() ? nullptr : &it->second;
}
// An operation not permitted on a capturing stream: the capture is invalidated.
inline bool refuse_if_capturing(const void* stream) {
  Graph* g = capture_of(stream);
  if (!g) return false;
  g->invalid = true;
  return true;
}

inline void enqueue(const void* stream, std::function<void()> op) {
  if (Graph* g = capture_of(stream)) {
    g->ops.push_back(std::move(op));
    return;
  }
  if (!deferred()) {
    op();
    return;
  }
  std::lock_guard<std::recursive_mutex> lock(queues.mu);
  Queue& q = queues.q[stream];
  q.ops.push_back(std::move(op));
  ++q.queued;
}
// Runs the stream's work up to position `pos` (its first `pos` operations).
inline void run_until(const void* stream, uint64_t pos) {
  std::lock_guard<std::recursive_mutex> lock(queues.mu);
  Queue& q = queues.q[stream];  // (std::map: references stay valid)
  while (q.done < pos && !q.ops.empty()) {
    std::function<void()> op = std::move(q.ops.front());
    q.ops.pop_front();
    ++q.done;
    op();
  }
}
inline void run_stream(const void* stream) {
  std::lock_guard<std::recursive_mutex> lock(queues.mu);
  run_until(stream, queues.q[stream].queued);
}
inline void run_all() {
  std::lock_guard<std::recursive_mutex> lock(queues.mu);
  for (bool more = true; more;) {
    more = false;
    for (auto& [s, q] : queues.q)
      if (!q.ops.empty()) {
        run_stream(s);
        more = true;
      }
  }
}

// k<<<grid, block, smem, stream>>>(args...), as rewritten by prep.py: the
// arguments are evaluated once, here, and every thread gets its own copy.
template <class... P, class... A>
void launch(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, void (*kernel)(P...), A&&... args) {
  emu::RuntimeScope emu_runtime_scope_;
  if (!valid_stream(stream)) {
    err(cudaErrorInvalidResourceHandle);
    return;
  }
  if (const int e = check_launch(grid, block, smem)) {
    err(static_cast<cudaError_t>(e));
    return;
  }
  auto params = std::make_shared<std::tuple<std::decay_t<P>...>>(std::forward<A>(args)...);
  enqueue(stream, [=] {
    run_grid(grid, block, smem, [&] {
      std::tuple<std::decay_t<P>...> mine = *params;
      std::apply(kernel, mine);
    });
  });
}
}  // namespace emu

// ---- errors ------------------------------------------------------------------------
inline cudaError_t cudaGetLastError() {
  emu::RuntimeScope emu_runtime_scope_;
  const cudaError_t e = emu::last_error;
  emu::last_error = cudaSuccess;
  return e;
}
inline cudaError_t cudaPeekAtLastError() { return emu::last_error; }
inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
  }
  return "cudaErrorUnknown";
}
inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
  }
  return "unknown error";
}

// ---- devices -----------------------------------------------------------------------
inline cudaError_t cudaGetDeviceCount(int* n) {
  emu::RuntimeScope emu_runtime_scope_;
  *n = 1;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int d) {
  emu::RuntimeScope emu_runtime_scope_;
  if (d != 0) return emu::err(cudaErrorInvalidDevice);
  emu::rt.current = d;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* d) {
  emu::RuntimeScope emu_runtime_scope_;
  *d = emu::rt.current;
  return cudaSuccess;
}
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d) {
  emu::RuntimeScope emu_runtime_scope_;
  if (d != 0) return emu::err(cudaErrorInvalidDevice);
  *p = cudaDeviceProp{};
  std::snprintf(p->name, sizeof p->name, "CPU emulator (tests/cuda_emu)");
  p->totalGlobalMem = emu::kDeviceBytes;
  p->multiProcessorCount = 1, p->major = 9, p->minor = 0, p->warpSize = 32, p->maxThreadsPerBlock = 1024;
  p->sharedMemPerBlock = 48 * 1024;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceSynchronize() {
  emu::RuntimeScope emu_runtime_scope_;
  emu::run_all();
  return cudaSuccess;
}
inline cudaError_t cudaMemGetInfo(size_t* free_b, size_t* total_b) {
  emu::RuntimeScope emu_runtime_scope_;
  std::lock_guard<std::mutex> lock(emu::rt.mu);
  *free_b = emu::kDeviceBytes - emu::rt.used;
  *total_b = emu::kDeviceBytes;
  return cudaSuccess;
}

// ---- memory ------------------------------------------------------------------------
inline cudaError_t cudaMalloc(void** p, size_t bytes) {
  emu::RuntimeScope emu_runtime_scope_;
  *p = nullptr;
  {
    std::lock_guard<std::mutex> lock(emu::rt.mu);
    if (bytes > emu::kDeviceBytes - emu::rt.used) return emu::err(cudaErrorMemoryAllocation);
  }
  // 256-byte aligned, as cudaMalloc's pointers are, and exactly `bytes` long (so
  // AddressSanitizer sees an access past the end); NaN bytes (nothing is zeroed).
  void* q = nullptr;
  if (posix_memalign(&q, 256, bytes ? bytes : 1) != 0) return emu::err(cudaErrorMemoryAllocation);
  std::memset(q, 0xff, bytes);
  std::lock_guard<std::mutex> lock(emu::rt.mu);
  emu::rt.device[reinterpret_cast<uintptr_t>(q)] = bytes;
  emu::rt.used += bytes;
  *p = q;
  return cudaSuccess;
}
template <class T>
cudaError_t cudaMalloc(T** p, size_t bytes) {
  emu::RuntimeScope emu_runtime_scope_;
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
inline cudaError_t cudaFree(void* p) {
  emu::RuntimeScope emu_runtime_scope_;
  if (!p) return cudaSuccess;
  emu::run_all();  // cudaFree synchronises the device
  {
    std::lock_guard<std::mutex> lock(emu::rt.mu);
    auto it = emu::rt.device.find(reinterpret_cast<uintptr_t>(p));
    if (it == emu::rt.device.end()) return emu::err(cudaErrorInvalidDevicePointer);
    emu::rt.used -= it->second;
    emu::rt.device.erase(it);
  }
  std::free(p);
  return cudaSuccess;
}
inline cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned = 0) {
  emu::RuntimeScope emu_runtime_scope_;
  *p = std::malloc(bytes ? bytes : 1);
  if (!*p) return emu::err(cudaErrorMemoryAllocation);
  std::lock_guard<std::mutex> lock(emu::rt.mu);
  emu::rt.pinned[reinterpret_cast<uintptr_t>(*p)] = bytes ? bytes : 1;
  return cudaSuccess;
}
inline cudaError_t cudaMallocHost(void** p, size_t bytes) { return cudaHostAlloc(p, bytes); }
inline cudaError_t cudaFreeHost(void* p) {
  emu::RuntimeScope emu_runtime_scope_;
  if (!p) return cudaSuccess;
  emu::run_all();  // as cudaFree
  {
    std::lock_guard<std::mutex> lock(emu::rt.mu);
    if (!emu::rt.pinned.erase(reinterpret_cast<uintptr_t>(p))) return emu::err(cudaErrorInvalidValue);
  }
  std::free(p);
  return cudaSuccess;
}

namespace emu {
// Checks a copy's direction against where its pointers are (aborts on a mismatch).
inline bool check_copy(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  switch (kind) {
    case cudaMemcpyHostToDevice:
      require_device(dst, n, "cudaMemcpy HostToDevice destination");
      require_host(src, n, "cudaMemcpy HostToDevice source");
      return true;
    case cudaMemcpyDeviceToHost:
      require_device(src, n, "cudaMemcpy DeviceToHost source");
      require_host(dst, n, "cudaMemcpy DeviceToHost destination");
      return true;
    case cudaMemcpyDeviceToDevice:
      require_device(src, n, "cudaMemcpy DeviceToDevice source");
      require_device(dst, n, "cudaMemcpy DeviceToDevice destination");
      return true;
    case cudaMemcpyHostToHost:
    case cudaMemcpyDefault:
      return true;
  }
  return false;
}
}  // namespace emu

// Synchronous: after the legacy stream's work, done when it returns.
inline cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  emu::RuntimeScope emu_runtime_scope_;
  if (!n) return cudaSuccess;
  if (!emu::check_copy(dst, src, n, kind)) return emu::err(cudaErrorInvalidMemcpyDirection);
  emu::run_stream(nullptr);
  std::memmove(dst, src, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind kind,
                                   cudaStream_t s = nullptr) {
  emu::RuntimeScope emu_runtime_scope_;
  if (!emu::valid_stream(s)) return emu::err(cudaErrorInvalidResourceHandle);
  if (!n) return cudaSuccess;
  if (!emu::check_copy(dst, src, n, kind)) return emu::err(cudaErrorInvalidMemcpyDirection);
  const bool src_host = !emu::is_device(src), dst_host = !emu::is_device(dst);
  if (((dst_host && !emu::in_pinned(dst, n)) || (src_host && !emu::in_pinned(src, n))) &&
      emu::refuse_if_capturing(s))  // pageable memory cannot be captured
    return emu::err(cudaErrorStreamCaptureUnsupported);
  if (dst_host && !emu::in_pinned(dst, n)) {  // to pageable memory: synchronous
    emu::run_stream(s);
    std::memmove(dst, src, n);
  } else if (src_host && !emu::in_pinned(src, n)) {  // from pageable memory: staged at once
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src), static_cast<const char*>(src) + n);
    emu::enqueue(s, [=] { std::memcpy(dst, staged->data(), n); });
  } else {
    emu::enqueue(s, [=] { std::memmove(dst, src, n); });
  }
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t s = nullptr) {
  emu::RuntimeScope emu_runtime_scope_;
  if (!emu::valid_stream(s)) return emu::err(cudaErrorInvalidResourceHandle);
  emu::require_device(p, n, "cudaMemset");
  emu::enqueue(s, [=] { std::memset(p, v, n); });
  return cudaSuccess;
}
inline cudaError_t cudaMemset(void* p, int v, size_t n) {
  emu::RuntimeScope emu_runtime_scope_;
  const cudaError_t e = cudaMemsetAsync(p, v, n, nullptr);
  emu::run_stream(nullptr);
  return e;
}

// ---- streams and events (all work is already done when it is queued) ----------------
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  emu::RuntimeScope emu_runtime_scope_;
  *s = reinterpret_cast<cudaStream_t>(new char(0));
  std::lock_guard<std::mutex> lock(emu::rt.mu);
  emu::rt.streams.insert(*s);
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }
inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
  emu::RuntimeScope emu_runtime_scope_;
  if (emu::valid_stream(s) && s) {
    std::lock_guard<std::recursive_mutex> lock(emu::queues.mu);
    emu::run_stream(s);  // (its work completes after the destruction on a GPU)
    emu::queues.q.erase(s);
  }
  {
    std::lock_guard<std::mutex> lock(emu::rt.mu);
    if (!s || !emu::rt.streams.erase(s)) return emu::err(cudaErrorInvalidResourceHandle);
  }
  delete reinterpret_cast<char*>(s);
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  emu::RuntimeScope emu_runtime_scope_;
  if (!emu::valid_stream(s)) return emu::err(cudaErrorInvalidResourceHandle);
  if (emu::refuse_if_capturing(s)) return emu::err(cudaErrorStreamCaptureUnsupported);
  emu::run_stream(s);
  return cudaSuccess;
}
inline cudaError_t cudaStreamQuery(cudaStream_t s) { return cudaStreamSynchronize(s); }
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags) {
  emu::RuntimeScope emu_runtime_scope_;
  *e = reinterpret_cast<cudaEvent_t>(new char(0));
  std::lock_guard<std::mutex> lock(emu::rt.mu);
  emu::rt.events.insert(*e);
  emu::rt.event_flags[*e] = flags;
  return cudaSuccess;
}
inline cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  emu::RuntimeScope emu_runtime_scope_;
  {
    std::lock_guard<std::mutex> lock(emu::rt.mu);
    if (!e || !emu::rt.events.erase(e)) return emu::err(cudaErrorInvalidResourceHandle);
    emu::rt.event_flags.erase(e);
  }
  {
    std::lock_guard<std::recursive_mutex> lock(emu::queues.mu);
    emu::queues.marks.erase(e);
  }
  delete reinterpret_cast<char*>(e);
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = nullptr) {
  emu::RuntimeScope emu_runtime_scope_;
  if (!emu::valid_event(e) || !emu::valid_stream(s)) return emu::err(cudaErrorInvalidResourceHandle);
  // (CUDA captures it as an internal node the host cannot wait for: not emulated.)
  if (emu::refuse_if_capturing(s)) return emu::err(cudaErrorStreamCaptureUnsupported);
  std::lock_guard<std::recursive_mutex> lock(emu::queues.mu);
  emu::queues.marks[e] = {s, emu::queues.q[s].queued};
  return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  emu::RuntimeScope emu_runtime_scope_;
  if (!emu::valid_event(e)) return emu::err(cudaErrorInvalidResourceHandle);
  std::lock_guard<std::recursive_mutex> lock(emu::queues.mu);
  auto it = emu::queues.marks.find(e);
  if (it != emu::queues.marks.end()) {
    const auto m = it->second;
    emu::run_until(m.first, m.second);
  }
  return cudaSuccess;
}
inline cudaError_t cudaEventQuery(cudaEvent_t e) { return cudaEventSynchronize(e); }
inline cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned = 0) {
  emu::RuntimeScope emu_runtime_scope_;
  if (!emu::valid_event(e) || !emu::valid_stream(s)) return emu::err(cudaErrorInvalidResourceHandle);
  std::lock_guard<std::recursive_mutex> lock(emu::queues.mu);
  auto it = emu::queues.marks.find(e);
  if (it != emu::queues.marks.end()) {  // (an event never recorded: nothing to wait for)
    const auto m = it->second;
    emu::enqueue(s, [m] { emu::run_until(m.first, m.second); });
  }
  return cudaSuccess;
}
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
  emu::RuntimeScope emu_runtime_scope_;
  if (!emu::valid_event(a) || !emu::valid_event(b)) return emu::err(cudaErrorInvalidResourceHandle);
  std::lock_guard<std::mutex> lock(emu::rt.mu);
  if ((emu::rt.event_flags[a] | emu::rt.event_flags[b]) & cudaEventDisableTiming)
    return emu::err(cudaErrorInvalidResourceHandle);
  *ms = 0.0f;
  return cudaSuccess;
}

// ---- graphs (stream capture) ----------------------------------------------------------
struct CUgraph_st {
  std::vector<std::function<void()>> ops;
};
struct CUgraphExec_st {
  std::vector<std::function<void()>> ops;
};
typedef CUgraph_st* cudaGraph_t;
typedef CUgraphExec_st* cudaGraphExec_t;
inline cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode) {
  emu::RuntimeScope emu_runtime_scope_;
  if (!emu::valid_stream(s) || !s) return emu::err(cudaErrorInvalidResourceHandle);  // (not the legacy stream)
  std::lock_guard<std::recursive_mutex> lock(emu::queues.mu);
  if (emu::queues.capturing.count(s)) return emu::err(cudaErrorStreamCaptureUnsupported);
  emu::queues.capturing[s] = {};
  return cudaSuccess;
}
inline cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* g) {
  emu::RuntimeScope emu_runtime_scope_;
  if (!emu::valid_stream(s)) return emu::err(cudaErrorInvalidResourceHandle);
  std::lock_guard<std::recursive_mutex> lock(emu::queues.mu);
  auto it = emu::queues.capturing.find(s);
  if (it == emu::queues.capturing.end()) return emu::err(cudaErrorInvalidValue);
  emu::Graph cap = std::move(it->second);
  emu::queues.capturing.erase(it);
  *g = nullptr;
  if (cap.invalid) return emu::err(cudaErrorStreamCaptureInvalidated);
  *g = new CUgraph_st{std::move(cap.ops)};
  return cudaSuccess;
}
inline cudaError_t cudaGraphInstantiate(cudaGraphExec_t* e, cudaGraph_t g, unsigned long long = 0) {
  emu::RuntimeScope emu_runtime_scope_;
  if (!g) return emu::err(cudaErrorInvalidValue);
  *e = new CUgraphExec_st{g->ops};
  return cudaSuccess;
}
inline cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s) {
  emu::RuntimeScope emu_runtime_scope_;
  if (!e || !emu::valid_stream(s)) return emu::err(cudaErrorInvalidResourceHandle);
  for (const auto& op : e->ops) emu::enqueue(s, op);
  return cudaSuccess;
}
inline cudaError_t cudaGraphDestroy(cudaGraph_t g) {
  emu::RuntimeScope emu_runtime_scope_;
  delete g;
  return cudaSuccess;
}
inline cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) {
  emu::RuntimeScope emu_runtime_scope_;
  delete e;
  return cudaSuccess;
}
