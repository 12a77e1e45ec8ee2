// gpu_experts.cpp: experts resident on a GPU (see gpu_experts.h).
#include "worker/gpu_experts.h"

#include <string>

#include "model/error.h"

#ifdef COLIBRI_HAVE_CUDA
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_info.h"
#include "kernels/cuda/ffn.h"
#include "kernels/cuda/ffn_pack.h"
#endif

namespace colibri {

#ifdef COLIBRI_HAVE_CUDA
namespace {

class CudaExperts final : public GpuExperts {
 public:
  CudaExperts(std::shared_ptr<const ColibriFile> file, const FfnSpec& spec, const std::vector<uint64_t>& owned,
              int64_t max_rows, int device, int rank)
      : file_(std::move(file)), spec_(spec), device_(device), experts_(file_->config().num_experts) {
    const int n = cuda::device_count();
    if (n == 0)
      throw Error(Status::Unsupported, "rank " + std::to_string(rank) + ": --device cuda, but no CUDA device is visible");
    if (device < 0 || device >= n)
      throw Error(Status::InvalidArgument, "rank " + std::to_string(rank) + ": GPU " + std::to_string(device) +
                                               " does not exist (" + std::to_string(n) + " visible)");
    COLIBRI_CUDA_CHECK(cudaSetDevice(device));
    COLIBRI_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_.s, cudaStreamNonBlocking));
    bool biases = false;
    for (uint64_t k : owned) {
      const ExpertView& v = file_->expert(static_cast<int>(k / experts_), static_cast<int>(k % experts_));
      const FfnWeights w = FfnWeights::of(v);
      biases = biases || w.gate_bias || w.up_bias || w.down_bias;
    }
    layout_ = cuda::PackedFfnLayout::of(cuda::shape_of(spec_), biases);
    size_t free_b = 0, total_b = 0;
    COLIBRI_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    // Experts, then per row: in/out/gather/scatter f32 (16 H), x as bf16 (2 H), gate|up f32 (8 I),
    // h bf16 (2 I); the GEMM workspace; 10% headroom.
    const size_t R = static_cast<size_t>(max_rows), H = static_cast<size_t>(spec_.hidden),
                 I = static_cast<size_t>(spec_.inter);
    const size_t need = (layout_.bytes * owned.size() + R * (18 * H + 10 * I) + (size_t{32} << 20)) / 10 * 11;
    if (need > free_b)
      throw Error(Status::OutOfMemory, "rank " + std::to_string(rank) + ": its " + std::to_string(owned.size()) +
                                           " experts need " + std::to_string(need >> 20) + " MiB on GPU " +
                                           std::to_string(device) + ", " + std::to_string(free_b >> 20) +
                                           " MiB are free (more ranks or another placement spread them)");
    weights_ = cuda::DeviceBuffer(layout_.bytes * owned.size());
    slot_of_.assign(static_cast<size_t>(file_->config().num_moe_layers() * experts_), -1);
    std::vector<char> staging(layout_.bytes);
    for (size_t i = 0; i < owned.size(); ++i) {
      const uint64_t k = owned[i];
      const ExpertView& v = file_->expert(static_cast<int>(k / experts_), static_cast<int>(k % experts_));
      file_->verify_expert(v);  // Error(Checksum) on a corrupt block, before it reaches the GPU
      cuda::pack_ffn(FfnWeights::of(v), spec_, layout_, staging.data());
      weights_.upload(staging.data(), layout_.bytes, layout_.bytes * i);
      slot_of_[k] = static_cast<int32_t>(i);
      stats_.misses += 1;
      stats_.bytes_loaded += layout_.bytes;
    }
    // NOTE: the uploads ran on the legacy stream; the compute stream does not wait for it.
    COLIBRI_CUDA_CHECK(cudaDeviceSynchronize());
    in_ = cuda::DeviceBuffer(static_cast<size_t>(max_rows * spec_.hidden) * 4);
    out_ = cuda::DeviceBuffer(static_cast<size_t>(max_rows * spec_.hidden) * 4);
    xg_ = cuda::DeviceBuffer(static_cast<size_t>(max_rows * spec_.hidden) * 4);
    yg_ = cuda::DeviceBuffer(static_cast<size_t>(max_rows * spec_.hidden) * 4);
    runner_ = std::make_unique<cuda::FfnRunner>(cuda::shape_of(spec_), max_rows, stream_.s);
  }
  ~CudaExperts() override {
    cudaSetDevice(device_);
    runner_.reset();
  }

