// The engine's state and the steps of its loop (private to src/engine): engine.cpp holds the
// requests, the weights and the TP followers, engine_sessions.cpp the parked multi-turn sessions,
// engine_step.cpp the schedule, launch and collection of a step.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <optional>
#include <unordered_map>

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <fmt/format.h>
#ifdef TILLER_HAVE_CUDA_KERNELS
#include <cuda_runtime_api.h>
#endif

#include "engine/model_runner.h"
#include "engine/step_batch.h"
#include "tiller/core/checked_math.h"
#include "tiller/core/logging.h"
#include "tiller/dist/communicator.h"
#include "tiller/engine/engine.h"
#include "tiller/engine/kv_block_manager.h"
#include "tiller/model/sampling.h"
#include "tiller/model/storage_swap.h"
#include "tiller/model/weights.h"

namespace tiller::engine {

// Messages from the TP leader to its followers: a header {kind, words} then the words.
enum class Message : int64_t { kStep = 1, kHeartbeat = 2, kShutdown = 3, kSyncPlan = 4, kSync = 5, kSleep = 6, kWake = 7 };

// A byte string as int64 words ({length, bytes...}) for a broadcast, and back.
inline std::vector<int64_t> to_words(const std::string& s) {
  std::vector<int64_t> w(1 + (s.size() + 7) / 8, 0);
  w[0] = static_cast<int64_t>(s.size());
  std::memcpy(w.data() + 1, s.data(), s.size());
  return w;
}
inline std::string from_words(const int64_t* w, int64_t n) {
  TILLER_CHECK(n >= 1 && w[0] >= 0 && (w[0] + 7) / 8 <= n - 1, "engine follower: malformed message");
  return std::string(reinterpret_cast<const char*>(w + 1), static_cast<size_t>(w[0]));
}

struct Sequence {
  int64_t id = 0;           // engine-wide, in arrival order: the scheduler's age
  uint64_t request = 0;
  int64_t sample = 0;
  int64_t pending_forks = 0;  // n - 1 until the prompt's first token is sampled
  std::vector<int64_t> tokens;  // prompt + generated
  int64_t prompt_len = 0;
  std::vector<float> logprobs;
  BlockTable table;
  int64_t num_computed = 0;
  int64_t preemptions = 0;
  // A resume waiting for a seat: the parked session it takes over, and how many of its tokens.
  int64_t resume_parked = -1;
  int64_t resume_common = 0;
  std::vector<int64_t> version_starts;  // SampleOutput's runs of weight versions
  std::vector<uint64_t> versions;
  // Routing replay: the experts of each computed position, [positions, route_width].
  std::vector<int16_t> routes;
  int64_t route_width = 0;

  // Stores the experts of positions [start, start + count) from `rows` ([count, width]).
  void set_routes(int64_t start, int64_t count, const int16_t* rows, int64_t width) {
    route_width = width;
    const auto end = static_cast<size_t>((start + count) * width);
    if (routes.size() < end) routes.resize(end, -1);
    std::copy(rows, rows + count * width, routes.begin() + static_cast<std::ptrdiff_t>(start * width));
  }

  // Appends a sampled token, drawn with weights `version`.
  void append(int64_t token, float logprob, uint64_t version) {
    if (versions.empty() || versions.back() != version) {
      version_starts.push_back(static_cast<int64_t>(tokens.size()) - prompt_len);
      versions.push_back(version);
    }
    tokens.push_back(token);
    logprobs.push_back(logprob);
  }
};

struct RequestState {
  Request req;
  int64_t live = 0;  // sequences not finished (forks count once created)
};

// A step on the device whose draws the host has not taken yet.
struct InFlight {
  struct Draw {
    int64_t seq;
    int64_t fork;  // 0: the sequence itself; j > 0: its j-th new sample
  };
  std::vector<Draw> draws;  // in the runner's sample-row order
  int64_t prefill_tokens = 0;
  struct Chunk {  // the step's rows [row, row + count): positions [start, start + count) of seq
    int64_t seq, start, count, row;
  };
  std::vector<Chunk> chunks;
};

inline void insert_by_age(std::vector<int64_t>& ids, int64_t id) {
  ids.insert(std::upper_bound(ids.begin(), ids.end(), id), id);
}

inline void erase_id(std::vector<int64_t>& ids, int64_t id) {
  auto it = std::find(ids.begin(), ids.end(), id);
  if (it != ids.end()) ids.erase(it);
}

struct Engine::Impl {
  model::ModelConfig cfg;
  EngineOptions opts;
  dist::Communicator* tp = nullptr;
  dist::Communicator* control = nullptr;  // the TP group over the host, or null: control goes over tp
  std::optional<c10::Stream> stream;      // EngineOptions::own_stream
  std::unique_ptr<ModelRunner> runner;
  std::unique_ptr<KvBlockManager> kv;
  int64_t max_model_len = 0;
  bool shut_down = false;
  bool calibrated = false;  // calibrate_if_due() ran
  WeightSink* sink = nullptr;
  std::string broken;  // why the weights cannot be served, or ""
  uint64_t weight_version = 0;  // of the weights the next step computes with

