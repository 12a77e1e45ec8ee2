// test_capi_threads.cpp: the C API's thread contract (include/colibri.h): calls
// on one handle from several threads are serialised and each gets exactly the
// tokens it gets alone; a callback calling back into its own handle is refused
// (COLIBRI_ERR_INVALID_ARGUMENT) instead of deadlocking; n_threads is bounded.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "colibri.h"
#include "kernels/cpu/kernels.h"
#include "tests/fixture.h"

namespace colibri::test {
namespace {

// One colibri_generate call: its prompts and sampling.
struct Job {
  std::vector<std::vector<int32_t>> prompts;
  colibri_sampling sampling;
  std::string what;
};

struct Result {
  colibri_status status = COLIBRI_ERR_INTERNAL;
  std::vector<std::vector<int32_t>> tokens;     // per sequence, out_tokens[:out_counts]
  std::vector<std::vector<int32_t>> streamed;  // per sequence, as the callback saw them
  std::string error;
};

struct Stream {
  std::vector<std::vector<int32_t>>* streamed;
  int sleep_us;
};

int on_token(void* user, int32_t seq, int32_t, int32_t tok) {
  auto* s = static_cast<Stream*>(user);
  if (seq >= 0 && static_cast<size_t>(seq) < s->streamed->size()) (*s->streamed)[static_cast<size_t>(seq)].push_back(tok);
  // NOTE: a little time per token, so that calls from different threads overlap.
  if (s->sleep_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(s->sleep_us));
  return 0;
}

Result run_job(colibri_model* m, const Job& j, int sleep_us) {
  const int32_t n = static_cast<int32_t>(j.prompts.size());
  const int32_t cap = j.sampling.max_new_tokens;
  std::vector<const int32_t*> pp;
  std::vector<int32_t> lens;
  for (const auto& p : j.prompts) {
    pp.push_back(p.data());
    lens.push_back(static_cast<int32_t>(p.size()));
  }
  std::vector<int32_t> out(static_cast<size_t>(n * cap), -1), counts(static_cast<size_t>(n), -1);
  Result r;
  r.streamed.resize(static_cast<size_t>(n));
  Stream s{&r.streamed, sleep_us};
  r.status = colibri_generate(m, pp.data(), lens.data(), n, &j.sampling, on_token, &s, out.data(), counts.data());
  if (r.status != COLIBRI_OK) r.error = colibri_last_error();
  for (int32_t i = 0; i < n; ++i) {
    const int32_t c = counts[static_cast<size_t>(i)];
    const int32_t* b = out.data() + static_cast<size_t>(i * cap);
    r.tokens.emplace_back(b, b + std::max(0, std::min(c, cap)));
  }
  return r;
}

std::string show(const std::vector<int32_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

class CapiThreads : public ::testing::Test {
 protected:
  void SetUp() override {
    threads_before_ = kernels::set_threads(0);
    Fixture fx("mixtral_a");
    path_ = fx.convert(tmp_, DType::F32);
    prompts_ = fx.prompts;
    colibri_config cfg = colibri_default_config();
    cfg.n_threads = 1;  // the threads of the test are the concurrency here
    cfg.max_batch = 2;
    ASSERT_EQ(colibri_init(path_.c_str(), &cfg, &m_), COLIBRI_OK) << colibri_last_error();
  }
  void TearDown() override {
    if (m_) colibri_free(m_);
    kernels::set_threads(threads_before_);  // n_threads = 1 applied to this thread
  }

  TempDir tmp_;
  std::string path_;
  std::vector<std::vector<int32_t>> prompts_;
  colibri_model* m_ = nullptr;
  int threads_before_ = 0;
};

// 4 threads x many calls on ONE handle, each with its own prompts and sampling
// (greedy, temperature with top-k/top-p, different seeds, 1 or 2 sequences):
// every call's tokens must equal the same call's made alone beforehand.
TEST_F(CapiThreads, ConcurrentGenerateOnOneHandleMatchesSequential) {
  const uint64_t seed = test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::printf("random seed %llu (rerun with COLIBRI_TEST_SEED=%llu)\n", (unsigned long long)seed,
              (unsigned long long)seed);
  ASSERT_GE(prompts_.size(), 2u);
  std::vector<Job> jobs;
  auto sampling = [&](float temp, int32_t top_k, float top_p, uint64_t s) {
    colibri_sampling x = colibri_default_sampling();
    x.temperature = temp;
    x.top_k = top_k;
    x.top_p = top_p;
    x.seed = s;
    x.max_new_tokens = 12;
    x.ignore_eos = 1;
    return x;
  };
  const auto& p0 = prompts_[0];
  const auto& p1 = prompts_[1];
  jobs.push_back({{p0}, sampling(0.f, 0, 1.f, 0), "greedy, prompt 0"});
  jobs.push_back({{p1, p0}, sampling(0.9f, 0, 1.f, seed), "temperature 0.9, 2 sequences"});
  jobs.push_back({{p1}, sampling(1.3f, 20, 1.f, seed + 101), "temperature 1.3, top-k 20"});
  jobs.push_back({{p0, p1}, sampling(1.0f, 0, 0.9f, seed + 202), "temperature 1.0, top-p 0.9, 2 sequences"});
  jobs.push_back({{p1}, sampling(0.f, 0, 1.f, 0), "greedy, prompt 1"});
  jobs.push_back({{p0}, sampling(1.5f, 0, 1.f, seed + 303), "temperature 1.5"});

  // Each job alone, one after the other: the reference.
  std::vector<Result> want;
  for (const auto& j : jobs) {
    want.push_back(run_job(m_, j, 0));
    ASSERT_EQ(want.back().status, COLIBRI_OK) << j.what << ": " << want.back().error;
    for (const auto& t : want.back().tokens) ASSERT_EQ(t.size(), 12u) << j.what;
  }
  // Sampled jobs must differ from greedy somewhere, or the comparison proves little.
  bool differs = false;
  for (size_t k = 1; k < jobs.size(); ++k) differs |= want[k].tokens[0] != want[0].tokens[0];
  EXPECT_TRUE(differs) << "every job generated the greedy tokens";

  constexpr int kThreads = 4, kRounds = 12;
  std::atomic<int> ready{0}, calls{0}, bad_status{0}, mismatches{0};
  std::vector<std::string> first_error(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      ++ready;
      while (ready.load() < kThreads) std::this_thread::yield();  // start together
      for (int round = 0; round < kRounds; ++round) {
        const size_t k = static_cast<size_t>(t + round) % jobs.size();
        const Result got = run_job(m_, jobs[k], 50);
        ++calls;
        std::string err;
        if (got.status != COLIBRI_OK) {
          ++bad_status;
          err = "status " + std::to_string(got.status) + ": " + got.error;
        } else if (got.tokens != want[k].tokens || got.streamed != want[k].tokens) {
          ++mismatches;
          for (size_t i = 0; i < got.tokens.size() && err.empty(); ++i)
            if (got.tokens[i] != want[k].tokens[i] || got.streamed[i] != want[k].tokens[i])
              err = "sequence " + std::to_string(i) + ": got " + show(got.tokens[i]) + " (callback saw " +
                    show(got.streamed[i]) + "), alone " + show(want[k].tokens[i]);
        }
        if (!err.empty() && first_error[static_cast<size_t>(t)].empty())
          first_error[static_cast<size_t>(t)] = "thread " + std::to_string(t) + " round " + std::to_string(round) +
                                                " job '" + jobs[k].what + "': " + err;
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(calls.load(), kThreads * kRounds);
  EXPECT_EQ(bad_status.load(), 0);
  EXPECT_EQ(mismatches.load(), 0) << "of " << calls.load() << " concurrent calls";
  for (const auto& e : first_error)
    if (!e.empty()) ADD_FAILURE() << e;
}

// A callback calling back into the handle it was called from: refused with
// COLIBRI_ERR_INVALID_ARGUMENT (and a message), not a deadlock; the outer call
// goes on unharmed; colibri_get_info still answers from inside the callback.
struct Reentry {
  colibri_model* m = nullptr;
  const std::vector<int32_t>* prompt = nullptr;
  int calls = 0;
  colibri_status gen = COLIBRI_OK, infer = COLIBRI_OK, info = COLIBRI_ERR_INTERNAL;
  std::string gen_error, infer_error;
  std::vector<int32_t> tokens;
};

int reenter(void* user, int32_t, int32_t, int32_t tok) {
  auto* r = static_cast<Reentry*>(user);
  r->tokens.push_back(tok);
  if (r->calls++ != 2) return 0;
  const int32_t* pp[1] = {r->prompt->data()};
  int32_t len[1] = {static_cast<int32_t>(r->prompt->size())}, out[4], next = -1;
  colibri_sampling s = colibri_default_sampling();
  s.max_new_tokens = 4;
  r->gen = colibri_generate(r->m, pp, len, 1, &s, nullptr, nullptr, out, nullptr);
  r->gen_error = colibri_last_error();
  r->infer = colibri_infer(r->m, pp, len, 1, nullptr, &next);
  r->infer_error = colibri_last_error();
  colibri_model_info info;
  r->info = colibri_get_info(r->m, &info);
  return 0;
}

TEST_F(CapiThreads, CallbackCallingItsOwnHandleIsRefused) {
  colibri_sampling s = colibri_default_sampling();
  s.max_new_tokens = 8;
  s.ignore_eos = 1;
  const int32_t* pp[1] = {prompts_[0].data()};
  int32_t len[1] = {static_cast<int32_t>(prompts_[0].size())};
  std::vector<int32_t> alone(8, -1);
  ASSERT_EQ(colibri_generate(m_, pp, len, 1, &s, nullptr, nullptr, alone.data(), nullptr), COLIBRI_OK);

  // NOTE: a deadlock would hang here: run the call on a thread and give up after 60 s.
  Reentry r;
  r.m = m_;
  r.prompt = &prompts_[0];
  std::vector<int32_t> got(8, -1);
  std::atomic<bool> done{false};
  colibri_status st = COLIBRI_ERR_INTERNAL;
  std::thread th([&] {
    st = colibri_generate(m_, pp, len, 1, &s, reenter, &r, got.data(), nullptr);
    done = true;
  });
  for (int i = 0; i < 600 && !done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  if (!done) {
    th.detach();
    FAIL() << "colibri_generate called from its own callback deadlocked (no return in 60 s)";
  }
  th.join();
  EXPECT_EQ(st, COLIBRI_OK);
  EXPECT_EQ(r.gen, COLIBRI_ERR_INVALID_ARGUMENT) << r.gen_error;
  EXPECT_NE(r.gen_error.find("callback"), std::string::npos) << r.gen_error;
  EXPECT_EQ(r.infer, COLIBRI_ERR_INVALID_ARGUMENT) << r.infer_error;
  EXPECT_EQ(r.info, COLIBRI_OK);
  EXPECT_EQ(got, alone) << "the outer call's tokens changed: " << show(got) << " vs " << show(alone);
  EXPECT_EQ(r.tokens, alone);
  // The handle is free again afterwards, on this thread and on others.
  std::vector<int32_t> again(8, -1);
  EXPECT_EQ(colibri_generate(m_, pp, len, 1, &s, nullptr, nullptr, again.data(), nullptr), COLIBRI_OK)
      << colibri_last_error();
  EXPECT_EQ(again, alone);
}

// n_threads outside [0, 1024] is refused before any work (100000 crashed inside OpenMP).
TEST_F(CapiThreads, NThreadsOutOfRangeIsRefused) {
  for (int32_t n : {100000, 1025, -1}) {
    colibri_config cfg = colibri_default_config();
    cfg.n_threads = n;
    colibri_model* m = reinterpret_cast<colibri_model*>(&cfg);  // must be reset to NULL
    EXPECT_EQ(colibri_init(path_.c_str(), &cfg, &m), COLIBRI_ERR_INVALID_ARGUMENT) << "n_threads " << n;
    EXPECT_EQ(m, nullptr);
    const std::string e = colibri_last_error();
    EXPECT_NE(e.find("n_threads"), std::string::npos) << e;
    EXPECT_NE(e.find("1024"), std::string::npos) << e;
    if (m) colibri_free(m);
  }
}


// Requests (colibri_submit): 3 threads submit at random times; each request's
// tokens (polled, and as its callback saw them) equal colibri_generate of it
// alone; one is cancelled; blocking calls are refused while requests run; a
// handle freed with requests in flight ends them.
struct Seen {
  int sleep_us = 0;  // per token: keeps requests running (the request thread waits)
  std::mutex mu;
  std::map<int64_t, std::vector<int32_t>> tokens;
  std::map<int64_t, std::string> finish;
};

void on_request(void* user, int64_t id, int32_t token, const char* finish) {
  auto* s = static_cast<Seen*>(user);
  {
    std::lock_guard<std::mutex> g(s->mu);
    if (finish)
      s->finish[id] = finish;
    else
      s->tokens[id].push_back(token);
  }
  if (!finish && s->sleep_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(s->sleep_us));
}

TEST_F(CapiThreads, SubmittedRequestsMatchEachAloneFromManyThreads) {
  const uint64_t seed = test_seed();
  COLIBRI_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  struct Job {
    std::vector<int32_t> prompt;
    colibri_sampling s;
    std::vector<int32_t> alone;
    int64_t id = -1;
  };
  std::vector<Job> jobs(9);
  for (size_t i = 0; i < jobs.size(); ++i) {
    Job& j = jobs[i];
    j.prompt = prompts_[i % prompts_.size()];
    j.prompt.resize(1 + rng() % j.prompt.size());
    j.s = colibri_default_sampling();
    j.s.max_new_tokens = 3 + static_cast<int32_t>(rng() % 6);
    j.s.ignore_eos = 1;
    if (i % 2) j.s.temperature = 0.9f, j.s.top_k = 20, j.s.seed = rng();
    // colibri_generate samples sequence 0 with seed + 0: the same seed.
    const int32_t* pp[] = {j.prompt.data()};
    const int32_t len[] = {static_cast<int32_t>(j.prompt.size())};
    std::vector<int32_t> out(static_cast<size_t>(j.s.max_new_tokens), -1);
    int32_t count = -1;
    ASSERT_EQ(colibri_generate(m_, pp, len, 1, &j.s, nullptr, nullptr, out.data(), &count), COLIBRI_OK)
        << colibri_last_error();
    j.alone.assign(out.begin(), out.begin() + count);
  }
  Seen seen;
  std::vector<std::thread> th;
  for (int t = 0; t < 3; ++t)
    th.emplace_back([&, t] {
      for (size_t i = static_cast<size_t>(t); i < jobs.size(); i += 3) {
        std::this_thread::sleep_for(std::chrono::microseconds(200 * (i % 4)));
        Job& j = jobs[i];
        ASSERT_EQ(colibri_submit(m_, j.prompt.data(), static_cast<int32_t>(j.prompt.size()), &j.s, on_request, &seen,
                                 &j.id),
                  COLIBRI_OK)
            << colibri_last_error();
      }
    });
  for (auto& t : th) t.join();
  // A blocking call while requests may still run: refused, or (all done) fine.
  {
    const int32_t* pp[] = {jobs[0].prompt.data()};
    const int32_t len[] = {static_cast<int32_t>(jobs[0].prompt.size())};
    const colibri_status st = colibri_infer(m_, pp, len, 1, nullptr, nullptr);
    EXPECT_TRUE(st == COLIBRI_OK || st == COLIBRI_ERR_INVALID_ARGUMENT) << st;
    if (st != COLIBRI_OK) {
      EXPECT_NE(std::string(colibri_last_error()).find("colibri_submit"), std::string::npos);
    }
  }
  for (Job& j : jobs) {
    const char* finish = nullptr;
    size_t n = 0;
    for (int w = 0; w < 20000 && !finish; ++w) {
      ASSERT_EQ(colibri_poll(m_, j.id, nullptr, 0, &n, &finish), COLIBRI_OK) << colibri_last_error();
      if (!finish) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_NE(finish, nullptr) << "request " << j.id << " did not finish";
    EXPECT_STREQ(finish, "length");
    std::vector<int32_t> got(n, -1);
    ASSERT_EQ(colibri_poll(m_, j.id, got.data(), got.size(), &n, &finish), COLIBRI_OK);
    EXPECT_EQ(got, j.alone) << "request " << j.id << ": " << show(got) << " vs alone " << show(j.alone);
    std::lock_guard<std::mutex> g(seen.mu);
    EXPECT_EQ(seen.tokens[j.id], j.alone) << "the callback's tokens";
    EXPECT_EQ(seen.finish[j.id], "length");
  }
  // A buffer too small fails (the size is still stored); release forgets.
  size_t n = 0;
  int32_t one = -1;
  EXPECT_EQ(colibri_poll(m_, jobs[0].id, &one, 1, &n, nullptr), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(n, jobs[0].alone.size());
  EXPECT_EQ(colibri_release(m_, jobs[0].id), COLIBRI_OK);
  EXPECT_EQ(colibri_poll(m_, jobs[0].id, nullptr, 0, &n, nullptr), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(colibri_release(m_, 999999), COLIBRI_ERR_INVALID_ARGUMENT);
  // All done: the blocking calls work again.
  std::vector<int32_t> again(static_cast<size_t>(jobs[1].s.max_new_tokens), -1);
  const int32_t* pp[] = {jobs[1].prompt.data()};
  const int32_t len[] = {static_cast<int32_t>(jobs[1].prompt.size())};
  int32_t count = 0;
  EXPECT_EQ(colibri_generate(m_, pp, len, 1, &jobs[1].s, nullptr, nullptr, again.data(), &count), COLIBRI_OK)
      << colibri_last_error();
  again.resize(static_cast<size_t>(count));
  EXPECT_EQ(again, jobs[1].alone);
}

TEST_F(CapiThreads, CancelAndFreeEndRunningRequests) {
  colibri_sampling s = colibri_default_sampling();
  s.max_new_tokens = 100;  // long: still running when cancelled (the context is 128)
  s.ignore_eos = 1;
  Seen seen;
  seen.sleep_us = 3000;  // 100 tokens: ~0.3 s per request, so b still runs when the handle is freed
  int64_t a = -1, b = -1;
  const std::vector<int32_t>& p = prompts_[0];
  ASSERT_EQ(colibri_submit(m_, p.data(), static_cast<int32_t>(p.size()), &s, on_request, &seen, &a), COLIBRI_OK)
      << colibri_last_error();
  ASSERT_EQ(colibri_submit(m_, p.data(), static_cast<int32_t>(p.size()), &s, on_request, &seen, &b), COLIBRI_OK);
  EXPECT_EQ(colibri_release(m_, a), COLIBRI_ERR_INVALID_ARGUMENT) << "still running";
  EXPECT_EQ(colibri_cancel(m_, a), COLIBRI_OK);
  const char* finish = nullptr;
  size_t n = 0;
  for (int w = 0; w < 20000 && !finish; ++w) {
    ASSERT_EQ(colibri_poll(m_, a, nullptr, 0, &n, &finish), COLIBRI_OK);
    if (!finish) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_NE(finish, nullptr);
  EXPECT_STREQ(finish, "cancelled");
  EXPECT_LT(n, 100u);
  // Bad submissions are refused at once.
  int64_t bad = -1;
  const int32_t out_of_vocab = 1 << 30;
  EXPECT_EQ(colibri_submit(m_, &out_of_vocab, 1, &s, nullptr, nullptr, &bad), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(colibri_submit(m_, p.data(), 0, &s, nullptr, nullptr, &bad), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(colibri_cancel(m_, 424242), COLIBRI_ERR_INVALID_ARGUMENT);
  // Freed with b still running: b ends ("cancelled") and nothing hangs (TearDown frees).
  colibri_free(m_);
  m_ = nullptr;
  std::lock_guard<std::mutex> g(seen.mu);
  EXPECT_EQ(seen.finish[b], "cancelled");
}

}  // namespace
}  // namespace colibri::test
