// sampling.h: greedy, temperature, top-k and top-p sampling with a seeded,
// portable random stream per sequence.
#pragma once
#include <cstdint>
#include <vector>

namespace colibri {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy
  int top_k = 0;             // 0: off
  float top_p = 1.0f;        // 1: off
  uint64_t seed = 0;
};

// Throws Error(InvalidArgument) naming the parameter out of range.
void validate_sampling(const SamplingParams& p, int64_t vocab);

// xoshiro256** seeded by splitmix64: same stream on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed = 0);
  uint64_t next();
  double uniform();  // [0, 1) with 53 random bits

 private:
  uint64_t s_[4];
};

class Sampler {
 public:
  explicit Sampler(int64_t vocab);  // scratch sized once
  int32_t sample(const float* logits, const SamplingParams& p, Rng& rng);

 private:
  int64_t vocab_;
  std::vector<int32_t> idx_;
  std::vector<float> prob_;
};

int32_t argmax(const float* v, int64_t n);

}  // namespace colibri