  std::map<int64_t, Sequence> seqs;
  std::vector<int64_t> running, waiting;  // ids, oldest first
  // Multi-turn sessions: finished samples whose blocks stay allocated, by sequence id (the
  // eviction order: oldest first), and their keys.
  struct Parked {
    Sequence seq;
    std::chrono::steady_clock::time_point since;
    bool claimed = false;  // a resume in `resuming` waits for it
  };
  std::map<int64_t, Parked> parked;
  std::map<SessionKey, int64_t> session_ids;
  // Resumes that found their session but no free seat (max_num_seqs): they take the session over
  // as soon as a seat frees, before any waiting prompt is admitted; ids, oldest first.
  std::vector<int64_t> resuming;
  std::chrono::steady_clock::time_point next_expiry;  // expire_sessions() looks at most once a second
  std::map<uint64_t, RequestState> requests;
  std::vector<SampleOutput> aborted;  // returned by the next step()
  int64_t next_id = 0;
  EngineStats stats;
  // Asynchronous scheduling: the step launched ahead of the host, collected by the next step().
  std::optional<InFlight> in_flight;

  bool leader() const { return !tp || tp->rank() == 0; }
  bool tensor_parallel() const { return tp && tp->size() > 1; }
  at::Device device() const { return runner->device(); }

  bool async() const { return opts.async_scheduling && !tensor_parallel(); }

  void broadcast(Message kind, std::vector<int64_t> words);
  // The communicator of the leader's messages and the group's votes, and where their tensors live.
  dist::Communicator* ctl() const { return control ? control : tp; }
  at::Device control_device() const {
    return ctl() && std::string(ctl()->backend()) == "nccl" ? device() : at::Device(at::kCPU);
  }
  // Waits for the engine's stream (own_stream): before another thread writes its weights.
  void quiesce() const;
  // For the duration of a call that launches work: the engine's stream (own_stream) current on
  // the calling thread, and its device; nothing without one.
  c10::OptionalStreamGuard on_stream() const { return c10::OptionalStreamGuard(stream); }
  // Every TP rank: one sync through the sink, and the group's combined outcome.
  WeightSink::Result receive_weights(uint64_t version);
  ModelRunner::CacheOptions cache_options;
  // Every TP rank: sleep (level 1 or 2) and wake (the weights' memory, then the cache's).
  void sleep_here(int level);
  void wake_here(bool weights, bool cache);
  void validate(const Request& r) const;
  // The sample's output; its blocks are released unless it is to be parked (`keep`).
  SampleOutput finish(Sequence& s, const char* reason, bool keep = false);
  int64_t max_sessions() const { return opts.max_sessions > 0 ? opts.max_sessions : 4 * opts.limits.max_num_seqs; }
  void park(Sequence s);
  // Releases a parked session's blocks and forgets it; `evicted` counts it in the stats.
  void drop_parked(int64_t id, bool evicted);
  void drop_all_parked();
  void expire_sessions();
  // Sequence `s` (running) takes over parked session `pid`'s first `common` computed tokens.
  void adopt(Sequence& s, int64_t pid, int64_t common);
  // The resumes in `resuming`, into free seats; those whose session is gone wait as new prompts.
  void adopt_resumes();
  std::vector<SeqState> parked_states() const {
    // Sessions a waiting resume has claimed are evicted last.
    std::vector<SeqState> out, claimed;
    for (const auto& [id, p] : parked)
      (p.claimed ? claimed : out).push_back({id, static_cast<int64_t>(p.seq.tokens.size()), p.seq.num_computed, &p.seq.table, 1});
    out.insert(out.end(), claimed.begin(), claimed.end());
    return out;
  }
  int64_t running_seats() const {
    int64_t n = 0;
    for (int64_t id : running) n += 1 + seqs.at(id).pending_forks;
    return n;
  }
  std::vector<SeqState> waiting_states() const {
    std::vector<SeqState> out;
    for (int64_t id : waiting) {
      const Sequence& s = seqs.at(id);
      out.push_back({id, static_cast<int64_t>(s.tokens.size()), 0, nullptr, 1 + s.pending_forks});
    }
    return out;
  }
  // The scheduler's plan for the next step, applied (preemptions, admissions).
  StepPlan schedule_now();
  // KV slots for every chunk of `plan`, the batch, and the launch. `pending` maps a sequence to
  // its draw in the step in flight, whose token it computes this step.
  InFlight launch(const StepPlan& plan, const std::unordered_map<int64_t, int64_t>& pending);
  // The next step launched before `f` is collected, when it is a decode of sequences whose
  // tokens the host need not see first: no forks in `f`, nothing preempted or admitted.
  std::optional<InFlight> launch_ahead(const InFlight& f);
  // Takes `f`'s draws: forks, tokens, stops and lengths; finished samples go to `done`.
  void collect(const InFlight& f, std::vector<SampleOutput>& done);
};

}  // namespace tiller::engine
