// test_cluster_parity.cpp: cluster parity in one process. The coordinator's
// Engine runs on this thread and each worker rank's serve loop on its own,
// over the in-process communicator (comm/thread_comm.h): 1-4 ranks, every
// placement policy, the coordinator hosting experts or not, a placement file,
// expert caches of one expert per rank under every cache policy, the traffic
// the exchange moves, every model family and quantised files. Each run must give
// the one-process run's tokens and logits BITWISE. This is the matrix
// tests/mpi_parity_test.sh ran under mpirun (~100 jobs); that script now makes
// a handful of real mpirun runs (the default transport and UCX, a placement
// file, the traffic, the coordinator hosting experts), cluster.parity. In one
// process the whole matrix takes a few seconds even under the sanitizers, which
// run all of it (under mpirun they ran a 23-run subset).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <omp.h>

#include "comm/thread_comm.h"
#include "kernels/cpu/kernels.h"
#include "model/placement.h"
#include "model/routing_trace.h"
#include "model/text.h"
#include "tests/fixture.h"
#include "worker/dispatch.h"
#include "worker/protocol.h"
#include "worker/serve.h"

using namespace colibri;
using namespace colibri::test;

namespace {

// One cluster run: the options `colibri run` takes for it.
struct ClusterRun {
  ClusterRun(std::string n, int ranks, std::string pol = "contiguous", bool coord = false, int red = 0)
      : name(std::move(n)), np(ranks), policy(std::move(pol)), coordinator_experts(coord), redundant(red) {}
  std::string name;
  int np = 1;
  std::string policy = "contiguous";
  bool coordinator_experts = false;
  int redundant = 0;
  std::string placement_file;  // --placement (else --policy)
  bool stats = true;           // --stats STATS.json
  int64_t cache_experts = 0;   // --expert-cache-experts
  std::string cache_policy = "lru";
};

struct Result {
  std::vector<SequenceOutput> out;
  GenerateStats gen;
  DispatchStats dispatch;
  CommStats comm;  // rank 0's
  std::vector<cluster::RankReport> reports;
};

// This thread's OpenMP threads for a scope (mpirun's ranks on this machine get
// one core each; the engine's results do not depend on the count).
class ThreadsFor {
 public:
  explicit ThreadsFor(int n) : saved_(omp_get_max_threads()) { kernels::set_threads(n); }
  ~ThreadsFor() { kernels::set_threads(saved_); }

 private:
  int saved_;
};

class Model {
 public:
  Model(const std::string& path, const Fixture& fx, const TempDir& tmp) : path_(path) {
    const auto file = ColibriFile::open(path);
    cfg_ = file->config();
    const std::vector<int32_t> eos = eos_token_ids(cfg_);
    int64_t need = 0;
    for (const auto& p : fx.prompts) {
      Request q;
      q.prompt = p;
      q.max_new_tokens = 8;
      q.ignore_eos = true;
      q.stop_ids = eos;
      q.sampling.seed = reqs_.size();
      need = std::max<int64_t>(need, static_cast<int64_t>(p.size()) + q.max_new_tokens);
      reqs_.push_back(q);
    }
    eo_.max_batch = static_cast<int64_t>(reqs_.size());
    eo_.max_context = std::min<int64_t>(std::max<int64_t>(need, 1), cfg_.max_position_embeddings);
    // The reference: one process (`colibri generate`), whose routing trace feeds
    // the balanced and replicated placements (`colibri stats` -> --stats).
    const std::string trace = tmp.file("trace.jsonl"), stats = tmp.file("stats.json");
    {
      RoutingTraceWriter w(trace, static_cast<int>(cfg_.num_moe_layers()), static_cast<int>(cfg_.num_experts),
                           static_cast<int>(cfg_.experts_per_token));
      EngineOptions eo = eo_;
      eo.trace = &w;
      auto comm = make_local_communicator();
      Engine engine(file, eo, *comm);
      GenerateOptions go;
      go.record_logits = true;
      ref_ = engine.generate(reqs_, go);
      w.close();
    }
    save_expert_stats(aggregate_stats(read_routing_trace(trace)), stats);
    stats_ = load_expert_stats(stats);
  }

