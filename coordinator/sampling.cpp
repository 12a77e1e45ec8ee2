// sampling.cpp: token sampling.
#include "coordinator/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "model/error.h"

namespace colibri {

void validate_sampling(const SamplingParams& p, int64_t vocab) {
  if (!std::isfinite(p.temperature) || p.temperature < 0)
    throw Error(Status::InvalidArgument, "temperature must be a finite number >= 0 (got " + std::to_string(p.temperature) + ")");
  if (p.top_k < 0) throw Error(Status::InvalidArgument, "top-k must be >= 0 (got " + std::to_string(p.top_k) + ")");
  if (p.top_k > vocab)
    throw Error(Status::InvalidArgument, "top-k " + std::to_string(p.top_k) + " exceeds the vocabulary (" + std::to_string(vocab) + ")");
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f))
    throw Error(Status::InvalidArgument, "top-p must be in (0, 1] (got " + std::to_string(p.top_p) + ")");
}

static uint64_t splitmix(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

Rng::Rng(uint64_t seed) {
  for (auto& s : s_) s = splitmix(seed);
}

uint64_t Rng::next() {
  auto rotl = [](uint64_t x, int k) { return (x << k) | (x >> (64 - k)); };
  uint64_t r = rotl(s_[1] * 5, 7) * 9, t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return r;
}

double Rng::uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

int32_t argmax(const float* v, int64_t n) {
  int64_t b = 0;
  for (int64_t i = 1; i < n; ++i)
    if (v[i] > v[b]) b = i;
  return static_cast<int32_t>(b);
}

Sampler::Sampler(int64_t vocab) : vocab_(vocab), idx_(static_cast<size_t>(vocab)), prob_(static_cast<size_t>(vocab)) {}

int32_t Sampler::sample(const float* logits, const SamplingParams& p, Rng& rng) {
  if (p.temperature <= 0.0f) return argmax(logits, vocab_);
  // Candidates sorted by logit (descending, ties to the lower id), cut to top-k.
  std::iota(idx_.begin(), idx_.end(), 0);
  int64_t n = (p.top_k > 0 && p.top_k < vocab_) ? p.top_k : vocab_;
  auto cmp = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  if (n < vocab_) {
    std::partial_sort(idx_.begin(), idx_.begin() + n, idx_.end(), cmp);
  } else {
    std::sort(idx_.begin(), idx_.end(), cmp);
  }
  const double inv_t = 1.0 / p.temperature;
  const double mx = logits[idx_[0]];
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += (prob_[static_cast<size_t>(i)] = static_cast<float>(std::exp((logits[idx_[i]] - mx) * inv_t)));
  // Nucleus: the smallest prefix whose probability reaches top_p (at least one).
  if (p.top_p < 1.0f) {
    double c = 0;
    int64_t keep = n;
    for (int64_t i = 0; i < n; ++i) {
      c += prob_[static_cast<size_t>(i)] / sum;
      if (c >= p.top_p) {
        keep = i + 1;
        break;
      }
    }
    n = keep;
    sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += prob_[static_cast<size_t>(i)];
  }
  double u = rng.uniform() * sum, c = 0;
  for (int64_t i = 0; i < n; ++i) {
    c += prob_[static_cast<size_t>(i)];
    if (u < c) return idx_[static_cast<size_t>(i)];
  }
  return idx_[static_cast<size_t>(n - 1)];
}

}  // namespace colibri
