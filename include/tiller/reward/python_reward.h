// Reward functions written in Python, run in-process by the embedded interpreter, as the scorer
// of a BatchedReward (batched_reward.h): `reward.type: python`, `reward.python: FILE.py:FUNCTION`.
//
// The file is loaded once, as a module of its own (its directory goes first on sys.path, so it
// may import its neighbours). The function is called with verl's keywords, so existing verl
// reward files work as they are:
//   compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict
// Only the parameters the function names are passed (a function that takes **kwargs gets the four
// above); it may also name `prompt_str`, `finish_reason` ("stop" | "length") and `response_tokens`.
// `ground_truth` is the dataset's label: a str, or the JSON value (number, list, dict) when the
// label is not a string; `extra_info` the dataset's data.extra_info_key value (None when absent).
// A dict result must hold "score"; its other numeric entries are averaged into the metrics as
// reward/extra/<name> (verl's reward_extra_info).
//
// With `batched` (reward.python_batched), the function takes lists and returns one list (verl's
// batch reward manager): fn(data_sources, solution_strs, ground_truths, extra_infos) -> [float|dict].
//
// Errors are one line. Loading: ConfigError naming the file and line (a syntax error, an exception
// while the module runs), a missing function, or a parameter tiller cannot pass. Scoring: an
// exception names the exception, the file and line in the reward file where it passed (and where
// it was raised, when that is elsewhere), the sample (prompt line, sample index) and the step; a
// result that is not a number or a dict with "score" is an error too.
//
// Deadline: a call that runs past `timeout_seconds` is interrupted by raising TimeoutError inside
// it (Python code stops at its next bytecode; code blocked in C stops when it returns to Python),
// and the job ends with a TimeoutError naming the limit.
//
// Threading: the BatchedReward's workers call score() at once; each holds the GIL while Python
// runs, so pure-Python functions score one batch at a time (functions that release the GIL, or
// wait on I/O, overlap). Several PythonScorers share the process's one interpreter.
#pragma once

#include <memory>
#include <string>

#include "tiller/reward/batched_reward.h"

namespace tiller::reward {

struct PythonOptions {
  std::string spec;               // "path/to/file.py:function" (":compute_score" may be left out)
  bool batched = false;           // one call per batch, with lists
  double timeout_seconds = 300;   // deadline of one call (a sample, or a batch when batched)
};

class PythonScorer final : public BatchScorer {
 public:
  // Starts the interpreter and loads the function (ConfigError as above).
  explicit PythonScorer(const PythonOptions& opts);
  ~PythonScorer() override;

  BatchScores score(uint64_t step, const std::vector<RewardSample>& samples) override;
  std::string kind() const override { return "python"; }
  std::string where() const override;
  // "CPython 3.11.7 at /usr/bin/python3", for the log.
  std::string interpreter() const;

 private:
  void on_cancel() override;
  struct Impl;
  std::shared_ptr<Impl> impl_;  // shared with the watchdog thread
};

}  // namespace tiller::reward