  const ModelConfig& config() const { return cfg_; }
  const ExpertStats& stats() const { return stats_; }

  // `colibri run` under `mpirun -np run.np`, in one process.
  Result run(const ClusterRun& run) const {
    const int np = run.np, L = static_cast<int>(cfg_.num_moe_layers()), E = static_cast<int>(cfg_.num_experts);
    std::vector<std::shared_ptr<const ColibriFile>> files;
    for (int r = 0; r < np; ++r) {
      ColibriFile::Options fo;
      fo.verify_dense = r == 0;  // as `colibri run`: the coordinator checks the dense tensors
      files.push_back(ColibriFile::open(path_, fo));
    }
    const bool coord_hosts = np == 1 || run.coordinator_experts;
    const ExpertStats* st = run.stats ? &stats_ : nullptr;
    auto placement = std::make_shared<const Placement>(
        run.placement_file.empty() ? make_placement(run.policy, L, E, np, coord_hosts, st, run.redundant)
                                   : Placement::load(run.placement_file, np, L, E));
    cluster::check_placement(*placement, cfg_, np);
    ExpertStoreOptions so;
    so.budget_experts = run.cache_experts;
    so.policy = run.cache_policy;
    if (so.policy == "pinned") so.pinned = hottest_experts(stats_, files[0]->experts().size());

    auto comms = make_thread_communicators(np);
    for (auto& c : comms) c->set_timeout(120);
    std::vector<std::string> errors(static_cast<size_t>(np));
    std::vector<std::thread> workers;
    for (int r = 1; r < np; ++r)
      workers.emplace_back([&, r] {
        try {
          ThreadsFor one(1);
          cluster::WorkerOptions wo;
          wo.store = so;
          cluster::serve(files[static_cast<size_t>(r)], placement, *comms[static_cast<size_t>(r)], wo);
          comms[static_cast<size_t>(r)]->barrier();
        } catch (const std::exception& e) {
          errors[static_cast<size_t>(r)] = e.what();
          abort_thread_world(*comms[static_cast<size_t>(r)], "rank " + std::to_string(r) + " failed: " + e.what());
        }
      });
    Result res;
    try {
      ThreadsFor one(np > 1 ? 1 : 0);
      Communicator& comm = *comms[0];
      EngineOptions eo = eo_;
      eo.placement = placement;
      eo.store = so;
      Engine engine(files[0], eo, comm);
      engine.start_workers();
      engine.validate(reqs_);
      GenerateOptions go;
      go.record_logits = true;
      res.out = engine.generate(reqs_, go, &res.gen);
      res.dispatch = engine.dispatch_stats();
      res.comm = comm.stats();
      // Every rank's report, as `colibri run` prints it (a collective).
      const cluster::RankReport mine = cluster::make_report(comm, engine.placement(), engine.config(), engine.local_worker(),
                                                            engine.dispatch_stats(), engine.stage_times());
      if (np == 1) {
        res.reports = {mine};
      } else {
        cluster::send_op(comm, cluster::Op::Report);
        res.reports = cluster::gather_reports(comm, mine);
      }
      engine.stop_workers();
      if (np > 1) comm.barrier();
    } catch (const std::exception& e) {
      errors[0] = e.what();
      abort_thread_world(*comms[0], std::string("rank 0 failed: ") + e.what());
    }
    for (auto& t : workers) t.join();
    for (int r = 0; r < np; ++r)
      EXPECT_TRUE(errors[static_cast<size_t>(r)].empty()) << run.name << ": rank " << r << ": " << errors[static_cast<size_t>(r)];
    return res;
  }

