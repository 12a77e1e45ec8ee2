// cuda_check.h: every CUDA runtime and cuBLASLt call is checked; a failure
// throws colibri::Error naming the call, the file and line, and CUDA's message
// (Status::OutOfMemory for an allocation failure, Status::Internal otherwise).
// For CUDA translation units and host files that include the CUDA headers.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

namespace colibri::cuda {
[[noreturn]] void fail_cuda(cudaError_t e, const char* call, const char* file, int line);
[[noreturn]] void fail_cublas(cublasStatus_t s, const char* call, const char* file, int line);
}  // namespace colibri::cuda

#define COLIBRI_CUDA_CHECK(call)                                                          \
  do {                                                                                    \
    const cudaError_t e_ = (call);                                                        \
    if (e_ != cudaSuccess) ::colibri::cuda::fail_cuda(e_, #call, __FILE__, __LINE__);     \
  } while (0)

#define COLIBRI_CUBLAS_CHECK(call)                                                              \
  do {                                                                                          \
    const cublasStatus_t s_ = (call);                                                           \
    if (s_ != CUBLAS_STATUS_SUCCESS) ::colibri::cuda::fail_cublas(s_, #call, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: launch errors (bad configuration) surface here.
#define COLIBRI_CUDA_LAUNCH_CHECK(what) COLIBRI_CUDA_CHECK(cudaPeekAtLastError())
