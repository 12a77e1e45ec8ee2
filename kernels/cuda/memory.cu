// memory.cu: pinned host buffers, streams, events and asynchronous copies
// (see memory.h).
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/memory.h"
#include "model/error.h"

namespace colibri::cuda {

namespace {
cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t as_event(void* e) { return static_cast<cudaEvent_t>(e); }
}  // namespace

void set_device(int device) { COLIBRI_CUDA_CHECK(cudaSetDevice(device)); }

void set_device_quietly(int device) noexcept {
  if (cudaSetDevice(device) != cudaSuccess) cudaGetLastError();
}

size_t free_device_memory() {
  size_t free_b = 0, total_b = 0;
  COLIBRI_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return free_b;
}

PinnedBuffer::PinnedBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes) COLIBRI_CUDA_CHECK(cudaHostAlloc(&p_, bytes, cudaHostAllocDefault));
}

PinnedBuffer PinnedBuffer::try_allocate(size_t bytes) {
  PinnedBuffer b;
  if (!bytes) return b;
  void* p = nullptr;
  if (cudaHostAlloc(&p, bytes, cudaHostAllocDefault) != cudaSuccess) {
    cudaGetLastError();  // clear the (non-sticky) allocation error
    return b;
  }
  b.p_ = p;
  b.bytes_ = bytes;
  return b;
}

PinnedBuffer::~PinnedBuffer() {
  if (p_) cudaFreeHost(p_);
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept : p_(o.p_), bytes_(o.bytes_) {
  o.p_ = nullptr;
  o.bytes_ = 0;
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    if (p_) cudaFreeHost(p_);
    p_ = o.p_;
    bytes_ = o.bytes_;
    o.p_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

Stream::Stream() {
  cudaStream_t s = nullptr;
  COLIBRI_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  s_ = s;
}

Stream::~Stream() {
  if (s_) cudaStreamDestroy(as_stream(s_));
}

void Stream::synchronize() {
  COLIBRI_CUDA_CHECK(cudaStreamSynchronize(as_stream(s_)));
  COLIBRI_CUDA_CHECK(cudaGetLastError());
}

void Stream::drain() noexcept {
  if (s_) cudaStreamSynchronize(as_stream(s_));
  cudaGetLastError();
}

Event::Event() {
  cudaEvent_t e = nullptr;
  COLIBRI_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  ev_ = e;
}

Event::~Event() {
  if (ev_) cudaEventDestroy(as_event(ev_));
}

Event::Event(Event&& o) noexcept : ev_(o.ev_), recorded_(o.recorded_) {
  o.ev_ = nullptr;
  o.recorded_ = false;
}

Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    if (ev_) cudaEventDestroy(as_event(ev_));
    ev_ = o.ev_;
    recorded_ = o.recorded_;
    o.ev_ = nullptr;
    o.recorded_ = false;
  }
  return *this;
}

void Event::record(void* stream) {
  COLIBRI_CUDA_CHECK(cudaEventRecord(as_event(ev_), as_stream(stream)));
  recorded_ = true;
}

void Event::wait_in(void* stream) const {
  if (recorded_) COLIBRI_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream), as_event(ev_), 0));
}

void Event::synchronize() const {
  if (recorded_) COLIBRI_CUDA_CHECK(cudaEventSynchronize(as_event(ev_)));
}

void copy_async(void* dst, const void* src, size_t bytes, Copy kind, void* stream) {
  if (!bytes) return;
  const cudaMemcpyKind k = kind == Copy::HostToDevice   ? cudaMemcpyHostToDevice
                           : kind == Copy::DeviceToHost ? cudaMemcpyDeviceToHost
                                                        : cudaMemcpyDeviceToDevice;
  COLIBRI_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, k, as_stream(stream)));
}

StreamGraph::~StreamGraph() {
  if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
}
StreamGraph::StreamGraph(StreamGraph&& o) noexcept : exec_(o.exec_) { o.exec_ = nullptr; }
StreamGraph& StreamGraph::operator=(StreamGraph&& o) noexcept {
  if (this != &o) {
    if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
    exec_ = o.exec_;
    o.exec_ = nullptr;
  }
  return *this;
}

void StreamGraph::begin_capture(void* stream) {
  // NOTE: thread-local mode: other threads' CUDA calls (a worker's streams) do
  // not invalidate this capture.
  COLIBRI_CUDA_CHECK(cudaStreamBeginCapture(as_stream(stream), cudaStreamCaptureModeThreadLocal));
}

void StreamGraph::abandon_capture(void* stream) noexcept {
  cudaGraph_t g = nullptr;
  if (cudaStreamEndCapture(as_stream(stream), &g) == cudaSuccess && g) cudaGraphDestroy(g);
  cudaGetLastError();
}

StreamGraph StreamGraph::end_capture(void* stream) {
  cudaGraph_t g = nullptr;
  COLIBRI_CUDA_CHECK(cudaStreamEndCapture(as_stream(stream), &g));
  StreamGraph sg;
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
  cudaGraphDestroy(g);
  COLIBRI_CUDA_CHECK(e);
  sg.exec_ = exec;
  return sg;
}

void StreamGraph::launch(void* stream) const {
  if (!exec_) throw Error(Status::Internal, "launching an empty CUDA graph");
  COLIBRI_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), as_stream(stream)));
}

}  // namespace colibri::cuda
