// The hybrid engine's phases as the controller drives them (cluster.hybrid; docs/training.md).
// private to src/controller.
//
// Every GPU holds a trainer and an engine; they take turns:
//   generate  the trainers move their offloaded roles' state to the host (roles.<r>.offload), then
//             the engines wake their KV caches: the cache is allocated only once the trainer's
//             state has left, so the GPU never holds both;
//   score     (cluster.hybrid_scoring = after_generate; every sample is in) the engines sleep at
//             level 1 at most (their KV caches go), and the trainers score on GPUs where no engine
//             runs; without it the trainers score while the engines generate;
//   train     (the step's samples are all generated and scored) the engines sleep at
//             engines.sleep_level (at most 1 when no sync follows), then the trainers bring their
//             state back;
//   sync      before the weight sync, engines asleep at level 2 wake their weights' memory (the
//             sync refills it); the KV cache stays asleep until the next generate.
// Each change records every trainer rank's device memory (allocated, reserved, and the peak of
// the phase that ended) in the step's metrics (memory/<phase>/...) and as trace counters.
//
// Threading: the controller's thread; no collector work may be in flight during a change.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace tiller {
struct JobConfig;
}

namespace tiller::wire {
class TrainerLink;
}  // namespace tiller::wire

namespace tiller::controller {

class EngineSet;
class StepTrace;

class HybridPhases {
 public:
  // `put(key, value)` adds a metric of the current step. All must outlive the phases.
  using Put = std::function<void(const std::string&, double)>;
  HybridPhases(const JobConfig& cfg, EngineSet& engines, wire::TrainerLink& link, std::vector<int> trainer_ranks,
               StepTrace& trace);

  void generate(int64_t step, const Put& put);
  // after_generate: the step's samples are in; the engines free their KV caches before scoring.
  void score(int64_t step, const Put& put);
  // `sync_follows`: the step updates the actor and syncs. Without it (critic warm-up, a step with
  // nothing to train) the engines sleep at level 1 at most: level 2 would leave no weights for the
  // next generation, since only a sync refills them.
  void train(int64_t step, bool sync_follows, const Put& put);
  void before_sync(int64_t step, const Put& put);
  // Whether the engines' KV caches are awake (requests may go to them).
  bool generating() const { return generating_; }

 private:
  // Every trainer rank's phase change, and its memory into the metrics under `phase`; returns the
  // most any rank has allocated afterwards.
  double trainers(bool offload, int64_t step, const std::string& phase, const std::string& ended, const Put& put);

  const JobConfig& cfg_;
  EngineSet& engines_;
  wire::TrainerLink& link_;
  std::vector<int> ranks_;
  StepTrace& trace_;
  bool generating_ = false;
  int asleep_ = 0;  // the engines' sleep level since the last change (0: awake)
  bool scored_ = false;  // this step's score phase began (after_generate)
  double sleep_seconds_ = 0;  // this step's, score and train phases together
};

}  // namespace tiller::controller
