// The controller's side of checkpoints (private to src/controller): checkpoint.dir/step_NNNNNN/
// directories, which the trainer ranks fill with their sharded roles (zero/checkpoint.h), and
// controller.json, the controller's own state, written last and atomically: a directory without
// it is incomplete and never used, so a job killed while saving keeps its last checkpoint.
//
// Names: under checkpoint.dir, step_<digits> is a checkpoint, a name with a dot is a temporary
// (ignored), and any other step_* name is refused with a message naming it, rather than guessed at.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "controller/collector.h"

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

class CheckpointManager {
 public:
  struct Entry {
    int64_t step = 0;
    std::string dir;
  };

  // An empty root: checkpoints are off.
  CheckpointManager(std::string root, int64_t keep_last);
  bool enabled() const { return !root_.empty(); }
  const std::string& root() const { return root_; }
  std::string dir(int64_t step) const;  // root/step_NNNNNN

  // Complete checkpoints, oldest first. ConfigError for a step_* name that is not step_<digits>.
  std::vector<Entry> list() const;
  // Creates step's directory and removes its controller.json (so it counts as incomplete until
  // commit); returns the directory. IoError names it when it cannot be made.
  std::string begin(int64_t step) const;
  // Writes controller.json (completing the checkpoint), then deletes the oldest complete ones
  // beyond keep_last.
  void commit(int64_t step, const ControllerState& state) const;
  // Removes the step_<digits> directories that hold no controller.json (a save that a crash cut
  // short) and returns their names. Only while no job writes here (the supervisor, between runs).
  std::vector<std::string> remove_incomplete() const;
  // The newest complete checkpoint and its state, or nullopt.
  std::optional<std::pair<Entry, ControllerState>> latest() const;

 private:
  std::string root_;
  int64_t keep_last_;
};

}  // namespace tiller::rollout
