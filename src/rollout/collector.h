// The rollout collector (private to src/rollout): prompts to the engines, completions back as
// they finish, rewards, and the streaming scoring of the step being formed, in the sync loop and
// in the asynchronous pipeline alike (docs/training.md).
//
// Groups. Each prompt is dispatched once, as one request of n samples (a group), numbered by a
// run-wide dispatch ordinal g (its engine request id; its sampling seed comes from g too). A group
// is outstanding from its dispatch until a step trains it, or it is dropped (too stale) or
// filtered (DAPO: all n rewards equal).
//
// The staleness gate. One weight version per actor update: the forming step trains from version F
// (the engines' version, plus one when the step before is still to sync), and each later step
// past train.critic_warmup_steps one more (at most: a step with nothing to train adds none). A
// group dispatched while the engines hold version v can be trained at lag <= k only by steps
// whose version is <= v + k, so dispatch stops while the outstanding groups fill those steps (and
// at most k + 1 steps). With k = 0 that is one step's prompts after each sync: the on-policy loop.
//
// The forming step takes groups (admission) by rollout.stale_policy:
//   wait  in dispatch order. Without filtering a group joins as soon as it is dispatched, and its
//         samples are scored as they arrive; the step waits for its stragglers. The gate bounds
//         every sample's lag by k.
//   drop  complete groups, oldest first: the step does not wait for stragglers while other groups
//         have finished. A group that can no longer be trained within lag k (its oldest token
//         older than V(forming) - k) is dropped, and aborted if still generating.
// With rollout.filter_groups a group joins once its rewards are known; a group whose rewards are
// all equal is filtered and another prompt takes its place, up to filter_max_extra_batches x
// batch_size per step; when they run out the step closes with the groups it has (logged).
//
// Scoring. A joined sample goes to every trainer group's ScoreRounds once that group may score
// the forming step: at once for frozen roles; for the actor and critic only after the step before
// has posted its training (and, for the actor, its weight sync), so that log-probs and values come
// from the weights the step trains (the orchestrator says when: release()).
//
// The step is ready when it has batch_size groups (or closed early), each complete, scored by
// every group, with every reward. take_batch() hands it over and starts forming the next.
//
// Multi-turn samples (an environment, env_runner.h): a sample arrives when its episode ends, not
// when the engine returns its first turn. Each sample is an episode: Start (its observation after
// the prompt), then per turn the engine generates, the environment answers (Step), and the
// observation's tokens are appended; the next turn resumes the engine's parked session of the
// sample (its KV cache), so only the observation is prefilled. A group's first turn is one request
// of n samples when the n Start observations are equal (the prompt is prefilled once); later turns
// are a request per sample, on the engine of its first. The episode ends when the environment says
// done, at rollout.max_turns, or when rollout.max_response_tokens leaves no room; then its session
// is closed and the engine's cache released. The sample's response is every token after the
// prompt, with a loss mask (observation tokens: 0) and the environment's reward per turn.
//
// Memory: joined samples live in the step's host arrays (experience.h); a sample of a group that
// has not joined yet (drop policy, filtering) waits as the engine's output until it joins.
//
// Threading: the controller's thread only.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "rollout/channel.h"
#include "rollout/engine_set.h"
#include "rollout/score_rounds.h"
#include "rollout/trainer_groups.h"
#include "tiller/core/clock.h"
#include "tiller/core/config.h"
#include "tiller/env/environment.h"
#include "tiller/model/sampling_params.h"
#include "tiller/rollout/experience.h"
#include "tiller/rollout/prompt_dataset.h"
#include "tiller/rollout/prompt_source.h"

namespace tiller::reward {
class BatchedReward;
}

namespace tiller::rollout {
class EnvRunner;
}

