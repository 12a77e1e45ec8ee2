// capi.cpp: the C API over the engine. Every C++ exception stops here and
// becomes a status plus a thread-local message.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "colibri.h"
#include "comm/communicator.h"
#include "coordinator/engine.h"
#include "coordinator/scheduler.h"
#include "kernels/cpu/kernels.h"
#include "model/colibri_file.h"
#include "model/error.h"
#include "model/text.h"

// colibri_submit's requests: the inbox (any thread), each request's tokens
// and state (any thread, under mu), and the scheduler (the request thread only).
struct CapiRequests {
  struct State {
    std::vector<int32_t> tokens;
    const char* finish = nullptr;  // a static string once ended
    colibri_request_callback cb = nullptr;
    void* user = nullptr;
    int64_t sched_id = -1;  // the scheduler's id (request thread only)
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<int64_t, colibri::Request>> inbox;
  std::vector<int64_t> cancels;
  std::unordered_map<int64_t, State> state;
  int64_t next_id = 0;
  std::atomic<int64_t> active{0};  // submitted, not finished
  bool stop = false;
  std::thread thread;
};

struct colibri_model {
  std::shared_ptr<const colibri::ColibriFile> file;
  std::unique_ptr<colibri::Communicator> comm;
  std::unique_ptr<colibri::Engine> engine;
  std::unique_ptr<colibri::Tokenizer> tok;  // loaded on first use
  int n_threads = 0;                        // colibri_config.n_threads (0 = all cores)

  // NOTE: the engine (KV cache, scratch buffers) and the lazily loaded tokenizer
  // serve one call at a time: every call that uses them holds `mu` (see
  // colibri.h). `owner` is the thread holding it, so that a call made from a
  // callback of a running call on the same thread is refused instead of
  // deadlocking on `mu`.
  std::mutex mu;
  std::atomic<std::thread::id> owner{};
  CapiRequests requests;  // colibri_submit (the thread starts on the first one)

  ~colibri_model();

  const colibri::Tokenizer& tokenizer() {
    if (!tok) tok = colibri::open_tokenizer(*file);
    return *tok;
  }
};

namespace {

thread_local std::string g_last_error;

template <typename F>
colibri_status guarded(F&& f) {
  try {
    g_last_error.clear();
    f();
    return COLIBRI_OK;
  } catch (const colibri::Error& e) {
    g_last_error = e.what();
    return static_cast<colibri_status>(e.status());
  } catch (const std::filesystem::filesystem_error& e) {
    g_last_error = e.what();
    return COLIBRI_ERR_IO;
  } catch (const std::bad_alloc&) {
    g_last_error = "out of memory";
    return COLIBRI_ERR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    g_last_error = e.what();
    return COLIBRI_ERR_INTERNAL;
  } catch (...) {
    g_last_error = "unknown exception";
    return COLIBRI_ERR_INTERNAL;
  }
}

void check_arg(bool ok, const char* msg) {
  if (!ok) throw colibri::Error(colibri::Status::InvalidArgument, msg);
}

// Holds the handle's lock for one API call (see colibri.h: calls on one handle
// are serialised). A call from inside a callback of a call running on the same
// handle would wait for itself: it throws Error(InvalidArgument) instead.
class HandleLock {
 public:
  explicit HandleLock(colibri_model* m) : m_(m) {
    if (m_->owner.load() == std::this_thread::get_id())
      throw colibri::Error(colibri::Status::InvalidArgument,
                           "this handle is busy with a call on the same thread: a callback may not call back into "
                           "the handle it was called from (calls on one handle are serialised)");
    lock_ = std::unique_lock<std::mutex>(m_->mu);
    m_->owner.store(std::this_thread::get_id());
    // NOTE: OpenMP's thread count is per calling thread: apply the handle's on every call.
    if (m_->n_threads > 0) colibri::kernels::set_threads(m_->n_threads);
  }
  ~HandleLock() { m_->owner.store(std::thread::id()); }
  HandleLock(const HandleLock&) = delete;
  HandleLock& operator=(const HandleLock&) = delete;