  // The run's tokens and logits are the one-process run's, bitwise.
  void check(const ClusterRun& r, Result* keep = nullptr) const {
    SCOPED_TRACE(r.name);
    Result res = run(r);
    ASSERT_EQ(res.out.size(), ref_.size()) << r.name;
    for (size_t i = 0; i < ref_.size(); ++i) {
      EXPECT_EQ(res.out[i].tokens, ref_[i].tokens) << r.name << ": sequence " << i << ": tokens differ";
      ASSERT_EQ(res.out[i].logits.size(), ref_[i].logits.size()) << r.name << ": sequence " << i;
      EXPECT_EQ(0, std::memcmp(res.out[i].logits.data(), ref_[i].logits.data(), ref_[i].logits.size() * sizeof(float)))
          << r.name << ": sequence " << i << ": logits are not bitwise identical";
    }
    EXPECT_EQ(res.reports.size(), static_cast<size_t>(r.np)) << r.name;
    if (keep) *keep = std::move(res);
  }

 private:
  std::string path_;
  ModelConfig cfg_;
  std::vector<Request> reqs_;
  EngineOptions eo_;
  std::vector<SequenceOutput> ref_;
  ExpertStats stats_;
};

// Traffic: with the coordinator hosting no experts every (token, expert) row of
// a MoE layer crosses the wire exactly once (tokens x top-k x MoE layers), and
// apart from the per-layer counts nothing else is sent: not the whole batch.
void check_traffic(const Model& m, bool exact_counts) {
  ClusterRun r{"np=3 round_robin (traffic)", 3, "round_robin"};
  r.stats = false;
  Result res;
  m.check(r, &res);
  const ModelConfig& c = m.config();
  const uint64_t moe = static_cast<uint64_t>(c.num_moe_layers()), k = static_cast<uint64_t>(c.experts_per_token);
  const uint64_t tokens = static_cast<uint64_t>(res.gen.prefill_tokens + res.gen.decode_tokens);
  const uint64_t rows = res.dispatch.rows_remote, row_bytes = rows * static_cast<uint64_t>(c.hidden_size) * 4;
  EXPECT_EQ(rows, tokens * k * moe) << "rows = tokens " << tokens << " x k " << k << " x MoE layers " << moe;
  if (exact_counts) {
    const uint64_t passes = res.dispatch.layers / moe;
    // To 2 workers, E uint32 counts each, per layer and forward pass.
    EXPECT_EQ(res.comm.bytes_sent - row_bytes, passes * moe * 2 * static_cast<uint64_t>(c.num_experts) * 4)
        << "count bytes over " << passes << " forward passes";
  }
}

class MixtralParity : public ::testing::TestWithParam<std::string> {};
class FamilyParity : public ::testing::TestWithParam<std::string> {};
class QuantisedParity : public ::testing::TestWithParam<std::string> {};

std::vector<std::string> other_families() {
  std::vector<std::string> v;
  for (const auto& n : fixture_names())
    if (n.rfind("mixtral_", 0) != 0) v.push_back(n);
  return v;
}

// The Mixtral fixtures: the whole placement x policy x cache matrix.
TEST_P(MixtralParity, EveryPlacementPolicyAndCacheIsBitwiseOneProcess) {
  const std::string name = GetParam();
  Fixture fx(name);
  TempDir tmp;
  Model m(fx.convert(tmp, DType::F32), fx, tmp);
  m.check({"run world=1", 1});
  for (int np : {2, 3, 4}) {
    for (const std::string policy : {"contiguous", "round_robin", "balanced", "replicated"})
      for (bool coord : {false, true}) {
        ClusterRun r{"np=" + std::to_string(np) + " " + policy + " coordinator-experts=" + (coord ? "yes" : "no"), np, policy, coord};
        if (policy == "replicated") {
          // Replicas need a second host rank: with np=2 only when rank 0 hosts too.
          if (np == 2 && !coord) continue;
          r.redundant = 2;
        }
        m.check(r);
      }
  }
  // A placement file (`colibri place --ranks 3 --policy round_robin`) and a
  // small evicting cache of every policy.
  const std::string pfile = tmp.file("p.json");
  const int L = static_cast<int>(m.config().num_moe_layers()), E = static_cast<int>(m.config().num_experts);
  make_placement("round_robin", L, E, 3, false, nullptr, 0).save(pfile);
  for (const std::string cp : {"lru", "lfu", "hybrid", "pinned", "predict"}) {
    ClusterRun r{"np=3 placement file, cache 1 expert/rank " + cp, 3};
    r.placement_file = pfile;
    r.cache_experts = 1;
    r.cache_policy = cp;
    m.check(r);
  }
  check_traffic(m, true);
}

// The other families (dense-then-MoE layers, shared experts, grouped and biased
// routing, MLA, sinks, MXFP4...): non-trivial placements over MoE layers only.
TEST_P(FamilyParity, PlacementsOverMoeLayersAreBitwiseOneProcess) {
  const std::string name = GetParam();
  Fixture fx(name);
  TempDir tmp;
  Model m(fx.convert(tmp, DType::F32), fx, tmp);
  m.check({"np=3 balanced", 3, "balanced"});
  ClusterRun r{"np=4 replicated R=2 coordinator-experts, cache 1 expert/rank lru", 4, "replicated", true, 2};
  r.cache_experts = 1;
  m.check(r);
  // Traffic counts MoE layers only: dense layers never leave the coordinator.
  check_traffic(m, false);
}

// Quantised files: the workers' stores and caches hold int4 expert blocks, the
// coordinator int8 dense matrices; still bitwise one process.
TEST_P(QuantisedParity, Int4ExpertsInt8DenseAreBitwiseOneProcess) {
  const std::string name = GetParam();
  Fixture fx(name);
  TempDir tmp;
  const std::string path = tmp.file(name + ".q.colibri");
  ConvertOptions o;
  o.dtype = DType::BF16;
  o.expert_quant = QuantType::Int4;
  o.dense_quant = QuantType::Int8;
  o.group_size = name == "deepseek_v3_a" ? 16 : 32;
  convert_checkpoint(fx.dir + "/hf", path, o);
  Model m(path, fx, tmp);
  m.check({"quantised np=3 balanced", 3, "balanced"});
  ClusterRun r{"quantised np=4 replicated R=2 coordinator-experts, cache 1 expert/rank lru", 4, "replicated", true, 2};
  r.cache_experts = 1;
  m.check(r);
}

auto param_name = [](const auto& info) { return info.param; };
INSTANTIATE_TEST_SUITE_P(Fixtures, MixtralParity, ::testing::Values("mixtral_a", "mixtral_b", "mixtral_c"), param_name);
INSTANTIATE_TEST_SUITE_P(Fixtures, FamilyParity, ::testing::ValuesIn(other_families()), param_name);
INSTANTIATE_TEST_SUITE_P(Fixtures, QuantisedParity, ::testing::Values("mixtral_a", "deepseek_v3_a"), param_name);

// The in-process communicator itself: a stuck rank is named within the
// deadline, and a collective the ranks disagree on is an error, not a hang.
TEST(ThreadComm, ATimeoutNamesTheRanksThatDidNotArrive) {
  auto comms = make_thread_communicators(3);
  comms[0]->set_timeout(1);
  std::string msg;
  std::thread t1([&] {
    try {
      comms[1]->barrier();
    } catch (const Error&) {
    }
  });
  try {
    comms[0]->barrier();  // rank 2 never comes
    ADD_FAILURE() << "the barrier returned without rank 2";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::Comm);
    msg = e.what();
  }
  abort_thread_world(*comms[0], "test over");
  t1.join();
  EXPECT_NE(msg.find("rank 0: timed out after 1 s waiting for a barrier; no answer from rank(s) 2 (lost or stuck)"),
            std::string::npos)
      << msg;
}

