// memory.h: small RAII wrappers over the CUDA runtime for moving data between
// host and device asynchronously: page-locked (pinned) host buffers, streams,
// events, asynchronous copies. No CUDA types here: streams and events are held
// as void*, so host code (worker/gpu_experts.cpp) and tests use them without
// the CUDA headers. Every call is checked (kernels/cuda/cuda_check.h): a failure
// throws colibri::Error naming the call (OutOfMemory for allocation failures).
#pragma once
#include <cstddef>

namespace colibri::cuda {

void set_device(int device);        // cudaSetDevice
void set_device_quietly(int device) noexcept;  // the same, errors ignored (teardown, error paths)
size_t free_device_memory();        // cudaMemGetInfo's free bytes on the current device

// Page-locked host memory (cudaHostAlloc): the source of asynchronous host-to-
// device copies that overlap with kernels (pageable memory would be staged by
// the driver, synchronously).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t bytes);              // throws Error(OutOfMemory) when it fails
  static PinnedBuffer try_allocate(size_t bytes);   // empty() when the allocation fails (no throw)
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& o) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void* get() const { return p_; }
  char* data() const { return static_cast<char*>(p_); }
  size_t bytes() const { return bytes_; }
  bool empty() const { return p_ == nullptr; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// A non-blocking stream (does not synchronise with the legacy default stream).
class Stream {
 public:
  Stream();
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  void* get() const { return s_; }
  void synchronize();  // waits for it; checks for errors
  void drain() noexcept;  // waits for it, ignoring and clearing errors (teardown, error paths)

 private:
  void* s_ = nullptr;
};

// An event without timing (the cheapest kind), for ordering work across streams.
class Event {
 public:
  Event();
  ~Event();
  Event(Event&& o) noexcept;
  Event& operator=(Event&& o) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(void* stream);               // cudaEventRecord
  bool recorded() const { return recorded_; }
  // Work queued on `stream` after this call waits for the last record (a no-op
  // when the event was never recorded).
  void wait_in(void* stream) const;
  void synchronize() const;                // the host waits for the last record (no-op if never recorded)

 private:
  void* ev_ = nullptr;
  bool recorded_ = false;
};

// A CUDA graph of the work that one call queues on a stream: captured once
// (nothing runs while capturing), then replayed with launch() as one submission
// instead of a launch per kernel. What is captured is fixed: kernel arguments,
// pointers and sizes; the memory they point at is read at each replay. No
// synchronisation and no copy from pageable memory may happen while capturing.
class StreamGraph {
 public:
  StreamGraph() = default;
  ~StreamGraph();
  StreamGraph(StreamGraph&& o) noexcept;
  StreamGraph& operator=(StreamGraph&& o) noexcept;
  StreamGraph(const StreamGraph&) = delete;
  StreamGraph& operator=(const StreamGraph&) = delete;
  template <class F>
  static StreamGraph capture(void* stream, F&& issue) {
    begin_capture(stream);
    try {
      issue();
    } catch (...) {
      abandon_capture(stream);
      throw;
    }
    return end_capture(stream);
  }
  void launch(void* stream) const;  // queues the whole graph on `stream`
  bool empty() const { return exec_ == nullptr; }

 private:
  static void begin_capture(void* stream);
  static void abandon_capture(void* stream) noexcept;
  static StreamGraph end_capture(void* stream);
  void* exec_ = nullptr;
};

enum class Copy { HostToDevice, DeviceToHost, DeviceToDevice };
// cudaMemcpyAsync on `stream`; overlaps with other streams' work only when the
// host side is pinned.
void copy_async(void* dst, const void* src, size_t bytes, Copy kind, void* stream);

}  // namespace colibri::cuda
