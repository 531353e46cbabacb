// What a step leaves behind (private to src/controller): its metrics (JSONL and TensorBoard, one
// record per step; metrics.h), the Chrome trace of the profiled steps (one track per rank: the
// controller's phases and every trainer rank's spans, in wall-clock time), and the rollout
// records (logging.rollout_records: one JSON line per trained or dropped sample, with the
// weight versions of its tokens, its lag and its reward).
//
// Threading: the controller's thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "controller/collector.h"
#include "tiller/controller/metrics.h"

namespace tiller::python {
class Tracking;
}

namespace tiller::controller {

// "3", "3,5", "3-5" -> the set of steps; ConfigError naming logging.profile_steps otherwise.
std::set<int64_t> parse_steps(const std::string& spec);

class StepTrace {
 public:
  // `labels[rank]` names each rank's track; the controller is rank `controller`.
  StepTrace(const std::string& profile_steps, std::string path, std::vector<std::string> labels, int controller);
  bool profiled(int64_t step) const { return steps_.count(step) > 0; }
  bool any() const { return !steps_.empty(); }
  // A span of `step` on `rank`'s track (-1: the controller's); kept only for profiled steps.
  void span(int64_t step, const std::string& name, int rank, double begin_us, double end_us);
  // A counter sample (Chrome's "C" event: a stacked graph on `rank`'s track), e.g. a rank's GPU
  // memory at each phase of the hybrid engine; kept only for profiled steps.
  void counter(int64_t step, const std::string& name, int rank, double time_us,
               const std::vector<std::pair<std::string, double>>& values);
  // Writes every span kept so far (atomically; after each profiled step).
  void write() const;
  const std::string& path() const { return path_; }

 private:
  std::set<int64_t> steps_;
  std::string path_;
  std::vector<std::string> labels_;
  int controller_;
  std::vector<std::string> events_;  // JSON objects
};

// Where a step's outputs go (logging.*).
struct StepOutputOptions {
  std::string metrics_jsonl, tensorboard_dir;  // required
  std::string records;                         // "": no rollout records
  bool record_tokens = false, record_text = false;
  std::string samples_jsonl;                   // with samples_per_step > 0
  int64_t samples_per_step = 0;
  // Token ids to text, special tokens kept; null: samples and records carry ids, no text.
  std::function<std::string(const std::vector<int64_t>&)> decode;
  python::Tracking* tracking = nullptr;  // W&B / MLflow: the metrics and samples go there too
};

class StepOutputs {
 public:
  explicit StepOutputs(StepOutputOptions o);
  void write(int64_t step, const Metrics& metrics);
  // One line per sample of `batch` (trained at weight version `trained_version`) and per dropped
  // group to the records; the step's first samples_per_step samples (by prompt group, then
  // sample) decoded to the samples file and TensorBoard's text tab. `line_of(dataset_index)` is
  // the prompt's line in the dataset.
  void record(const StepBatch& batch, uint64_t trained_version, const std::function<int64_t(int64_t)>& line_of);

 private:
  void samples(const StepBatch& batch, const std::function<int64_t(int64_t)>& line_of);
  StepOutputOptions o_;
  std::unique_ptr<JsonlWriter> jsonl_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  std::unique_ptr<JsonlWriter> records_;
  std::unique_ptr<JsonlWriter> samples_;
};

}  // namespace tiller::controller