namespace tiller::rollout {

using SteadyClock = Clock;


// How samples get their reward before the trainers see them: a rule (any function of the prompt
// and the engine's output; the job's decodes the text for a registered rule), and/or a scorer
// off the controller's thread in batches (the remote service, a Python function). Neither: the
// reward model scores them (reward.type = model).
struct RewardSources {
  std::function<double(const Prompt&, const engine::SampleOutput&)> rule;
  reward::BatchedReward* batched = nullptr;
  // Decodes a response for the batched scorer.
  std::function<std::string(const std::vector<int64_t>&)> decode;
};

// The environment of multi-turn samples (env == null: single-turn).
struct TurnSources {
  EnvRunner* env = nullptr;
  // An observation's text as tokens inside the chat template's tool turn (model::observation_turn;
  // `turn_closed`: the model's turn ended with a stop token), or, `raw`, tokenized as it is (Start's
  // observation, which follows the prompt).
  std::function<std::vector<int64_t>(const std::string& text, bool turn_closed, bool raw)> observation_tokens;
  // A model turn's text for the environment (special tokens left out).
  std::function<std::string(const std::vector<int64_t>&)> decode;
  std::string session_prefix = "tiller";  // session ids are "<prefix>-<ordinal>-<sample>"
};

struct CollectorConfig {
  int64_t batch_size = 1;  // groups per step
  int64_t n = 1;           // samples per group
  int64_t staleness = 0;   // k
  StalePolicy stale_policy = StalePolicy::kWait;
  bool filter_groups = false;
  int64_t filter_max_extra = 0;  // prompts beyond batch_size a step may filter
  int64_t critic_warmup_steps = 0;
  int64_t num_steps = 1;
  int64_t max_in_flight_per_engine = 1;  // samples; dispatch waits beyond
  double progress_timeout_s = 1800;      // timeouts.generate_s
  const Clock* clock = &Clock::steady();  // of the progress deadline and the phase times
  double score_timeout_s = 600;
  int64_t score_micro_batch_tokens = 16384;
  double score_temperature = 1.0;
  // train.old_logprobs = recompute: the actor scores every sample. Otherwise the rollout's actor
  // log-probs are the engine's (for the metrics; training takes its own forward's).
  bool score_actor = true;
  model::SamplingParams sampling;        // every request's, but its seed
  uint64_t seed = 0;
  RolloutLayout layout;
  // Multi-turn samples (TurnSources::env set): the episode's limits.
  int64_t max_turns = 1;
  int64_t max_response_tokens = 0;       // tokens after the prompt, model's and observations'
  int64_t max_prompt_tokens = 0;         // the prompt with Start's observation

  static CollectorConfig from_job(const JobConfig& job, const std::vector<int64_t>& stop_ids, bool have_ref,
                                  bool have_critic);
};

// A prompt dispatched and not trained: what a checkpoint keeps so that a resumed run sends it again.
struct PendingPrompt {
  int64_t ordinal = 0;        // its dispatch ordinal (request id and seed)
  int64_t dataset_index = 0;
};

// One step's samples, from forming to trained.
struct StepBatch {
  explicit StepBatch(RolloutLayout layout) : ro(layout) {}
  int64_t step = 0;  // 1-based
  uint64_t train_version = 0;  // the actor weights it trains from
  Rollout ro;
  struct Group {
    int64_t ordinal = 0;
    int64_t dataset_index = 0;
    uint64_t dispatch_version = 0;
  };
  std::vector<Group> groups;  // ro.prompt indexes these
  // Groups that left without training while this step formed.
  struct Dropped {
    int64_t ordinal = 0;
    int64_t dataset_index = 0;
    uint64_t dispatch_version = 0;
    uint64_t oldest_version = 0;  // of its tokens that came back (UINT64_MAX: none)
    std::string reason;           // "stale" or "filtered"
  };
  std::vector<Dropped> dropped;
  ScoreTotals scores;
  // While it formed.
  int64_t filtered_groups = 0;
  int64_t stale_dropped_groups = 0, stale_dropped_samples = 0;
  bool filter_cap_reached = false;
  int64_t generated_tokens = 0;
  // Multi-turn: environment call seconds of its samples, and the tokens their turns' resumes
  // should find in the engines' sessions (prefix cached at the turn before; the engines' counter
  // session_tokens_reused matches it when nothing is computed again).
  double env_seconds = 0;
  int64_t env_calls = 0;
  int64_t session_prefix_tokens = 0;
  SteadyClock::time_point formed_since, first_dispatch, last_sample, ready_at;
  bool closed = false;  // takes no more groups
};

class RolloutCollector {
 public:
  // `groups` are the scoring groups (trainer_groups.h); all references must outlive the collector.
  RolloutCollector(const CollectorConfig& cfg, EngineSet& engines, TrainerLink& link, PromptSource& prompts,
                   RewardSources rewards, const std::vector<TrainerGroup>& groups, TurnSources turns = {});
  ~RolloutCollector();

