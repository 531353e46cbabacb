// The rollout collector (private to src/controller): prompts to the engines, completions back as
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
// from the weights the step trains (the orchestrator says when: release()); and never while the
// orchestrator holds scoring (hold_scoring: a hybrid step scored after its generation).
//
// The step is ready when it has batch_size groups (or closed early), each complete, scored by
// every group, with every reward. take_batch() hands it over and starts forming the next.
//
// Samples. How a group's n samples are made is the job's sample loop's business
// (tiller/controller/sample_loop.h: single_turn, multi_turn with an environment, or a user's): the
// collector starts the loop on each group it dispatches, routes the engines' answers to it, and
// takes each finished sample back; the collector is the loop's LoopHost.
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

#include "controller/engine_set.h"
#include "controller/score_rounds.h"
#include "tiller/controller/experience.h"
#include "tiller/controller/prompt_source.h"
#include "tiller/controller/sample_loop.h"
#include "tiller/core/clock.h"
#include "tiller/core/config.h"
#include "tiller/data/prompt_dataset.h"
#include "tiller/model/sampling_params.h"
#include "wire/channel.h"
#include "wire/trainer_groups.h"
#include "zero/run_checkpoints.h"

namespace tiller::reward {
class BatchedReward;
}

namespace tiller::controller {

using SteadyClock = Clock;


// How samples get their reward before the trainers see them: a rule (any function of the prompt
// and the engine's output; the job's decodes the text for a registered rule), and/or a scorer
// off the controller's thread in batches (the remote service, a Python function). Neither: the
// reward model scores them (reward.type = model).
struct RewardSources {
  std::function<double(const data::Prompt&, const engine::SampleOutput&)> rule;
  reward::BatchedReward* batched = nullptr;
  // Decodes a response for the batched scorer.
  std::function<std::string(const std::vector<int64_t>&)> decode;
};

// What the job's sample loop is made with besides the config (SampleLoopContext): the
// environment (null: none) and the tokenizer's functions.
struct LoopSources {
  std::shared_ptr<env::Environment> environment;
  std::function<std::vector<int64_t>(const std::string& text, bool turn_closed, bool raw)> observation_tokens;
  std::function<std::string(const std::vector<int64_t>&)> decode;
  std::string session_prefix = "tiller";  // session ids are "<prefix>-<ordinal>-<sample>"
  std::shared_ptr<const text::Tokenizer> tokenizer;  // the actor's (openai_agent)
  std::shared_ptr<const text::ChatTemplate> chat;
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
  // Standalone engines (the set can lose some): the job ends when fewer than this remain.
  int64_t min_engines = 1;
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
  std::string loop = "single_turn";  // the registered sample loop (job_sample_loop)
  const JobConfig* job = nullptr;    // for the loop's context (from_job)
  // Samples of loops with turns: their limits; the environment's calls.
  int64_t max_turns = 1;
  int64_t max_response_tokens = 0;       // tokens after the prompt, model's and observations'
  int64_t max_prompt_tokens = 0;         // the prompt with Start's observation
  int env_threads = 1;
  double env_timeout_s = 60;

  static CollectorConfig from_job(const JobConfig& job, const std::vector<int64_t>& stop_ids, bool have_ref,
                                  bool have_critic);
};

// A prompt dispatched and not trained: what a checkpoint keeps so that a resumed run sends it again.
using PendingPrompt = zero::RunState::Prompt;

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
  int64_t drifts = 0;  // the samples' retokenization drifts (openai_agent)
  int64_t session_prefix_tokens = 0;
  SteadyClock::time_point formed_since, first_dispatch, last_sample, ready_at;
  bool closed = false;  // takes no more groups
};

