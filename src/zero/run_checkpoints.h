// A run's checkpoints with their state (private to src/): RunState, what controller.json holds,
// the marker that completes a step directory of checkpoint.dir (step_checkpoints.h: the layout,
// the names, completion and pruning). `tiller train`'s controller and the offline runner write it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "zero/step_checkpoints.h"

namespace tiller::zero {

// What controller.json holds: where the run stands, and (async) what was in flight.
struct RunState {
  // A prompt dispatched and not trained: a resumed run sends it again.
  struct Prompt {
    int64_t ordinal = 0;        // its dispatch ordinal (request id and seed)
    int64_t dataset_index = 0;
  };

  int64_t step = 0;              // steps completed
  uint64_t weight_version = 0;   // syncs done
  int64_t actor_updates = 0, critic_updates = 0;
  int64_t dataset_epoch = 0, dataset_position = 0, dataset_size = 0;
  double kl_coef = 0;
  double reward_mean = 0, reward_m2 = 0;
  int64_t reward_count = 0;
  // Prompts dispatched and not trained (sent again on resume), and the next dispatch ordinal.
  std::vector<Prompt> outstanding;
  int64_t next_ordinal = 0;

  std::string to_json() const;
  // IoError naming `path` when the text is not a controller state.
  static RunState from_json(const std::string& text, const std::string& path);
};

// The step directories (step_checkpoints.h) whose marker is a RunState.
class RunCheckpoints {
 public:
  using Entry = StepCheckpoints::Entry;
  // An empty root: checkpoints are off.
  RunCheckpoints(std::string root, int64_t keep_last);
  bool enabled() const { return dirs_.enabled(); }
  const std::string& root() const { return dirs_.root(); }
  std::string dir(int64_t step) const { return dirs_.dir(step); }
  std::vector<Entry> list() const;
  std::string begin(int64_t step) const { return dirs_.begin(step); }
  // Writes controller.json (completing the checkpoint), then deletes the oldest complete ones
  // beyond keep_last.
  void commit(int64_t step, const RunState& state) const;
  std::vector<std::string> remove_incomplete() const { return dirs_.remove_incomplete(); }
  // The newest complete checkpoint and its state, or nullopt.
  std::optional<std::pair<Entry, RunState>> latest() const;

 private:
  StepCheckpoints dirs_;
};

}  // namespace tiller::zero
