// Python reward functions in-process: verl's signature and its variants, dict results and their
// extras, batched functions, one-line errors naming file, line and sample, load errors, the
// per-call deadline, and a shutdown that does not wait on a call stuck in C code.
#include <chrono>
#include <filesystem>
#include <map>

#include <gtest/gtest.h>

#include "../common/error_of.h"
#include "../model/fixtures.h"
#include "tiller/core/error.h"
#include "tiller/reward/python_reward.h"

namespace tiller::reward {
namespace {

#if TILLER_HAVE_PYTHON

std::string py_file(const std::string& name, const std::string& text) {
  const std::string dir = test::scratch_dir() + "/python_reward";
  std::filesystem::create_directories(dir);
  const std::string p = std::filesystem::canonical(dir).string() + "/" + name;
  test::write_text(p, text);
  return p;
}

RewardSample sample(uint64_t id, const std::string& response, const std::string& label = "",
                    const std::string& extra_info = "") {
  RewardSample s;
  s.id = id;
  s.prompt = "Q" + std::to_string(id);
  s.response = response;
  s.label = label;
  s.data_source = id % 2 == 0 ? "even" : "odd";
  s.extra_info = extra_info;
  s.finish_reason = id == 3 ? "length" : "stop";
  s.prompt_index = 10 + id;
  s.sample_index = static_cast<uint32_t>(id % 4);
  s.response_tokens = static_cast<int64_t>(response.size());
  return s;
}

std::map<uint64_t, double> run(BatchedReward& r, const std::vector<RewardSample>& samples, uint64_t step = 1) {
  r.begin_step(step);
  for (const auto& s : samples) r.add(s);
  std::map<uint64_t, double> out;
  for (auto [id, score] : r.finish(Deadline::after_seconds(60))) out[id] = score;
  return out;
}

std::shared_ptr<PythonScorer> scorer(const std::string& path, bool batched = false, double timeout = 60) {
  return std::make_shared<PythonScorer>(PythonOptions{path, batched, timeout});
}

// verl's signature, as its users write it; the test's own arithmetic is the reference.
TEST(PythonReward, VerlSignatureScoresEverySample) {
  const std::string p = py_file("verl_style.py", R"PY(
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    digits = sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
    bonus = 10.0 if data_source == "even" else 0.0
    if isinstance(ground_truth, list):      # a label that was JSON
        bonus += 100.0 * len(ground_truth)
    if extra_info is not None:
        bonus += extra_info["weight"]
    return digits + bonus
)PY");
  BatchedReward r(scorer(p), 3, 2);
  std::vector<RewardSample> samples;
  for (uint64_t i = 0; i < 7; ++i) samples.push_back(sample(i, std::string(i, '7') + "ab"));
  samples[5].label = "[1, 2, 3]";
  samples[5].label_is_json = true;
  samples[6].extra_info = R"({"weight": 0.5})";
  const auto got = run(r, samples);
  ASSERT_EQ(got.size(), 7u);
  for (uint64_t i = 0; i < 7; ++i) {
    double want = static_cast<double>(i) / static_cast<double>(i + 2) + (i % 2 == 0 ? 10.0 : 0.0);
    if (i == 5) want += 300.0;
    if (i == 6) want += 0.5;
    EXPECT_DOUBLE_EQ(got.at(i), want) << "sample " << i;
  }
  const RewardStats st = r.take_stats();
  EXPECT_EQ(st.calls, 3);  // 7 samples in batches of 3
}

TEST(PythonReward, OnlyTheNamedParametersArePassedAndDictsCarryExtras) {
  const std::string p = py_file("named.py", R"PY(
import json
def by_length(solution_str, finish_reason, response_tokens, prompt_str):
    return {"score": response_tokens + (0.5 if finish_reason == "length" else 0.0),
            "acc": 1.0 if prompt_str.startswith("Q") else 0.0, "note": "text is ignored"}
def anything(**kwargs):
    return float(sorted(kwargs) == ["data_source", "extra_info", "ground_truth", "solution_str"])
def numpy_scalar(solution_str):
    import numpy
    return numpy.float32(len(solution_str))
)PY");
  BatchedReward r(scorer(p + ":by_length"), 2, 1);
  const auto got = run(r, {sample(1, "abc"), sample(3, "abcdef")});
  EXPECT_DOUBLE_EQ(got.at(1), 3.0);
  EXPECT_DOUBLE_EQ(got.at(3), 6.5);
  const RewardStats st = r.take_stats();
  ASSERT_EQ(st.extras.count("acc"), 1u);
  EXPECT_DOUBLE_EQ(st.extras.at("acc").first, 2.0);
  EXPECT_EQ(st.extras.at("acc").second, 2);
  EXPECT_EQ(st.extras.count("note"), 0u);
  BatchedReward kw(scorer(p + ":anything"), 4, 1);
  EXPECT_DOUBLE_EQ(run(kw, {sample(1, "x")}).at(1), 1.0);
  BatchedReward np(scorer(p + ":numpy_scalar"), 4, 1);
  EXPECT_DOUBLE_EQ(run(np, {sample(1, "xyz")}).at(1), 3.0);
}

TEST(PythonReward, BatchedFunctionsTakeLists) {
  const std::string p = py_file("batched.py", R"PY(
def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
    assert len(data_sources) == len(solution_strs) == len(ground_truths) == len(extra_infos)
    return [{"score": float(s == g), "seen": len(solution_strs)} for s, g in zip(solution_strs, ground_truths)]
def wrong_length(solution_strs):
    return [1.0]
)PY");
  BatchedReward r(scorer(p, true), 4, 1);
  const auto got = run(r, {sample(0, "7", "7"), sample(1, "8", "7"), sample(2, "9", "9")});
  EXPECT_EQ(got, (std::map<uint64_t, double>{{0, 1.0}, {1, 0.0}, {2, 1.0}}));
  EXPECT_DOUBLE_EQ(r.take_stats().extras.at("seen").first, 9.0);
  BatchedReward bad(scorer(p + ":wrong_length", true), 4, 1);
  const std::string e = error_of([&] { run(bad, {sample(0, "a"), sample(1, "b")}); });
  EXPECT_NE(e.find("returned 1 results for 2 samples"), std::string::npos) << e;
}

// The message names the exception, the reward file's line, where it was raised, and the sample.
TEST(PythonReward, AnExceptionNamesFileLineAndSample) {
  const std::string p = py_file("raises.py", R"PY(
import json

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "boom":
        return 1 / 0
    if solution_str == "json":
        return json.loads("{")
    if solution_str == "text":
        return "0.5"
    if solution_str == "nan":
        return float("nan")
    return 1.0
)PY");
  BatchedReward r(scorer(p), 8, 1);
  std::string e = error_of([&] { run(r, {sample(0, "fine"), sample(1, "boom")}, 3); });
  EXPECT_NE(e.find("reward.python " + p + ":compute_score: ZeroDivisionError: division by zero at " + p +
                   ":6 (in compute_score), scoring sample 1 of prompt line 11 (step 3)"),
            std::string::npos)
      << e;
  e = error_of([&] { run(r, {sample(2, "json")}); });
  EXPECT_NE(e.find("JSONDecodeError"), std::string::npos) << e;
  EXPECT_NE(e.find(p + ":8 (in compute_score), raised at "), std::string::npos) << e;
  EXPECT_NE(e.find("json/decoder.py:"), std::string::npos) << e;
  e = error_of([&] { run(r, {sample(1, "text")}); });
  EXPECT_NE(e.find("returned str '0.5'; return a number or a dict with \"score\", scoring sample 1 of prompt line 11"),
            std::string::npos)
      << e;
  e = error_of([&] { run(r, {sample(2, "nan")}); });
  EXPECT_NE(e.find("answered nan for sample 2 of prompt line 12 (step 1); scores must be finite"), std::string::npos)
      << e;
  // The scorer keeps working after an error (the next step starts clean).
  EXPECT_DOUBLE_EQ(run(r, {sample(1, "fine")}).at(1), 1.0);
}

TEST(PythonReward, LoadErrorsNameTheFileAndWhatToDo) {
  const auto load_error = [](const std::string& spec) {
    return error_of([&] { PythonScorer s(PythonOptions{spec, false, 60}); });
  };
  const std::string syntax = py_file("syntax.py", "def compute_score(data_source, solution_str, ground_truth):\n  return (\n");
  EXPECT_NE(load_error(syntax).find(syntax + ":2: SyntaxError: '(' was never closed"), std::string::npos)
      << load_error(syntax);
  const std::string raises = py_file("raises_on_load.py", "import os\nos.environ['TILLER_NO_SUCH_VARIABLE']\n");
  EXPECT_NE(load_error(raises).find("KeyError: 'TILLER_NO_SUCH_VARIABLE' at " + raises + ":2 (in <module>)"),
            std::string::npos)
      << load_error(raises);
  const std::string two = py_file("two.py", "def score_a(solution_str): return 1\ndef score_b(solution_str): return 2\n");
  EXPECT_NE(load_error(two).find("has no function 'compute_score' (its functions: score_a, score_b)"),
            std::string::npos)
      << load_error(two);
  const std::string odd = py_file("odd.py", "def compute_score(solution_str, model):\n  return 1\n");
  EXPECT_NE(load_error(odd).find("compute_score() takes 'model', which tiller does not pass"), std::string::npos)
      << load_error(odd);
  EXPECT_NE(load_error(test::scratch_dir() + "/python_reward/none.py").find("none.py: no such file"), std::string::npos);
  EXPECT_NE(load_error("").find("reward.python is empty"), std::string::npos);
  // A sibling module of the reward file imports (its folder is on sys.path).
  py_file("reward_helpers.py", "def digits(s):\n  return sum(c.isdigit() for c in s)\n");
  const std::string uses = py_file("uses_helper.py",
                                   "from reward_helpers import digits\n"
                                   "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                   "  return digits(solution_str)\n");
  BatchedReward r(scorer(uses), 1, 1);
  EXPECT_DOUBLE_EQ(run(r, {sample(1, "a1b22")}).at(1), 3.0);
}

// The bundled examples load and score as their docstrings say.
TEST(PythonReward, TheExampleRewardFilesScore) {
  const std::string dir = std::string(TILLER_SOURCE_DIR) + "/examples/rewards/";
  BatchedReward toy(scorer(dir + "toy_digits.py"), 4, 1);
  const auto got = run(toy, {sample(0, "12ab"), sample(3, "7")});
  EXPECT_DOUBLE_EQ(got.at(0), 0.5);
  EXPECT_DOUBLE_EQ(got.at(3), 1.0);
  const RewardStats st = toy.take_stats();
  EXPECT_DOUBLE_EQ(st.extras.at("digits").first, 3.0);
  EXPECT_DOUBLE_EQ(st.extras.at("truncated").first, 1.0);  // sample 3 finished by length
  BatchedReward gsm(scorer(dir + "gsm8k.py"), 8, 1);
  const auto g = run(gsm, {sample(0, "so 2,000 + 18 = 2018\n#### 2,018", "Natalia... #### 2018"),
                           sample(1, "the answer is 17", "18"), sample(2, "I do not know", "18"),
                           sample(3, "maybe 3 then 18.", "18")});
  EXPECT_EQ(g, (std::map<uint64_t, double>{{0, 1.0}, {1, 0.1}, {2, 0.0}, {3, 1.0}}));
}

TEST(PythonReward, ACallPastItsDeadlineIsInterrupted) {
  const std::string p = py_file("slow.py", R"PY(
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    n = 0
    while solution_str == "spin":
        n += 1
    return 2.0
)PY");
  BatchedReward r(scorer(p, false, 0.3), 4, 1);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string e = error_of([&] { run(r, {sample(1, "ok"), sample(2, "spin")}); });
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
  EXPECT_NE(e.find("scoring sample 2 of prompt line 12 (step 1) ran past reward.python_timeout_s = 0.3 s and was "
                   "interrupted at " + p + ":"),
            std::string::npos)
      << e;
  // The worker and the interpreter are fine afterwards.
  EXPECT_DOUBLE_EQ(run(r, {sample(1, "ok")}).at(1), 2.0);
}

// A call blocked in C (time.sleep) cannot be interrupted: shutting down leaves it behind.
TEST(PythonReward, ShutdownDoesNotWaitForACallBlockedInC) {
  const std::string p = py_file("sleeps.py",
                                "import time\n"
                                "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                "  time.sleep(60)\n"
                                "  return 1.0\n");
  const auto t0 = std::chrono::steady_clock::now();
  {
    BatchedReward r(scorer(p), 1, 1);
    r.begin_step(1);
    r.add(sample(1, "x"));
    EXPECT_THROW(r.finish(Deadline::after_seconds(0.5)), TimeoutError);
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
}

#else

TEST(PythonReward, NeedsAnEmbeddedPython) {
  try {
    PythonScorer s(PythonOptions{"x.py:f", false, 60});
    FAIL() << "a build without Python loaded a Python reward";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("built without an embedded Python"), std::string::npos) << e.what();
  }
}

#endif

}  // namespace
}  // namespace tiller::reward