class RolloutCollector final : private LoopHost {
 public:
  // `groups` are the scoring groups (trainer_groups.h); all references must outlive the collector.
  RolloutCollector(const CollectorConfig& cfg, EngineSet& engines, wire::TrainerLink& link, PromptSource& prompts,
                   RewardSources rewards, const std::vector<wire::TrainerGroup>& groups, LoopSources loop_sources = {});
  ~RolloutCollector() override;

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
  // Completions of requests with ids at or above `base` (sent to the engines by someone else: the
  // evaluation) go to `sink`, from pump(), on the controller's thread. An engine's failure still
  // ends the job here.
  void set_side_sink(uint64_t base, std::function<void(Completion&)> sink) {
    side_base_ = base;
    side_sink_ = std::move(sink);
  }
  // While paused no prompt is dispatched (a sync that waits out the samples in flight).
  void pause_dispatch(bool paused) { paused_ = paused; }
  // The engine set changed (standalone engines): the engines that joined take prompts from now on;
  // the requests in flight on engines that left (retired by the set) go to the others, whole, and
  // their samples that came back already stay. Throws when fewer than min_engines remain.
  void engines_changed();
  // While held no score request goes to any trainer group; the forming step's samples wait in its
  // arrays and are posted once released (cluster.hybrid_scoring = after_generate: no trainer
  // collective while the engines generate on the same GPUs).
  void hold_scoring(bool held) { scoring_held_ = held; }
  // Every sample of the forming step is in (the step closed; rewards that decide admission known):
  // what remains is scoring.
  bool generation_done() const;
  // Samples the engines still owe, and samples waiting for the loop's other work (an environment).
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
    TurnInfo turns;    // loops with turns
    float turn_rewards = 0;  // their sum
    std::vector<int64_t> prompt;  // the loop's prompt (empty: the dataset's)
  };
  // An engine request a loop sent, until its last sample (and, once resent, its last repeat) is back.
  struct Live {
    int64_t group = 0;     // ordinal
    int engine = 0;
    int64_t remaining = 0;
    bool keep_session = false;
    bool aborted = false;
    engine::Request request;    // sent again, whole, when its engine leaves the job
    std::vector<uint8_t> back;  // per sample: came back (a resent request's repeats are dropped)
    int64_t repeats = 0;        // resent: samples back already that its engine still sends again
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
    std::vector<uint8_t> finished;  // per sample: the loop handed it back
    bool whole_sent = false;        // the loop sent the group's own request of n samples
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
  // A sample of group `g` is complete: rewarded, then staged or added to the forming step.
  void arrive(Group& g, Staged st);
  uint64_t group_seed(int64_t ordinal) const;
  std::string sample_where(int64_t ordinal, int64_t sample) const;
  Group& live_group(int64_t ordinal, const char* call);
  // LoopHost, for the sample loop.
  int64_t samples_per_prompt() const override { return cfg_.n; }
  const data::Prompt& prompt(int64_t group) const override;
  uint64_t seed(int64_t group) const override { return group_seed(group); }
  int64_t step() const override { return forming_step(); }
  std::string where(int64_t group, int64_t sample) const override { return sample_where(group, sample); }
  uint64_t generate(int64_t group, engine::Request r, bool whole_group) override;
  void abort(int64_t group, uint64_t request) override;
  void release_session(int64_t group, engine::SessionKey key) override;
  void finish(int64_t group, FinishedSample s) override;
  void count_session_prefix(int64_t tokens) override;
  void join_ready();
  void join(Group& g);
  void add_to_batch(Group& g, Staged s);
  void drop(Group& g, const char* why);
  bool complete(const Group& g) const { return g.arrived == cfg_.n && g.async_pending == 0; }
  uint64_t lag_bound(const Group& g) const;
  void take_async_scores();
  void post_scoring();
  void check_progress();
  // Engine e failed (`why`): retired from the set and its requests moved (move_off), or, when the
  // set cannot lose engines, the error that ends the job.
  void engine_failed(size_t e, const std::string& why);
  // The requests in flight on retired engine e, and its groups, to the live engines.
  void move_off(size_t e);
  // Engine e drains (its notice, or a request it refused): its prompt groups move to the others,
  // its requests finish there, and it leaves the job once they have.
  void engine_draining(size_t e);
  // Request `id` (live) again on another engine, whole.
  void resend(uint64_t id);
  // Engine e may take prompts: in the job and not draining.
  bool usable(size_t e) const { return !engines_.retired(e) && !draining_[e]; }
  size_t usable_count() const;
  // Engine e's groups to the others (for their next requests).
  int64_t move_groups(size_t e);
  size_t least_loaded() const;  // among the live engines
  void begin_forming(int64_t step, uint64_t train_version, RoleSet held);

  CollectorConfig cfg_;
  EngineSet& engines_;
  wire::TrainerLink& link_;
  PromptSource& prompts_;
  RewardSources rewards_;
  std::vector<wire::TrainerGroup> groups_;  // those that take score requests (scoring_groups)

  uint64_t version_ = 0;
  int64_t next_ordinal_ = 0;
  bool paused_ = false;
  bool scoring_held_ = false;
  bool open_ = false;
  std::map<int64_t, Group> outstanding_;  // by ordinal
  std::vector<PendingPrompt> resend_;     // a checkpoint's prompts still to send
  std::vector<int64_t> in_flight_;        // samples of engine requests not returned, per engine
  std::vector<int64_t> load_;             // samples dispatched and not arrived, per engine (dispatch balance)
  std::vector<SteadyClock::time_point> last_progress_;
  std::vector<uint8_t> moved_off_;        // per engine: retired, and its work moved
  std::vector<uint8_t> draining_;         // per engine: draining (no new prompt; leaves when idle)
  std::unordered_map<uint64_t, AsyncSlot> async_slots_;
  uint64_t next_uid_ = 0;
  bool async_unflushed_ = false;
  std::unique_ptr<SampleLoop> loop_;
  bool loop_turns_ = false;                           // its samples carry TurnInfo
  std::unordered_map<uint64_t, Live> live_;           // engine requests by id
  uint64_t next_request_ = uint64_t{1} << 62;         // ids of requests not a group's own: above every ordinal
  uint64_t side_base_ = UINT64_MAX;                   // set_side_sink
  std::function<void(Completion&)> side_sink_;

  std::unique_ptr<StepBatch> batch_;                   // the forming step
  std::vector<Rollout> spare_;                         // cleared arrays of trained steps, for reuse
  std::vector<std::unique_ptr<ScoreRounds>> scoring_;  // per trainer group, for the forming step
  std::vector<bool> scoring_open_;
  std::vector<int64_t> packed_;                        // per group: batch samples added to its rounds
  RoleSet held_;                                       // roles not yet released for the forming step
};

}  // namespace tiller::controller
