// The openai_agent sample loop over an in-process channel: a Python harness (the embedded
// interpreter, as agent.harness runs it) talks to the synthetic engines through the loop's real
// HTTP endpoint, with token ids (the completions API's prompt_token_ids / return_token_ids), and
// writes down what it saw; the trained records must be exactly that.
#include "controller_job.h"

#include "tiller/controller/agent.h"
#include "tiller/text/chat_template.h"

namespace tiller::controller {
namespace {

// The harness: three turns of `max_tokens` 6 on token-id prompts, the ids 900 + turn and 950
// inserted after each turn; each turn's prompt, tokens and log-probs go to TRACE/<step>-<line>-
// <sample>.json with the reward it returns (the number of even ids it got, / 10). DRIFT: the
// second request changes the prompt's token 2 (retokenization drift). (The two are written into
// the file: the interpreter's os.environ is the process's at its start.)
constexpr const char* kHarness = R"PY(
import json, os, urllib.request

def post(base_url, api_key, path, body):
    req = urllib.request.Request(base_url + path, data=json.dumps(body).encode(),
                                 headers={'Authorization': 'Bearer ' + api_key, 'Content-Type': 'application/json'})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())

def run(base_url, api_key, model, sample, step, prompt_line, prompt):
    ids = [100 + sample, 101, 102, 103]
    turns, even = [], 0
    for k in range(3):
        sent = list(ids)
        if DRIFT and k == 1:
            sent[2] += 1
        r = post(base_url, api_key, '/completions', {'model': model, 'prompt': sent, 'max_tokens': 6,
                                                     'logprobs': 0, 'return_token_ids': True})
        c = r['choices'][0]
        assert c['prompt_token_ids'] == sent, (c['prompt_token_ids'], sent)
        out = c['token_ids']
        turns.append({'prompt': sent, 'tokens': out, 'logprobs': c['logprobs']['token_logprobs']})
        even += sum(1 for t in out if t % 2 == 0)
        ids = sent + out + [900 + k, 950]
    # The endpoint refuses what an agent session cannot take.
    try:
        post(base_url, 'wrong', '/completions', {'model': model, 'prompt': ids, 'max_tokens': 2})
        raise AssertionError('a wrong key was served')
    except urllib.error.HTTPError as e:
        assert e.code == 401, e.code
    reward = even / 10
    with open(os.path.join(TRACE, f'{step}-{prompt_line}-{sample}.json'), 'w') as f:
        json.dump({'turns': turns, 'reward': reward, 'prompt': prompt}, f)
    return {'score': reward}
)PY";

struct AgentJob : Job {
  std::string trace;
  std::shared_ptr<text::Tokenizer> tok;
  // `command`: the harness runs as agent.command (python3 running the same function) instead.
  explicit AgentJob(const std::string& name, bool drift = false, bool command = false) : Job(name) {
    cfg.rollout.loop = "openai_agent";
    cfg.rollout.max_turns = 3;
    cfg.rollout.max_new_tokens = 12;
    cfg.rollout.max_response_tokens = 40;
    cfg.logging.rollout_records_tokens = true;
    cfg.agent.concurrency = 8;
    cfg.agent.timeout_s = 60;
    cfg.train.num_steps = 2;
    trace = out + "/trace";
    fs::create_directories(trace);
    const std::string harness = out + "/harness.py";
    std::ofstream(harness) << "TRACE = " << json(trace).dump() << "\nDRIFT = " << (drift ? "True" : "False") << "\n"
                           << kHarness;
    cfg.agent.harness = harness + ":run";
    if (command) {
      // The command's environment carries the sample (OPENAI_BASE_URL, TILLER_AGENT_*); it prints the reward.
      std::ofstream(harness, std::ios::app)
          << "\nif __name__ == '__main__':\n"
          << "    e = os.environ\n"
          << "    r = run(e['OPENAI_BASE_URL'], e['OPENAI_API_KEY'], e['TILLER_AGENT_MODEL'], int(e['TILLER_AGENT_SAMPLE']),\n"
          << "            int(e['TILLER_AGENT_STEP']), int(e['TILLER_AGENT_PROMPT_LINE']),\n"
          << "            e['TILLER_AGENT_PROMPT'])\n"
          << "    print('some output first')\n"
          << "    print(json.dumps(r))\n";
      cfg.agent.harness = "command";
      cfg.agent.command = std::string(TILLER_TEST_PYTHON_INTERPRETER) + " " + harness;
    }
    const std::string fixtures = TILLER_HF_FIXTURES;
    tok = std::shared_ptr<text::Tokenizer>(text::load_tokenizer(fixtures + "/tokenizers/qwen2").release());
    loop.tokenizer = tok;
    loop.chat = std::make_shared<const text::ChatTemplate>(
        text::job_chat_template(cfg.data, fixtures + "/models/qwen2-chat", *tok));
    loop.decode = [](const std::vector<int64_t>& ids) { return std::to_string(ids.size()) + " ids"; };
  }
  json seen(const json& record) const {
    std::ifstream in(fmt::format("{}/{}-{}-{}.json", trace, record["step"].get<int64_t>(),
                                 record["prompt_line"].get<int64_t>(), record["sample"].get<int64_t>()));
    return json::parse(in);
  }
};

