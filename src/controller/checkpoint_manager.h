// The controller's side of checkpoints (private to src/): its state, controller.json, the marker
// that completes a step directory of checkpoint.dir (zero/step_checkpoints.h: the layout, the
// names, completion and pruning).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "controller/collector.h"
#include "zero/step_checkpoints.h"

namespace tiller::rollout {

// What controller.json holds: where the run stands, and (async) what was in flight.
struct ControllerState {
  int64_t step = 0;              // steps completed
  uint64_t weight_version = 0;   // syncs done
  int64_t actor_updates = 0, critic_updates = 0;
  int64_t dataset_epoch = 0, dataset_position = 0, dataset_size = 0;
  double kl_coef = 0;
  double reward_mean = 0, reward_m2 = 0;
  int64_t reward_count = 0;
  // Prompts dispatched and not trained (sent again on resume), and the next dispatch ordinal.
  std::vector<PendingPrompt> outstanding;
  int64_t next_ordinal = 0;

  std::string to_json() const;
  // IoError naming `path` when the text is not a controller state.
  static ControllerState from_json(const std::string& text, const std::string& path);
};

// The controller's view of the step directories (zero/step_checkpoints.h): the marker is a
// ControllerState.
class CheckpointManager {
 public:
  using Entry = zero::StepCheckpoints::Entry;
  // An empty root: checkpoints are off.
  CheckpointManager(std::string root, int64_t keep_last);
  bool enabled() const { return dirs_.enabled(); }
  const std::string& root() const { return dirs_.root(); }
  std::string dir(int64_t step) const { return dirs_.dir(step); }
  std::vector<Entry> list() const;
  std::string begin(int64_t step) const { return dirs_.begin(step); }
  // Writes controller.json (completing the checkpoint), then deletes the oldest complete ones
  // beyond keep_last.
  void commit(int64_t step, const ControllerState& state) const;
  std::vector<std::string> remove_incomplete() const { return dirs_.remove_incomplete(); }
  // The newest complete checkpoint and its state, or nullopt.
  std::optional<std::pair<Entry, ControllerState>> latest() const;

 private:
  zero::StepCheckpoints dirs_;
};

}  // namespace tiller::rollout
