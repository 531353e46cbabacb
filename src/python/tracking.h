// Experiment tracking (logging.wandb, logging.mlflow) through the trackers' own Python packages in
// the embedded interpreter (interpreter.h): Weights & Biases (wandb) and MLflow (mlflow or
// mlflow-skinny). A run opens at construction with the job's effective config (as nested
// parameters) and its output folder; then every step's metrics, the decoded samples (a W&B table,
// an MLflow JSON artifact a step), and at the end the run is finished.
//
// MLflow's metric names allow fewer characters than tiller's: "@" becomes "_at_" (pass@4 ->
// pass_at_4) and any other character outside [A-Za-z0-9_-. :/] becomes "_".
//
// Failures: a missing package or a tracker that cannot start is a ConfigError at construction
// (naming the pip command); a failure while logging is a warning, once per tracker, and the run
// goes on (metrics.jsonl keeps everything).
//
// Threading: one thread (the controller's); each call takes the GIL.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace tiller::python {

struct TrackingOptions {
  std::string wandb_project, wandb_entity, wandb_name, wandb_tags, wandb_mode = "online", wandb_dir;
  std::string mlflow_experiment, mlflow_tracking_uri, mlflow_run_name;
  std::string config_yaml;  // the effective config
  std::string output_dir;   // recorded with the run (the checkpoints, metrics.jsonl, samples)
  bool enabled() const { return !wandb_project.empty() || !mlflow_experiment.empty(); }
};

class Tracking {
 public:
  explicit Tracking(const TrackingOptions& o);
  ~Tracking();  // finishes the runs (as failed unless finish(true) came first)
  Tracking(const Tracking&) = delete;
  Tracking& operator=(const Tracking&) = delete;

  void log(int64_t step, const std::vector<std::pair<std::string, double>>& metrics);
  // `rows_json`: a JSON list of sample objects (samples.jsonl's lines).
  void samples(int64_t step, const std::string& rows_json);
  void finish(bool ok);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tiller::python