#if TILLER_HAVE_PYTHON
#define SKIP_WITHOUT_PYTHON()
#else
#define SKIP_WITHOUT_PYTHON() GTEST_SKIP() << "this build has no embedded Python"
#endif

// Every trained sample is the harness's conversation as the engine produced it: the first prompt,
// then each turn's tokens and log-probs (loss mask 1) and the harness's inserted ids between them
// (mask 0, log-prob 0); its turns end where the model's did, the last carries the harness's reward,
// and the ids after the last turn are not in it.
void expect_conversations(AgentJob& job) {
  const json summary = json::parse(job.run());
  EXPECT_EQ(summary["steps"], 2);
  const auto recs = job.records();
  ASSERT_EQ(recs.size(), 2u * 4 * 2);
  for (const auto& r : recs) {
    const json seen = job.seen(r);
    const auto& turns = seen["turns"];
    // The harness's prompt is the record's before the chat template (it makes its own messages).
    EXPECT_EQ(seen["prompt"], fmt::format("prompt {}", r["prompt_line"].get<int64_t>() - 1));
    ASSERT_EQ(turns.size(), 3u);
    std::vector<int64_t> ids, mask;
    std::vector<float> logprobs;
    std::vector<int64_t> ends;
    for (size_t k = 0; k < turns.size(); ++k) {
      if (k > 0) {  // the harness's ids since the previous turn
        const auto prev = turns[k - 1]["prompt"].get<std::vector<int64_t>>().size() + turns[k - 1]["tokens"].size();
        const auto prompt = turns[k]["prompt"].get<std::vector<int64_t>>();
        for (size_t i = prev; i < prompt.size(); ++i) {
          ids.push_back(prompt[i]);
          mask.push_back(0);
          logprobs.push_back(0.f);
        }
      }
      for (size_t i = 0; i < turns[k]["tokens"].size(); ++i) {
        ids.push_back(turns[k]["tokens"][i].get<int64_t>());
        mask.push_back(1);
        logprobs.push_back(turns[k]["logprobs"][i].get<float>());
      }
      ends.push_back(static_cast<int64_t>(ids.size()) - 1);
    }
    EXPECT_EQ(r["prompt_ids"].get<std::vector<int64_t>>(), turns[0]["prompt"].get<std::vector<int64_t>>());
    EXPECT_EQ(r["response_ids"].get<std::vector<int64_t>>(), ids) << r.dump();
    EXPECT_EQ(r["loss_mask"].get<std::vector<int64_t>>(), mask);
    const auto got = r["engine_logprobs"].get<std::vector<float>>();
    ASSERT_EQ(got.size(), logprobs.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_FLOAT_EQ(got[i], logprobs[i]) << "token " << i;
    ASSERT_EQ(r["turns"].size(), 3u);
    for (size_t k = 0; k < 3; ++k) {
      EXPECT_EQ(r["turns"][k][0].get<int64_t>(), ends[k]);
      EXPECT_FLOAT_EQ(r["turns"][k][1].get<float>(), k == 2 ? seen["reward"].get<float>() : 0.f);
    }
  }
  const auto metrics = job.lines("metrics.jsonl");
  for (const auto& m : metrics) {
    EXPECT_EQ(m["agent/drifts"].get<double>(), 0);
    EXPECT_EQ(m["env/calls"].get<double>(), 4 * 2 * 3);  // three answered requests a sample
    EXPECT_GT(m["env/session_prefix_tokens"].get<double>(), 0);  // turns 2 and 3 resumed the cache
  }
}

TEST(AgentLoop, SamplesAreTheHarnesssConversationsTokenForToken) {
  SKIP_WITHOUT_PYTHON();
  AgentJob job("agent_loop");
  expect_conversations(job);
}

// agent.harness command: the same harness as a process per sample, its reward the last line it
// printed; a command that fails ends the job with its output, naming the sample.
TEST(AgentLoop, ACommandHarnessRunsForEachSample) {
  AgentJob job("agent_command", false, true);
  expect_conversations(job);
  AgentJob bad("agent_command_fails", false, true);
  bad.cfg.agent.command = "echo the agent broke; exit 3";
  std::string error;
  bad.run({}, &error);
  EXPECT_NE(error.find("agent.command 'echo the agent broke; exit 3' exited with code 3; its last output: the agent "
                       "broke (prompt line"),
            std::string::npos)
      << error;
}

// A request that does not extend the sample's tokens: `error` ends the job naming the sample and
// the token; `split` goes on from the drifted prompt as a new segment (the first turn is not in the
// sample); `drop` trains none of the sample.
TEST(AgentLoop, RetokenizationDriftIsHandledByEachPolicy) {
  SKIP_WITHOUT_PYTHON();
  {
    AgentJob job("agent_drift_error", true);
    job.cfg.agent.drift = AgentDrift::kError;
    std::string error;
    job.run({}, &error);
    EXPECT_NE(error.find("request 2 of the agent harness does not extend the sample's tokens: it differs at token 2"),
              std::string::npos)
        << error;
    EXPECT_NE(error.find("prompt line"), std::string::npos) << error;
  }
  {
    AgentJob job("agent_drift_split", true);
    job.cfg.agent.drift = AgentDrift::kSplit;
    ::testing::internal::CaptureStderr();
    job.run();
    const std::string log = ::testing::internal::GetCapturedStderr();
    // The job's first drift is a warning, with its place; the other 15 go to debug.
    const std::string warned = "agent.drift = split goes on";
    const size_t at = log.find(warned);
    EXPECT_NE(at, std::string::npos) << log;
    EXPECT_EQ(log.find(warned, at + 1), std::string::npos) << log;
    EXPECT_NE(log.find("does not extend the sample's tokens: it differs at token 2"), std::string::npos) << log;
    const auto recs = job.records();
    ASSERT_EQ(recs.size(), 2u * 4 * 2);
    for (const auto& r : recs) {
      const json seen = job.seen(r);
      // The sample is the segment from the second request on: its prompt is that request's.
      EXPECT_EQ(r["prompt_ids"].get<std::vector<int64_t>>(), seen["turns"][1]["prompt"].get<std::vector<int64_t>>());
      const auto n1 = seen["turns"][1]["tokens"].size(), n2 = seen["turns"][2]["tokens"].size();
      EXPECT_EQ(r["response_ids"].size(), n1 + 2 + n2);
      ASSERT_EQ(r["turns"].size(), 2u);
    }
    for (const auto& m : job.lines("metrics.jsonl")) EXPECT_EQ(m["agent/drifts"].get<double>(), 4 * 2);
  }
  {
    AgentJob job("agent_drift_drop", true);
    job.cfg.agent.drift = AgentDrift::kDrop;
    job.run();
    const auto recs = job.records();
    ASSERT_EQ(recs.size(), 2u * 4 * 2);
    for (const auto& r : recs) {
      const json seen = job.seen(r);
      EXPECT_EQ(r["prompt_ids"].get<std::vector<int64_t>>(), seen["turns"][0]["prompt"].get<std::vector<int64_t>>());
      EXPECT_EQ(r["response_ids"].size(), seen["turns"][0]["tokens"].size());  // what came before the drift
      for (int v : r["loss_mask"].get<std::vector<int>>()) EXPECT_EQ(v, 0);
      EXPECT_EQ(r["model_tokens"].get<int64_t>(), 0);
    }
  }
}

// The configuration's refusals.
TEST(AgentLoop, ConfigRefusals) {
  JobConfig c;
  c.roles.actor.model = "m";
  c.rollout.loop = "openai_agent";
  EXPECT_NE(error_of([&] { c.validate(); }).find("needs agent.harness"), std::string::npos);
  c.agent.harness = "h.py:run";
  c.env.type = EnvType::kInprocess;
  c.env.name = "x";
  EXPECT_NE(error_of([&] { c.validate(); }).find("env.type = none"), std::string::npos);
  c.env.type = EnvType::kNone;
  c.rollout.loop = "";
  EXPECT_NE(error_of([&] { c.validate(); }).find("set rollout.loop = openai_agent"), std::string::npos);
  c.rollout.loop = "openai_agent";
  c.agent.command = "run.sh";
  EXPECT_NE(error_of([&] { c.validate(); }).find("set agent.harness = command"), std::string::npos);
  c.agent.command = "";
  c.agent.harness = "command";
  EXPECT_NE(error_of([&] { make_agent_harness(c); }).find("needs agent.command"), std::string::npos);
  c.agent.harness = "nope";
  EXPECT_NE(error_of([&] { make_agent_harness(c); }).find("agent.harness = 'nope': not a registered agent harness"),
            std::string::npos);
#if TILLER_HAVE_PYTHON
  // A Python harness's load errors name the file and what to do.
  const std::string dir = scratch("agent_load_errors");
  std::ofstream(dir + "/h.py") << "def other():\n    pass\n\ndef needs(base_url, secret):\n    pass\n";
  c.agent.harness = dir + "/h.py:run";
  EXPECT_NE(error_of([&] { make_agent_harness(c); }).find("the file has no function 'run' (its functions: needs, other)"),
            std::string::npos)
      << error_of([&] { make_agent_harness(c); });
  c.agent.harness = dir + "/h.py:needs";
  EXPECT_NE(error_of([&] { make_agent_harness(c); }).find("needs() takes 'secret', which tiller does not pass"),
            std::string::npos);
  c.agent.harness = dir + "/missing.py:run";
  EXPECT_NE(error_of([&] { make_agent_harness(c); }).find("missing.py:run: no such file"), std::string::npos);
#endif
}

}  // namespace
}  // namespace tiller::controller
