// device_info.cu: the first CUDA translation unit: queries the GPUs present.
// Compiled whenever nvcc is found, so CUDA code is always built and linked,
// even on machines without a GPU (where it reports zero devices).
#include <cuda_runtime.h>

#include "kernels/cuda/device_info.h"

namespace colibri::cuda {

__global__ void probe_kernel(int* out) { out[threadIdx.x] = static_cast<int>(threadIdx.x); }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

}  // namespace colibri::cuda
