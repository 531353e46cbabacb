// Evaluation during RL (private to src/controller; docs/training.md, "Evaluation"): the held-out
// prompts of eval.prompts, generated on the job's engines between steps and scored with the job's
// reward (or eval.reward_rule), never trained on.
//
//   greedy      one greedy sample a prompt: eval/<source>/greedy_accuracy, greedy_reward
//   n_samples   k samples a prompt at eval.temperature: eval/<source>/pass@k (prompts with a
//               correct sample), mean@k (correct samples), reward_mean
// per data source (the prompts' data.data_source_key, else the file's name) and over all of them
// (eval/all/...), with response_length and prompts; a sample is correct when its reward is at
// least eval.correct_reward. The decoded samples go to run.output_dir/eval/step_<N>.jsonl.
//
// The requests go to the engines straight, with ids at kRequestBase and above; the collector hands
// their completions to take() from its pump (RolloutCollector::set_side_sink), so rollouts and the
// evaluation share the engines and one completion stream. The controller calls run() between
// steps, when no weight update can come (every eval sample is of one weight version), with the
// engines awake (hybrid jobs wake them first).
//
// An engine that leaves the job during an evaluation (standalone engines: it died, stalled, or was
// drained) has its requests sent again, whole and with their seeds, to the others; the samples
// already back stay and their repeats are dropped.
//
// Threading: the controller's thread.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "controller/engine_set.h"
#include "controller/job_rewards.h"
#include "tiller/core/clock.h"
#include "tiller/core/config.h"
#include "tiller/data/prompt_dataset.h"

namespace tiller::text {
class Tokenizer;
}  // namespace tiller::text

namespace tiller::controller {

class Evaluator {
 public:
  // Request ids of evaluation: above the collector's (ordinals, and its own from 2^62).
  static constexpr uint64_t kRequestBase = uint64_t{3} << 62;

  // Loads eval.prompts with data.*'s keys and templates (ConfigError naming the file and line).
  // `stop_ids` end a completion; `decode` gives a response's text (special tokens skipped).
  Evaluator(const JobConfig& cfg, const text::Tokenizer& tok, EngineSet& engines, std::vector<int64_t> stop_ids,
            const Clock& clock = Clock::steady());
  ~Evaluator();

  // Whether to evaluate after `step` completed steps (0: the starting weights); `last`: the run's last.
  bool due(int64_t step, bool last) const;

  // Evaluates the engines' weights at `version`: sends every request (at most engines.max_num_seqs
  // samples in flight an engine), calls `pump` until every sample is back and scored, writes the
  // samples file and returns the metrics (eval/...). TimeoutError when an engine returns no eval
  // sample for timeouts.generate_s; an engine's refusal or a reward's failure ends the job.
  std::vector<std::pair<std::string, double>> run(int64_t step, uint64_t version, const std::function<void()>& pump);

  // A completion of an evaluation request (from the collector's pump).
  void take(Completion& c);

  int64_t prompts() const;

 private:
  struct Sample {
    double reward = 0;
    int64_t tokens = 0;
    std::string finish_reason;
    std::vector<int64_t> ids;
  };
  struct Request;
  void send_more();
  bool usable(size_t e) const;
  size_t least_busy() const;  // in_flight_.size() when no engine is usable
  size_t retired_count() const { return engines_.size() - engines_.live_count(); }
  // Sends the requests of engines that left the job (or drain) to the others; the samples already
  // back stay. CommError when no engine is left.
  void move_off();
  void move(Request& r);  // to the least busy usable engine
  // Sends r (r.owed samples) to engine e; an engine whose stream broke is retired, when the set
  // allows it (false: move_off() sends the request on), else CommError.
  bool submit(size_t e, const Request& r);
  // An engine with samples in flight that returned none for timeouts.generate_s is retired
  // (standalone engines) or ends the job (TimeoutError naming it).
  void check_progress(int64_t step);
  std::vector<std::pair<std::string, double>> metrics() const;
  void write_samples(int64_t step) const;
  std::string source_of(int64_t prompt) const;

  const JobConfig& cfg_;
  EngineSet& engines_;
  const Clock& clock_;
  std::unique_ptr<data::PromptDataset> data_;
  JobRewards rewards_;
  std::function<std::string(const std::vector<int64_t>&)> decode_;
  model::SamplingParams greedy_, sampled_;
  std::string file_source_;  // the file's name, for prompts without a data source

  // One evaluation's state.
  struct Request {
    int64_t prompt = 0;
    bool greedy = false;
    int engine = 0;
    int64_t owed = 0;           // samples its engine still sends (every one, after a move)
    engine::Request request;    // sent again, whole, when its engine leaves the job or drains
    std::vector<uint8_t> back;  // per sample: came back (a moved request's repeats are dropped)
  };
  std::vector<std::pair<int64_t, bool>> queue_;  // (prompt, greedy) to send, in order
  size_t next_ = 0;
  std::map<uint64_t, Request> live_;
  std::vector<int64_t> in_flight_;  // samples per engine
  std::vector<uint8_t> draining_;   // per engine: it refused a request as draining (this evaluation)
  size_t retired_seen_ = 0;         // engines retired at move_off()'s last look (only grows)
  uint64_t next_id_ = kRequestBase;
  uint64_t version_ = 0;  // the weights evaluated
  std::vector<Sample> greedy_samples_;                // per prompt
  std::vector<std::vector<Sample>> sampled_samples_;  // per prompt, k each
  std::vector<uint8_t> keep_;                         // per prompt: its samples go to the samples file
  int64_t returned_ = 0, expected_ = 0;
  std::vector<SteadyClock::time_point> progress_;  // per engine: its last sample, or its first in flight
  SteadyClock::time_point last_progress_;          // any engine's last sample (or a move)
};

}  // namespace tiller::controller