  // Opens the streams and starts forming `first_step` with the engines at `version`. `resend`
  // are the prompts a checkpoint had in flight (sent again first, with their ordinals);
  // `next_ordinal` continues the run's numbering.
  void start(int64_t first_step, uint64_t version, const std::vector<PendingPrompt>& resend, int64_t next_ordinal);
  // One round of work without blocking, or waiting up to `wait_ms` for a completion when there
  // was nothing to do: completions, rewards, admission, dispatch, scoring posts. True when
  // anything happened. Throws on an engine's failure or when one stalls (timeouts.generate_s).
  bool pump(int wait_ms = 0);

  bool batch_ready() const;
  const StepBatch& forming() const { return *batch_; }
  // The ready step's batch (batch_ready()), for the step hooks: its scores may change.
  StepBatch& ready_batch();
  // Drops the ready batch's prompt groups whose `keep` (one per group) is 0, as rollout.filter_groups
  // drops ("filtered"): their samples leave the batch, the rest are renumbered in order.
  void drop_ready_groups(const std::vector<uint8_t>& keep);
  // The formed step (batch_ready()); the collector starts forming the next one at once, with the
  // trainer groups that hold a role in `will_train` held back from scoring until release(). The
  // next step trains from one version later when `will_train` has the actor.
  std::unique_ptr<StepBatch> take_batch(RoleSet will_train);
  // A trained step back: its host arrays (their memory) serve a later step.
  void recycle(std::unique_ptr<StepBatch> done);
  // `role` has posted the training of the step taken last (and the actor its weight sync): the
  // groups holding it may score the forming step.
  void release(Role role);
  // The engines now hold `version` (after a weight sync).
  void set_version(uint64_t version);
  // While paused no prompt is dispatched (a sync that waits out the samples in flight).
  void pause_dispatch(bool paused) { paused_ = paused; }
  // Samples the engines still owe, and multi-turn samples waiting for their environment.
  int64_t in_flight_samples() const;
  int64_t forming_step() const;

  // For checkpoints: the outstanding prompts in dispatch order, and the next ordinal.
  std::vector<PendingPrompt> outstanding() const;
  int64_t next_ordinal() const { return next_ordinal_; }
  // Aborts what is in flight and closes the streams.
  void close();

 private:
  struct Staged {
    engine::SampleOutput out;
    float score = 0;
    uint64_t uid = 0;  // batched reward id
    TurnInfo turns;    // multi-turn samples
    bool multi_turn = false;
    float turn_rewards = 0;  // their sum
    std::vector<int64_t> prompt;  // multi-turn: the prompt with Start's observation (empty: the dataset's)
  };
  // A multi-turn sample's episode, from its Start to its last Step.
  struct Episode {
    int64_t ordinal = 0;
    int64_t sample = 0;
    int engine = 0;
    std::string session;                // the environment's session id
    int turns = 0;                      // model turns done
    std::vector<int64_t> history;       // prompt + everything after it: the next turn's prompt
    int64_t prompt_len = 0;
    engine::SampleOutput out;           // every token after the prompt (observations' log-probs 0)
    TurnInfo info;
    engine::SessionKey parked{};        // the engine session that holds its cache
    bool has_parked = false;
    bool live = false;                  // a turn is on the engine, as request live_request
    uint64_t live_request = 0;
    env::Observation first;             // Start's observation, until the group's first request
    bool started = false;
    double env_seconds = 0;
    int64_t env_calls = 0;
  };
  struct Group {
    int64_t ordinal = 0;
    int64_t dataset_index = 0;
    int engine = -1;
    uint64_t dispatch_version = 0;
    SteadyClock::time_point dispatched;
    int64_t arrived = 0;
    int64_t async_pending = 0;
    uint64_t oldest = UINT64_MAX;  // oldest token version among arrived samples
    bool joined = false;
    int64_t batch_index = -1;      // once joined: its index in the forming step's groups
    std::vector<Staged> staged;    // arrived before joining
    int64_t starts = 0;            // multi-turn: Start answers in
  };
  struct AsyncSlot {
    int64_t group = 0;       // ordinal
    int64_t staged = -1;     // index in its staged samples, or
    int64_t sample = -1;     // the sample's index in the forming batch
  };