TEST(ThreadComm, ExchangesMoveTheBytesAndCountThemAsMpiDoes) {
  const int n = 3;
  auto comms = make_thread_communicators(n);
  std::vector<std::string> errors(n);
  std::vector<std::vector<uint8_t>> got(n), counts(n), bcast(n), gathered(n);
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        Communicator& c = *comms[static_cast<size_t>(r)];
        // alltoallv: rank r sends r + d + 1 bytes of value 10 r + d to rank d.
        std::vector<uint64_t> sb(n), so(n), rb(n), ro(n);
        std::vector<uint8_t> send;
        for (int d = 0; d < n; ++d) {
          so[static_cast<size_t>(d)] = send.size();
          sb[static_cast<size_t>(d)] = static_cast<uint64_t>(r + d + 1);
          send.insert(send.end(), sb[static_cast<size_t>(d)], static_cast<uint8_t>(10 * r + d));
        }
        uint64_t total = 0;
        for (int s = 0; s < n; ++s) {
          ro[static_cast<size_t>(s)] = total;
          rb[static_cast<size_t>(s)] = static_cast<uint64_t>(s + r + 1);
          total += rb[static_cast<size_t>(s)];
        }
        got[static_cast<size_t>(r)].resize(total);
        c.alltoallv(send.data(), sb.data(), so.data(), got[static_cast<size_t>(r)].data(), rb.data(), ro.data());
        std::vector<uint8_t> cs(n * 2);
        for (int d = 0; d < n; ++d) cs[static_cast<size_t>(2 * d)] = cs[static_cast<size_t>(2 * d + 1)] = static_cast<uint8_t>(r * n + d);
        counts[static_cast<size_t>(r)].resize(n * 2);
        c.alltoall(cs.data(), counts[static_cast<size_t>(r)].data(), 2);
        bcast[static_cast<size_t>(r)].assign(4, r == 1 ? 77 : 0);
        c.broadcast(bcast[static_cast<size_t>(r)].data(), 4, 1);
        const uint8_t mine = static_cast<uint8_t>(100 + r);
        gathered[static_cast<size_t>(r)].resize(n);
        c.gather(&mine, 1, gathered[static_cast<size_t>(r)].data(), 2);
        c.barrier();
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
        abort_thread_world(*comms[static_cast<size_t>(r)], e.what());
      }
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < n; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    ASSERT_TRUE(errors[static_cast<size_t>(r)].empty()) << errors[static_cast<size_t>(r)];
    size_t at = 0;
    for (int s = 0; s < n; ++s)
      for (int i = 0; i < s + r + 1; ++i) EXPECT_EQ(got[static_cast<size_t>(r)][at++], 10 * s + r) << "from rank " << s;
    for (int s = 0; s < n; ++s) EXPECT_EQ(counts[static_cast<size_t>(r)][static_cast<size_t>(2 * s)], s * n + r);
    EXPECT_EQ(bcast[static_cast<size_t>(r)], std::vector<uint8_t>(4, 77));
    const CommStats& st = comms[static_cast<size_t>(r)]->stats();
    uint64_t sent = 0, received = 0;
    for (int d = 0; d < n; ++d)
      if (d != r) sent += static_cast<uint64_t>(r + d + 1) + 2, received += static_cast<uint64_t>(d + r + 1) + 2;
    EXPECT_EQ(st.bytes_sent, sent);
    EXPECT_EQ(st.bytes_received, received);
    EXPECT_EQ(st.bytes_self, static_cast<uint64_t>(2 * r + 1) + 2);
    EXPECT_EQ(st.collectives, 5u);
  }
  EXPECT_EQ(gathered[2], (std::vector<uint8_t>{100, 101, 102}));
}

TEST(ThreadComm, RanksInDifferentCollectivesFailInsteadOfHanging) {
  auto comms = make_thread_communicators(2);
  std::string e0, e1;
  std::thread t([&] {
    try {
      int x = 0;
      comms[1]->broadcast(&x, sizeof x, 0);
    } catch (const Error& e) {
      e1 = e.what();
    }
  });
  try {
    comms[0]->barrier();
  } catch (const Error& e) {
    e0 = e.what();
  }
  t.join();
  EXPECT_NE(e0.find("the ranks' collectives differ"), std::string::npos) << e0;
  EXPECT_NE(e1.find("the ranks' collectives differ"), std::string::npos) << e1;
}

}  // namespace