 private:
  colibri_model* m_;
  std::unique_lock<std::mutex> lock_;
};

// The blocking calls share the engine's KV cache with submitted requests:
// refused while any is unfinished (colibri.h).
void refuse_if_requests(colibri_model* m) {
  if (m->requests.active.load() > 0)
    throw colibri::Error(colibri::Status::InvalidArgument,
                         "this handle is running requests from colibri_submit; a blocking call would share its KV "
                         "cache: wait until they end, or use a second handle");
}

const char* static_reason(const std::string& r) {
  for (const char* k : {"eos", "stop", "length", "cancelled", "interrupted", "error"})
    if (r == k) return k;
  return "error";
}

// A submitted, not released request's state (the caller holds q.mu), else Error(InvalidArgument).
std::unordered_map<int64_t, CapiRequests::State>::iterator known_request(CapiRequests& q, int64_t id) {
  auto it = q.state.find(id);
  check_arg(it != q.state.end(), "unknown request id (never submitted, or released)");
  return it;
}

// A request ended: record why, then tell its callback.
void end_request(CapiRequests& q, int64_t id, const char* reason) {
  colibri_request_callback cb = nullptr;
  void* user = nullptr;
  {
    std::lock_guard<std::mutex> g(q.mu);
    auto it = q.state.find(id);
    if (it == q.state.end() || it->second.finish) return;
    it->second.finish = reason;
    cb = it->second.cb, user = it->second.user;
  }
  q.active.fetch_sub(1);
  if (cb) cb(user, id, -1, reason);
}

// The request thread: takes the inbox, steps the scheduler while anything runs.
void request_loop(colibri_model* m) {
  CapiRequests& q = m->requests;
  std::unique_ptr<colibri::Scheduler> sched;
  std::unordered_map<int64_t, int64_t> capi_id;  // scheduler id -> request id
  for (;;) {
    std::deque<std::pair<int64_t, colibri::Request>> inbox;
    std::vector<int64_t> cancels;
    {
      std::unique_lock<std::mutex> l(q.mu);
      q.cv.wait(l, [&] { return q.stop || !q.inbox.empty() || !q.cancels.empty() || (sched && !sched->idle()); });
      if (q.stop && (!sched || sched->idle()) && q.inbox.empty()) break;
      inbox.swap(q.inbox);
      cancels.swap(q.cancels);
    }
    HandleLock lock(m);
    if (!sched) sched = std::make_unique<colibri::Scheduler>(*m->engine, colibri::SchedulerOptions{});
    for (auto& [id, req] : inbox) {
      const int64_t rid = id;
      colibri::RequestCallbacks rc;
      rc.on_token = [&q, rid](int, int32_t t) {
        colibri_request_callback cb = nullptr;
        void* user = nullptr;
        {
          std::lock_guard<std::mutex> g(q.mu);
          auto& st = q.state[rid];
          st.tokens.push_back(t);
          cb = st.cb, user = st.user;
        }
        if (cb) cb(user, rid, t, nullptr);
        return true;
      };
      rc.on_finish = [&q, rid](int64_t, const colibri::SequenceOutput& o) {
        end_request(q, rid, static_reason(o.finish_reason));
      };
      try {
        const int64_t sid = sched->submit(std::move(req), std::move(rc));
        capi_id[sid] = rid;
        std::lock_guard<std::mutex> g(q.mu);
        q.state[rid].sched_id = sid;
      } catch (const colibri::Error& e) {
        spdlog::warn("request {}: {}", rid, e.what());
        end_request(q, rid, "error");
      }
    }
    for (int64_t id : cancels) {
      int64_t sid = -1;
      {
        std::lock_guard<std::mutex> g(q.mu);
        auto it = q.state.find(id);
        if (it != q.state.end()) sid = it->second.sched_id;
      }
      if (sid >= 0) sched->cancel(sid);
    }
    try {
      sched->step();
    } catch (const colibri::Error& e) {
      // The scheduler ended every unfinished request with "error" (on_finish).
      spdlog::error("requests: {}", e.what());
    }
    // Finished requests' outputs are kept in our state: drop the scheduler's.
    for (auto it = capi_id.begin(); it != capi_id.end();) {
      if (sched->finished(it->first)) {
        sched->take(it->first);
        it = capi_id.erase(it);
      } else {
        ++it;
      }
    }
  }
}

std::vector<colibri::Request> make_requests(const int32_t* const* prompts, const int32_t* lengths, int32_t n) {
  check_arg(prompts != nullptr && lengths != nullptr, "prompts and lengths must not be NULL");
  check_arg(n > 0, "n_sequences must be > 0");
  std::vector<colibri::Request> reqs(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) {
    check_arg(lengths[i] >= 0, "a prompt length is negative");
    check_arg(lengths[i] == 0 || prompts[i] != nullptr, "a prompt pointer is NULL");
    reqs[static_cast<size_t>(i)].prompt.assign(prompts[i], prompts[i] + lengths[i]);
  }
  return reqs;
}

}  // namespace

extern "C" {

colibri_config colibri_default_config(void) {
  colibri_config c;
  c.n_threads = 0;
  c.max_batch = 4;
  c.max_context = 0;
  c.prefill_chunk = 256;
  c.log_level = 3;
  return c;
}

colibri_sampling colibri_default_sampling(void) {
  colibri_sampling s;
  s.temperature = 0.0f;
  s.top_k = 0;
  s.top_p = 1.0f;
  s.seed = 0;
  s.max_new_tokens = 16;
  s.ignore_eos = 0;
  return s;
}

colibri_status colibri_init(const char* path, const colibri_config* config, colibri_model** model) {
  if (model) *model = nullptr;
  return guarded([&] {
    check_arg(path != nullptr && model != nullptr, "path and model must not be NULL");
    colibri_config cfg = config ? *config : colibri_default_config();
    check_arg(cfg.log_level >= 0 && cfg.log_level <= 6, "log_level must be in [0, 6]");
    if (cfg.n_threads < 0 || cfg.n_threads > colibri::kernels::kMaxThreads)
      throw colibri::Error(colibri::Status::InvalidArgument, "n_threads " + std::to_string(cfg.n_threads) +
                                                                 " is out of range [0, " + std::to_string(colibri::kernels::kMaxThreads) +
                                                                 "] (0 = all cores)");
    spdlog::set_level(static_cast<spdlog::level::level_enum>(cfg.log_level));
    colibri::kernels::set_threads(cfg.n_threads);
    auto m = std::make_unique<colibri_model>();
    m->n_threads = cfg.n_threads;
    m->file = colibri::ColibriFile::open(path);
    m->comm = colibri::make_local_communicator();
    colibri::EngineOptions eo;
    eo.max_batch = cfg.max_batch;
    // NOTE: 0 means the model's maximum capped at 4096 positions: a long-context
    // model would otherwise reserve its full context for every sequence.
    eo.max_context = cfg.max_context > 0
                         ? cfg.max_context
                         : std::min<int64_t>(4096, m->file->config().max_position_embeddings);
    eo.prefill_chunk = cfg.prefill_chunk;
    m->engine = std::make_unique<colibri::Engine>(m->file, eo, *m->comm);
    *model = m.release();
  });
}

colibri_status colibri_get_info(const colibri_model* model, colibri_model_info* info) {
  return guarded([&] {
    check_arg(model != nullptr && info != nullptr, "model and info must not be NULL");
    const auto& c = model->file->config();
    info->vocab_size = static_cast<int32_t>(c.vocab_size);
    info->hidden_size = static_cast<int32_t>(c.hidden_size);
    info->num_layers = static_cast<int32_t>(c.num_layers);
    info->num_experts = static_cast<int32_t>(c.num_experts);
    info->experts_per_token = static_cast<int32_t>(c.experts_per_token);
    info->max_context = static_cast<int32_t>(model->engine->max_context());
    info->eos_token_id = static_cast<int32_t>(c.eos_token_id);
  });
}

colibri_status colibri_infer(colibri_model* model, const int32_t* const* prompts, const int32_t* lengths,
                             int32_t n_sequences, float* logits, int32_t* next_tokens) {
  return guarded([&] {
    check_arg(model != nullptr, "model must not be NULL");
    HandleLock lock(model);
    refuse_if_requests(model);
    auto reqs = make_requests(prompts, lengths, n_sequences);
    for (auto& r : reqs) r.max_new_tokens = 0;
    colibri::GenerateOptions go;
    go.record_logits = true;
    auto out = model->engine->generate(reqs, go);
    const int64_t V = model->file->config().vocab_size;
    for (size_t i = 0; i < out.size(); ++i) {
      const float* last = out[i].logits.data() + (reqs[i].prompt.size() - 1) * static_cast<size_t>(V);
      if (logits) std::memcpy(logits + i * static_cast<size_t>(V), last, static_cast<size_t>(V) * sizeof(float));
      if (next_tokens) next_tokens[i] = colibri::argmax(last, V);
    }
  });
}

colibri_status colibri_generate(colibri_model* model, const int32_t* const* prompts, const int32_t* lengths,
                                int32_t n_sequences, const colibri_sampling* sampling,
                                colibri_token_callback callback, void* user_data, int32_t* out_tokens,
                                int32_t* out_counts) {
  bool cancelled = false;
  colibri_status st = guarded([&] {
    check_arg(model != nullptr, "model must not be NULL");
    HandleLock lock(model);
    refuse_if_requests(model);
    colibri_sampling s = sampling ? *sampling : colibri_default_sampling();
    auto reqs = make_requests(prompts, lengths, n_sequences);
    for (size_t i = 0; i < reqs.size(); ++i) {
      reqs[i].max_new_tokens = s.max_new_tokens;
      reqs[i].ignore_eos = s.ignore_eos != 0;
      reqs[i].stop_ids = colibri::eos_token_ids(model->file->config());
      reqs[i].sampling = {s.temperature, s.top_k, s.top_p, s.seed + i};
    }
    colibri::GenerateOptions go;
    if (callback)
      go.on_token = [&](int seq, int pos, int32_t tok) { return callback(user_data, seq, pos, tok) == 0; };
    colibri::GenerateStats gs;
    auto copy_out = [&](const std::vector<colibri::SequenceOutput>& out) {
      for (size_t i = 0; i < out.size(); ++i) {
        if (out_counts) out_counts[i] = static_cast<int32_t>(out[i].tokens.size());
        if (out_tokens)
          std::memcpy(out_tokens + i * static_cast<size_t>(s.max_new_tokens), out[i].tokens.data(),
                      out[i].tokens.size() * sizeof(int32_t));
      }
    };
    try {
      copy_out(model->engine->generate(reqs, go, &gs));
    } catch (const colibri::GenerationError& e) {
      copy_out(e.partial());  // the tokens before the failure are the caller's
      throw;
    }
    cancelled = gs.cancelled;
  });
  if (st == COLIBRI_OK && cancelled) {
    g_last_error = "generation stopped by the token callback";
    return COLIBRI_ERR_CANCELLED;
  }
  return st;
}

colibri_status colibri_encode(colibri_model* model, const char* text, int32_t add_special, int32_t* ids,
                              size_t capacity, size_t* n_ids) {
  return guarded([&] {
    check_arg(model != nullptr && text != nullptr && n_ids != nullptr, "model, text and n_ids must not be NULL");
    HandleLock lock(model);
    auto v = model->tokenizer().encode(text, add_special != 0);
    *n_ids = v.size();
    if (ids == nullptr && capacity == 0) return;  // size query
    check_arg(ids != nullptr, "ids must not be NULL when capacity > 0");
    if (capacity < v.size())
      throw colibri::Error(colibri::Status::InvalidArgument, "the ids buffer holds " + std::to_string(capacity) +
                                                                 " ids; the text needs " + std::to_string(v.size()));
    std::memcpy(ids, v.data(), v.size() * sizeof(int32_t));
  });
}

colibri_status colibri_decode(colibri_model* model, const int32_t* ids, size_t n_ids, int32_t skip_special, char* buf,
                              size_t capacity, size_t* length) {
  return guarded([&] {
    check_arg(model != nullptr && length != nullptr, "model and length must not be NULL");
    check_arg(ids != nullptr || n_ids == 0, "ids must not be NULL when n_ids > 0");
    HandleLock lock(model);
    const std::string t = model->tokenizer().decode(ids, n_ids, skip_special != 0);
    *length = t.size();
    if (buf == nullptr && capacity == 0) return;  // size query
    check_arg(buf != nullptr, "buf must not be NULL when capacity > 0");
    if (capacity < t.size() + 1)
      throw colibri::Error(colibri::Status::InvalidArgument, "the text buffer holds " + std::to_string(capacity) +
                                                                 " bytes; the text needs " + std::to_string(t.size() + 1) +
                                                                 " (with its NUL)");
    std::memcpy(buf, t.data(), t.size());
    buf[t.size()] = '\0';
  });
}

colibri_status colibri_generate_text(colibri_model* model, const char* const* prompts, int32_t n_sequences,
                                     int32_t add_special, const colibri_sampling* sampling, const char* const* stop,
                                     int32_t n_stop, colibri_text_callback callback, void* user_data,
                                     int32_t* out_counts) {
  bool cancelled = false;
  colibri_status st = guarded([&] {
    check_arg(model != nullptr, "model must not be NULL");
    HandleLock lock(model);
    refuse_if_requests(model);
    check_arg(prompts != nullptr && n_sequences > 0, "prompts must not be NULL and n_sequences must be > 0");
    check_arg(n_stop >= 0 && (n_stop == 0 || stop != nullptr), "stop must hold n_stop strings");
    std::vector<std::string> stops;
    for (int32_t i = 0; i < n_stop; ++i) {
      check_arg(stop[i] != nullptr && stop[i][0] != '\0', "a stop string is NULL or empty");
      stops.emplace_back(stop[i]);
    }
    const colibri::Tokenizer& tok = model->tokenizer();
    colibri_sampling s = sampling ? *sampling : colibri_default_sampling();
    const auto eos = colibri::eos_token_ids(model->file->config());
    std::vector<colibri::Request> reqs(static_cast<size_t>(n_sequences));
    std::vector<std::unique_ptr<colibri::StopTextStream>> streams;
    for (size_t i = 0; i < reqs.size(); ++i) {
      check_arg(prompts[i] != nullptr, "a prompt is NULL");
      reqs[i].prompt = tok.encode(prompts[i], add_special != 0);
      reqs[i].max_new_tokens = s.max_new_tokens;
      reqs[i].ignore_eos = s.ignore_eos != 0;
      reqs[i].stop_ids = eos;
      reqs[i].sampling = {s.temperature, s.top_k, s.top_p, s.seed + i};
      streams.push_back(std::make_unique<colibri::StopTextStream>(tok, stops));
    }
    std::vector<uint8_t> finished(reqs.size(), 0);
    bool stop_all = false;
    auto emit = [&](size_t i, const std::string& text, const char* reason) {
      if (reason) finished[i] = 1;
      if (!callback || (text.empty() && !reason)) return;
      if (callback(user_data, static_cast<int32_t>(i), text.c_str(), text.size(), reason) != 0) stop_all = true;
    };
    colibri::GenerateOptions go;
    go.stop = [&](int seq, int32_t t, const std::string& ending) {
      const size_t i = static_cast<size_t>(seq);
      colibri::StopTextStream& ts = *streams[i];
      std::string piece = ts.push(t);
      // The engine's order: its EOS, then a stop string, then the length.
      const char* reason = ending == "eos" ? "eos" : ts.stopped() ? "stop" : ending.empty() ? nullptr : "length";
      if (reason) piece += ts.finish();
      emit(i, piece, reason);
      return ts.stopped();
    };
    go.on_token = [&](int, int, int32_t) { return !stop_all; };
    colibri::GenerateStats gs;
    auto finish_all = [&](const std::vector<colibri::SequenceOutput>& out) {
      for (size_t i = 0; i < out.size(); ++i) {
        if (!finished[i] && !stop_all) emit(i, streams[i]->finish(), out[i].finish_reason.c_str());
        if (out_counts) out_counts[i] = static_cast<int32_t>(out[i].tokens.size());
      }
    };
    try {
      finish_all(model->engine->generate(reqs, go, &gs));
    } catch (const colibri::GenerationError& e) {
      finish_all(e.partial());  // the text so far, each unfinished sequence ending with "error"
      throw;
    }
    cancelled = gs.cancelled;
  });
  if (st == COLIBRI_OK && cancelled) {
    g_last_error = "generation stopped by the text callback";
    return COLIBRI_ERR_CANCELLED;
  }
  return st;
}

colibri_status colibri_submit(colibri_model* model, const int32_t* prompt, int32_t length,
                              const colibri_sampling* sampling, colibri_request_callback callback, void* user_data,
                              int64_t* request) {
  return guarded([&] {
    check_arg(model != nullptr && request != nullptr, "model and request must not be NULL");
    check_arg(length > 0 && prompt != nullptr, "the prompt must hold at least one token id");
    const colibri_sampling s = sampling ? *sampling : colibri_default_sampling();
    colibri::Request r;
    r.prompt.assign(prompt, prompt + length);
    r.max_new_tokens = s.max_new_tokens;
    r.ignore_eos = s.ignore_eos != 0;
    r.stop_ids = colibri::eos_token_ids(model->file->config());
    r.sampling = {s.temperature, s.top_k, s.top_p, s.seed};
    model->engine->validate_request(r, "the request");  // const: reads the model's limits only
    CapiRequests& q = model->requests;
    {
      std::lock_guard<std::mutex> g(q.mu);
      check_arg(!q.stop, "the handle is being freed");
      const int64_t id = q.next_id++;
      auto& st = q.state[id];
      st.cb = callback, st.user = user_data;
      q.active.fetch_add(1);
      q.inbox.emplace_back(id, std::move(r));
      *request = id;
      if (!q.thread.joinable()) q.thread = std::thread(request_loop, model);
    }
    q.cv.notify_one();
  });
}

colibri_status colibri_poll(colibri_model* model, int64_t request, int32_t* tokens, size_t capacity,
                            size_t* n_tokens, const char** finish_reason) {
  return guarded([&] {
    check_arg(model != nullptr && n_tokens != nullptr, "model and n_tokens must not be NULL");
    CapiRequests& q = model->requests;
    std::lock_guard<std::mutex> g(q.mu);
    const auto& st = known_request(q, request)->second;
    *n_tokens = st.tokens.size();
    if (finish_reason) *finish_reason = st.finish;
    if (tokens == nullptr && capacity == 0) return;
    check_arg(capacity >= st.tokens.size(), "the token buffer is too small (*n_tokens says how many)");
    check_arg(tokens != nullptr, "tokens must not be NULL with a capacity");
    std::copy(st.tokens.begin(), st.tokens.end(), tokens);
  });
}

colibri_status colibri_cancel(colibri_model* model, int64_t request) {
  return guarded([&] {
    check_arg(model != nullptr, "model must not be NULL");
    CapiRequests& q = model->requests;
    {
      std::lock_guard<std::mutex> g(q.mu);
      if (known_request(q, request)->second.finish) return;
      q.cancels.push_back(request);
    }
    q.cv.notify_one();
  });
}

colibri_status colibri_release(colibri_model* model, int64_t request) {
  return guarded([&] {
    check_arg(model != nullptr, "model must not be NULL");
    CapiRequests& q = model->requests;
    std::lock_guard<std::mutex> g(q.mu);
    auto it = known_request(q, request);
    check_arg(it->second.finish != nullptr, "the request is still running (colibri_cancel it first)");
    q.state.erase(it);
  });
}

void colibri_free(colibri_model* model) { delete model; }

const char* colibri_last_error(void) { return g_last_error.c_str(); }

}  // extern "C"

colibri_model::~colibri_model() {
  {
    std::lock_guard<std::mutex> g(requests.mu);
    requests.stop = true;
    for (auto& [id, st] : requests.state)
      if (!st.finish) requests.cancels.push_back(id);
  }
  requests.cv.notify_one();
  if (requests.thread.joinable()) requests.thread.join();
}