  void begin(const float* in, int64_t rows) override {
    COLIBRI_CUDA_CHECK(cudaSetDevice(device_));
    if (rows > 0)
      COLIBRI_CUDA_CHECK(cudaMemcpyAsync(in_.get(), in, static_cast<size_t>(rows * spec_.hidden) * 4,
                                         cudaMemcpyHostToDevice, stream_.s));
  }

  void run(int layer, int expert, const std::vector<std::pair<int64_t, int64_t>>& runs) override {
    COLIBRI_CUDA_CHECK(cudaSetDevice(device_));
    const int32_t slot = slot_of_[static_cast<size_t>(layer) * experts_ + expert];
    if (slot < 0)
      throw Error(Status::Internal, "GPU " + std::to_string(device_) + " holds no expert " + std::to_string(expert) +
                                        " of layer " + std::to_string(layer));
    const cuda::DeviceFfn w =
        cuda::DeviceFfn::at(static_cast<const char*>(weights_.get()) + layout_.bytes * static_cast<size_t>(slot), layout_);
    const size_t row = static_cast<size_t>(spec_.hidden) * 4;
    ++stats_.hits;
    if (runs.size() == 1) {  // contiguous: in place
      const int64_t at = runs[0].first;
      runner_->run(w, in_.as<float>() + at * spec_.hidden, runs[0].second, out_.as<float>() + at * spec_.hidden);
      return;
    }
    int64_t g = 0;
    for (const auto& [at, n] : runs) {
      COLIBRI_CUDA_CHECK(cudaMemcpyAsync(xg_.as<float>() + g * spec_.hidden, in_.as<float>() + at * spec_.hidden,
                                         static_cast<size_t>(n) * row, cudaMemcpyDeviceToDevice, stream_.s));
      g += n;
    }
    runner_->run(w, xg_.as<float>(), g, yg_.as<float>());
    g = 0;
    for (const auto& [at, n] : runs) {
      COLIBRI_CUDA_CHECK(cudaMemcpyAsync(out_.as<float>() + at * spec_.hidden, yg_.as<float>() + g * spec_.hidden,
                                         static_cast<size_t>(n) * row, cudaMemcpyDeviceToDevice, stream_.s));
      g += n;
    }
  }

  void end(float* out, int64_t rows) override {
    COLIBRI_CUDA_CHECK(cudaSetDevice(device_));
    if (rows > 0)
      COLIBRI_CUDA_CHECK(cudaMemcpyAsync(out, out_.get(), static_cast<size_t>(rows * spec_.hidden) * 4,
                                         cudaMemcpyDeviceToHost, stream_.s));
    cuda::synchronize(stream_.s);
  }

  CacheStats stats() const override { return stats_; }
  int device() const override { return device_; }

 private:
  std::shared_ptr<const ColibriFile> file_;
  FfnSpec spec_;
  int device_;
  int64_t experts_;
  struct Stream {  // destroyed last, also when the constructor throws
    cudaStream_t s = nullptr;
    ~Stream() {
      if (s) cudaStreamDestroy(s);
    }
  };
  Stream stream_;
  cuda::PackedFfnLayout layout_;
  cuda::DeviceBuffer weights_, in_, out_, xg_, yg_;
  std::vector<int32_t> slot_of_;  // [key] -> slot in weights_ or -1
  std::unique_ptr<cuda::FfnRunner> runner_;
  CacheStats stats_;
};

}  // namespace
#endif

std::unique_ptr<GpuExperts> make_gpu_experts(std::shared_ptr<const ColibriFile> file, const FfnSpec& spec,
                                             const std::vector<uint64_t>& owned, int64_t max_rows, int device, int rank) {
#ifdef COLIBRI_HAVE_CUDA
  return std::make_unique<CudaExperts>(std::move(file), spec, owned, max_rows, device, rank);
#else
  (void)file, (void)spec, (void)owned, (void)max_rows, (void)device;
  throw Error(Status::Unsupported, "rank " + std::to_string(rank) +
                                       ": --device cuda, but this build has no CUDA (nvcc was not found at configure time)");
#endif
}

}  // namespace colibri
