// A run's checkpoints as step directories (private to src/): checkpoint.dir/step_NNNNNN/, each
// filled by the ranks with their sharded roles (zero/checkpoint.h) and completed by one marker
// file, controller.json (the run's own state, which the controller or the offline runner
// writes), written last and atomically: a directory without it is incomplete and never used, so
// a job killed while saving keeps its last checkpoint. `tiller train`, `tiller sft` / `train-rm` /
// `dpo` and the supervisor of `tiller launch` share this layout.
//
// Names: under the root, step_<digits> is a checkpoint, a name with a dot is a temporary
// (ignored), and any other step_* name is refused with a message naming it, rather than guessed at.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace tiller::zero {

class StepCheckpoints {
 public:
  // The file whose presence completes a step's directory.
  static constexpr const char* kMarker = "controller.json";

  struct Entry {
    int64_t step = 0;
    std::string dir;
  };
  // An empty root: checkpoints are off. keep_last < 1 counts as 1.
  StepCheckpoints(std::string root, int64_t keep_last);
  bool enabled() const { return !root_.empty(); }
  const std::string& root() const { return root_; }
  std::string dir(int64_t step) const;  // root/step_NNNNNN
  // Complete checkpoints, oldest first. ConfigError for a step_* name that is not step_<digits>.
  std::vector<Entry> list() const;
  // Creates step's directory and removes its marker (so it counts as incomplete until commit);
  // returns the directory. IoError names it when it cannot be made.
  std::string begin(int64_t step) const;
  // Writes the marker with `marker_text` (completing the checkpoint), then deletes the oldest
  // complete ones beyond keep_last.
  void commit(int64_t step, const std::string& marker_text) const;
  // Removes the step_<digits> directories that hold no marker (a save that a crash cut short) and
  // returns their names. Only while no job writes here (the supervisor, between runs).
  std::vector<std::string> remove_incomplete() const;
  // The newest complete checkpoint, its marker's path and text; nullopt when there is none.
  // IoError when the marker cannot be read.
  struct Latest {
    Entry entry;
    std::string marker_path, marker_text;
  };
  std::optional<Latest> latest() const;

 private:
  std::string root_;
  int64_t keep_last_;
};

}  // namespace tiller::zero
