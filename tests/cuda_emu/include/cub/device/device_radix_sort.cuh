// cub/device/device_radix_sort.cuh of the CPU emulator: DeviceRadixSort::SortPairs
// as a stable sort on the bits [begin_bit, end_bit) of the keys (a radix sort is
// stable too). It asks for temporary storage and scribbles over all of it, so
// storage that overlaps something else, or is too small, shows.
#pragma once
#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

namespace cub {
struct DeviceRadixSort {
  static size_t temp_bytes(long long n) { return 1024 + static_cast<size_t>(n) * 16; }
  template <class K, class V, class N>
  static cudaError_t SortPairs(void* temp, size_t& bytes, const K* keys_in, K* keys_out, const V* values_in,
                               V* values_out, N n, int begin_bit = 0, int end_bit = sizeof(K) * 8,
                               cudaStream_t stream = nullptr, bool = false) {
    emu::RuntimeScope emu_runtime_scope_;
    if (!temp) {
      bytes = temp_bytes(n);
      return cudaSuccess;
    }
    if (!emu::valid_stream(stream)) return emu::err(cudaErrorInvalidResourceHandle);
    if (bytes < temp_bytes(n)) return emu::err(cudaErrorInvalidValue);
    emu::require_device(temp, bytes, "cub::DeviceRadixSort temporary storage");
    if (n > 0) {
      emu::require_device(keys_in, sizeof(K) * static_cast<size_t>(n), "cub::DeviceRadixSort keys_in");
      emu::require_device(keys_out, sizeof(K) * static_cast<size_t>(n), "cub::DeviceRadixSort keys_out");
      emu::require_device(values_in, sizeof(V) * static_cast<size_t>(n), "cub::DeviceRadixSort values_in");
      emu::require_device(values_out, sizeof(V) * static_cast<size_t>(n), "cub::DeviceRadixSort values_out");
    }
    emu::enqueue(stream, [=] {  // in stream order
      std::vector<std::pair<K, V>> v(static_cast<size_t>(n));
      for (N i = 0; i < n; ++i) v[static_cast<size_t>(i)] = {keys_in[i], values_in[i]};
      std::memset(temp, 0xab, bytes);
      const int bits = end_bit - begin_bit;
      const K mask =
          bits >= static_cast<int>(sizeof(K) * 8) ? static_cast<K>(~K{0}) : static_cast<K>((K{1} << bits) - 1);
      std::stable_sort(v.begin(), v.end(), [&](const auto& a, const auto& b) {
        return static_cast<K>((a.first >> begin_bit) & mask) < static_cast<K>((b.first >> begin_bit) & mask);
      });
      for (N i = 0; i < n; ++i)
        keys_out[i] = v[static_cast<size_t>(i)].first, values_out[i] = v[static_cast<size_t>(i)].second;
    });
    return cudaSuccess;
  }
};
}  // namespace cub