  int64_t capacity() const;
  void dispatch();
  void send(int64_t ordinal, int64_t dataset_index);
  void take(Completion& c);
  // A sample of group `g` is complete (single-turn: the engine's output; multi-turn: the episode's).
  void arrive(Group& g, Staged st);
  // Multi-turn.
  bool multi_turn() const { return turns_.env != nullptr; }
  static uint64_t episode_key(int64_t ordinal, int64_t sample) {
    return (static_cast<uint64_t>(ordinal) << 11) | static_cast<uint64_t>(sample);
  }
  void start_episodes(Group& g);
  void take_turn(Episode& ep, engine::SampleOutput s);
  void take_env_results();
  void first_turns(Group& g);
  void next_turn(Episode& ep, const env::Observation& obs);
  void submit_turn(Episode& ep, std::vector<int64_t> prompt, int64_t n, uint64_t id, uint64_t seed,
                   int64_t max_new_tokens, bool resume);
  uint64_t group_seed(int64_t ordinal) const;
  void end_episode(Episode& ep, bool env_done);
  void drop_episodes(const Group& g);
  std::string sample_where(int64_t ordinal, int64_t sample) const;
  void join_ready();
  void join(Group& g);
  void add_to_batch(Group& g, Staged s);
  void drop(Group& g, const char* why);
  bool complete(const Group& g) const { return g.arrived == cfg_.n && g.async_pending == 0; }
  uint64_t lag_bound(const Group& g) const;
  void take_async_scores();
  void post_scoring();
  void check_progress();
  void begin_forming(int64_t step, uint64_t train_version, RoleSet held);

  CollectorConfig cfg_;
  EngineSet& engines_;
  TrainerLink& link_;
  PromptSource& prompts_;
  RewardSources rewards_;
  std::vector<TrainerGroup> groups_;  // those that take score requests (scoring_groups)

  uint64_t version_ = 0;
  int64_t next_ordinal_ = 0;
  bool paused_ = false;
  bool open_ = false;
  std::map<int64_t, Group> outstanding_;  // by ordinal
  std::vector<PendingPrompt> resend_;     // a checkpoint's prompts still to send
  std::vector<int64_t> in_flight_;        // samples of engine requests not returned, per engine
  std::vector<int64_t> load_;             // samples dispatched and not arrived, per engine (dispatch balance)
  std::vector<SteadyClock::time_point> last_progress_;
  std::unordered_map<uint64_t, AsyncSlot> async_slots_;
  uint64_t next_uid_ = 0;
  bool async_unflushed_ = false;
  TurnSources turns_;
  std::unordered_map<uint64_t, Episode> episodes_;          // by episode_key
  std::unordered_map<uint64_t, uint64_t> turn_requests_;    // a turn's engine request id -> its episode key
  uint64_t next_turn_request_ = uint64_t{1} << 62;          // above every ordinal

  std::unique_ptr<StepBatch> batch_;                   // the forming step
  std::vector<Rollout> spare_;                         // cleared arrays of trained steps, for reuse
  std::vector<std::unique_ptr<ScoreRounds>> scoring_;  // per trainer group, for the forming step
  std::vector<bool> scoring_open_;
  std::vector<int64_t> packed_;                        // per group: batch samples added to its rounds
  RoleSet held_;                                       // roles not yet released for the forming step
};

}  // namespace tiller::rollout
