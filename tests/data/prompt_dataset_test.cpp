// The prompt dataset: templates, labels, malformed lines, the long-prompt policies, shuffled
// epochs and resuming from a cursor. Tokenizer: the Qwen2 fixture (make_hf_fixtures.py).
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "../common/error_of.h"
#include "../model/fixtures.h"
#include "tiller/controller/prompt_source.h"
#include "tiller/core/error.h"
#include "tiller/data/prompt_dataset.h"
#include "tiller/text/tokenizer.h"

namespace tiller::data {
namespace {

const text::Tokenizer& tokenizer() {
  static auto t = text::load_tokenizer(test::hf_fixtures() + "/tokenizers/qwen2");
  return *t;
}

std::string file(const std::string& name, const std::string& text) {
  std::filesystem::create_directories(test::scratch_dir() + "/rollout");
  const std::string p = test::scratch_dir() + "/rollout/" + name;
  test::write_text(p, text);
  return p;
}

std::string error_of(const std::string& path, DatasetOptions o = {}) {
  try {
    PromptDataset d(path, tokenizer(), o);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

#if TILLER_HAVE_PYTHON
// Prompts through the model's own Jinja template (Qwen2.5's, make_chat_templates.py): a row's
// messages with their tool calls and its tools list give transformers' text, key order and all;
// a template's exception names the row; tools without a template are refused.
TEST(PromptDataset, RowsThroughTheModelsJinjaTemplate) {
  const std::string dir = test::hf_fixtures() + "/chat_templates/qwen2.5";
  auto tok = text::load_tokenizer(dir);
  const auto ref = nlohmann::ordered_json::parse(test::read_text(test::hf_fixtures() + "/chat_templates/reference.json"));
  std::string rows, gemma_rows;
  std::vector<std::string> want;
  for (const auto& c : ref["qwen2.5"]["cases"]) {
    if (!c["add_generation_prompt"].get<bool>()) continue;
    nlohmann::ordered_json row = {{"prompt", c["messages"]}, {"tools", c["tools"]}};
    rows += row.dump() + "\n";
    want.push_back(c["text"].get<std::string>());
  }
  DatasetOptions o;
  o.input_key = "prompt";
  o.chat = text::load_chat_template("auto", dir, *tok);
  o.shuffle = false;
  o.max_prompt_tokens = 4096;
  PromptDataset d(file("jinja.jsonl", rows), *tok, o);
  ASSERT_EQ(d.size(), static_cast<int64_t>(want.size()));
  for (int64_t i = 0; i < d.size(); ++i) {
    EXPECT_EQ(d.at(i).text, want[static_cast<size_t>(i)]) << "row " << i + 1;
    EXPECT_EQ(d.at(i).tokens, tok->encode(want[static_cast<size_t>(i)]));
  }
  // Gemma's template refuses a system message: the row is named.
  const std::string gdir = test::hf_fixtures() + "/chat_templates/gemma";
  auto gtok = text::load_tokenizer(gdir);
  o.chat = text::load_chat_template("auto", gdir, *gtok);
  const std::string bad = file("gemma.jsonl", R"({"prompt": [{"role": "user", "content": "a"}]})" "\n"
                                               R"({"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]})" "\n");
  try {
    PromptDataset g(bad, *gtok, o);
    FAIL() << "the template's exception";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("gemma.jsonl:2: "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("System role not supported"), std::string::npos) << e.what();
  }
  o.chat = text::ChatTemplate();
  EXPECT_NE(error_of(file("tools.jsonl", R"({"prompt": "a", "tools": []})" "\n"), o).find("set data.apply_chat_template"),
            std::string::npos);
}
#endif

TEST(PromptDataset, TemplatesLabelsAndBlankLines) {
  const std::string p = file("basic.jsonl",
                             "{\"question\": \"What is 2+2?\", \"answer\": \"4\"}\n"
                             "{\"question\": \"x\", \"answer\": 7}\n"
                             "\n"
                             "{\"question\": \"y\"}\n");
  DatasetOptions o;
  o.input_key = "question";
  o.label_key = "answer";
  o.input_template = "Q: {}\nA:";
  o.chat = text::ChatFormat::kChatML;
  o.shuffle = false;
  PromptDataset d(p, tokenizer(), o);
  ASSERT_EQ(d.size(), 3);
  const std::string want = text::apply_chat_template(text::ChatFormat::kChatML, {{"user", "Q: What is 2+2?\nA:"}});
  EXPECT_EQ(d.at(0).text, want);
  EXPECT_EQ(d.at(0).input, "Q: What is 2+2?\nA:");  // before the chat template (an agent harness's prompt)
  EXPECT_EQ(d.at(0).tokens, tokenizer().encode(want, false));
  EXPECT_EQ(d.at(0).label, "4");
  EXPECT_EQ(d.at(1).label, "7");
  EXPECT_EQ(d.at(2).label, "");
  EXPECT_EQ(d.at(2).line, 4);
  o.max_samples = 2;
  EXPECT_EQ(PromptDataset(p, tokenizer(), o).size(), 2);
}

TEST(PromptDataset, MalformedLinesNameTheFileAndLine) {
  const std::string p1 = file("bad1.jsonl", "{\"input\": \"ok\"}\n{\"input\": \"ok\"\n");
  EXPECT_NE(error_of(p1).find("bad1.jsonl:2: not valid JSON"), std::string::npos) << error_of(p1);
  const std::string p2 = file("bad2.jsonl", "[1, 2]\n");
  EXPECT_NE(error_of(p2).find("bad2.jsonl:1: not a JSON object"), std::string::npos) << error_of(p2);
  const std::string p3 = file("bad3.jsonl", "{\"prompt\": \"hi\"}\n");
  EXPECT_NE(error_of(p3).find("bad3.jsonl:1: no text or list of chat messages under the input key 'input'"),
            std::string::npos);
  const std::string p4 = file("bad4.jsonl", "{\"input\": [{\"role\": \"user\"}]}\n");
  EXPECT_NE(error_of(p4).find("bad4.jsonl:1: the messages under 'input' must be objects with string"),
            std::string::npos) << error_of(p4);
  const std::string p5 = file("bad5.jsonl", "{\"input\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n");
  EXPECT_NE(error_of(p5).find("bad5.jsonl:1: the prompt under 'input' is a list of chat messages; set "
                              "data.apply_chat_template: true"),
            std::string::npos) << error_of(p5);
  EXPECT_NE(error_of(test::scratch_dir() + "/rollout/none.jsonl").find("cannot open the prompt file"),
            std::string::npos);
}

// verl's record shape: chat messages, a nested label, a data source, extra information; labels
// that are not text keep their JSON.
TEST(PromptDataset, NestedKeysChatMessagesAndJsonLabels) {
  const std::string p = file("verl.jsonl",
                             R"({"data_source": "gsm8k", "prompt": [{"role": "system", "content": "Be brief."}, )"
                             R"({"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4"}, )"
                             R"("extra_info": {"index": 7, "split": "train"}})" "\n"
                             R"({"data_source": "mix", "prompt": [{"role": "user", "content": "x"}], )"
                             R"("reward_model": {"ground_truth": [1, 2]}, "reward_model.ground_truth": 5})" "\n");
  DatasetOptions o;
  o.input_key = "prompt";
  o.label_key = "reward_model.ground_truth";
  o.chat = text::ChatFormat::kChatML;
  o.shuffle = false;
  PromptDataset d(p, tokenizer(), o);
  ASSERT_EQ(d.size(), 2);
  EXPECT_EQ(d.at(0).text, text::apply_chat_template(text::ChatFormat::kChatML,
                                                     {{"system", "Be brief."}, {"user", "2+2?"}}));
  EXPECT_EQ(nlohmann::json::parse(d.at(0).input),
            nlohmann::json::parse(R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}])"));
  EXPECT_EQ(d.at(0).label, "4");
  EXPECT_FALSE(d.at(0).label_is_json);
  EXPECT_EQ(d.at(0).data_source, "gsm8k");
  EXPECT_EQ(nlohmann::json::parse(d.at(0).extra_info), nlohmann::json::parse(R"({"index": 7, "split": "train"})"));
  // A key that exists as written wins over the dotted path.
  EXPECT_EQ(d.at(1).label, "5");
  EXPECT_TRUE(d.at(1).label_is_json);
  EXPECT_EQ(d.at(1).extra_info, "");
  o.label_key = "reward_model";
  EXPECT_EQ(PromptDataset(p, tokenizer(), o).at(1).label, R"({"ground_truth":[1,2]})");
}

#if TILLER_HAVE_PYTHON
// The parquet twin of a JSONL file (written by pyarrow from the same records) gives the same
// prompts, labels, data sources and extra information.
TEST(PromptDataset, AParquetFileGivesTheSamePromptsAsItsJsonlTwin) {
  const std::string jsonl = file("twin.jsonl",
                                 R"({"data_source": "a", "prompt": [{"role": "user", "content": "What is 3*4?"}], )"
                                 R"("reward_model": {"ground_truth": "12", "style": "rule"}, "extra_info": {"index": 0}})" "\n"
                                 R"({"data_source": "b", "prompt": [{"role": "user", "content": "Ünïcode ✓ 5-1?"}], )"
                                 R"("reward_model": {"ground_truth": "4", "style": "rule"}, "extra_info": {"index": 1}})" "\n"
                                 R"({"data_source": "a", "prompt": [{"role": "system", "content": "s"}, )"
                                 R"({"role": "user", "content": "7+8?"}], "reward_model": {"ground_truth": "15", )"
                                 R"("style": "rule"}, "extra_info": {"index": 2}})" "\n");
  const std::string parquet = test::scratch_dir() + "/rollout/twin.parquet";
  const std::string cmd = std::string(TILLER_TEST_PYTHON) +
                          " -c \"import sys, json, pyarrow as pa, pyarrow.parquet as pq; "
                          "rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]; "
                          "pq.write_table(pa.Table.from_pylist(rows), sys.argv[2])\" " + jsonl + " " + parquet;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  DatasetOptions o;
  o.input_key = "prompt";
  o.label_key = "reward_model.ground_truth";
  o.chat = text::ChatFormat::kChatML;
  o.shuffle = false;
  PromptDataset a(jsonl, tokenizer(), o), b(parquet, tokenizer(), o);
  ASSERT_EQ(a.size(), 3);
  ASSERT_EQ(b.size(), a.size());
  for (int64_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(b.at(i).line, a.at(i).line);
    EXPECT_EQ(b.at(i).text, a.at(i).text);
    EXPECT_EQ(b.at(i).tokens, a.at(i).tokens);
    EXPECT_EQ(b.at(i).label, a.at(i).label);
    EXPECT_EQ(b.at(i).data_source, a.at(i).data_source);
    EXPECT_EQ(nlohmann::json::parse(b.at(i).extra_info), nlohmann::json::parse(a.at(i).extra_info));
  }
  o.input_key = "question";
  const std::string e = error_of(parquet, o);
  EXPECT_NE(e.find("twin.parquet: row 1: no text or list of chat messages under the input key 'question'"),
            std::string::npos) << e;
  const std::string not_parquet = file("text.parquet", "this is not parquet\n");
  EXPECT_NE(error_of(not_parquet, o).find("text.parquet: cannot read the parquet file: "), std::string::npos)
      << error_of(not_parquet, o);
}
#endif

TEST(PromptDataset, LongPromptPolicies) {
  const std::string long_text = "one two three four five six seven eight nine ten eleven twelve";
  const std::string p = file("long.jsonl", "{\"input\": \"short\"}\n{\"input\": \"" + long_text + "\"}\n");
  const auto full = tokenizer().encode(long_text, false);
  ASSERT_GT(full.size(), 6u);
  DatasetOptions o;
  o.max_prompt_tokens = 6;
  o.shuffle = false;
  PromptDataset skip(p, tokenizer(), o);
  EXPECT_EQ(skip.size(), 1);
  EXPECT_EQ(skip.skipped(), 1);
  o.long_prompts = LongPromptPolicy::kTruncateLeft;
  PromptDataset cut(p, tokenizer(), o);
  ASSERT_EQ(cut.size(), 2);
  EXPECT_EQ(cut.truncated(), 1);
  EXPECT_EQ(cut.at(1).tokens, std::vector<int64_t>(full.end() - 6, full.end()));
  o.long_prompts = LongPromptPolicy::kError;
  EXPECT_NE(error_of(p, o).find("long.jsonl:2: the prompt has"), std::string::npos) << error_of(p, o);
  o.max_prompt_tokens = 1;
  o.long_prompts = LongPromptPolicy::kSkip;
  EXPECT_NE(error_of(p, o).find("no prompt left"), std::string::npos) << error_of(p, o);
  EXPECT_EQ(parse_enum<LongPromptPolicy>("truncate_left"), LongPromptPolicy::kTruncateLeft);
  EXPECT_FALSE(parse_enum<LongPromptPolicy>("drop").has_value());
}

// The real tokenizer, counting the bytes it is asked to encode.
class CountingTokenizer final : public text::Tokenizer {
 public:
  explicit CountingTokenizer(const text::Tokenizer& t) : t_(t) {}
  std::vector<int64_t> encode(const std::string& text, bool special) const override {
    encoded_bytes += static_cast<int64_t>(text.size());
    return t_.encode(text, special);
  }
  std::string decode(const std::vector<int64_t>& ids, bool skip) const override { return t_.decode(ids, skip); }
  int64_t vocab_size() const override { return t_.vocab_size(); }
  std::optional<int64_t> token_to_id(const std::string& s) const override { return t_.token_to_id(s); }
  std::string id_to_token(int64_t id) const override { return t_.id_to_token(id); }
  bool is_special(int64_t id) const override { return t_.is_special(id); }
  int64_t max_bytes_per_token() const override { return t_.max_bytes_per_token(); }
  mutable int64_t encoded_bytes = 0;

 private:
  const text::Tokenizer& t_;
};

// One huge line used to stall start-up for hours in the tokenizer before the policy applied: the
// skip and error policies now refuse a prompt too long in bytes without encoding it, and the
// decision is the one the token count would have made.
TEST(PromptDataset, AHugePromptIsRefusedBeforeItIsEncoded) {
  const int64_t per_token = tokenizer().max_bytes_per_token();
  ASSERT_GT(per_token, 0);
  std::string huge;
  for (int i = 0; huge.size() < 4'000'000; ++i) huge += "word" + std::to_string(i % 97) + " ";
  const std::string p = file("huge.jsonl", "{\"input\": \"short\"}\n{\"input\": \"" + huge + "\"}\n");
  CountingTokenizer counting(tokenizer());
  DatasetOptions o;
  o.max_prompt_tokens = 64;
  o.shuffle = false;
  PromptDataset skip(p, counting, o);
  EXPECT_EQ(skip.size(), 1);
  EXPECT_EQ(skip.skipped(), 1);
  EXPECT_LT(counting.encoded_bytes, 100);
  o.long_prompts = LongPromptPolicy::kError;
  const std::string err = error_of(p, o);
  EXPECT_NE(err.find("huge.jsonl:2: the prompt has 4000"), std::string::npos) << err;
  EXPECT_NE(err.find("over what max_prompt_tokens 64 can hold"), std::string::npos) << err;
  // Just under the byte bound the prompt is encoded, and the token count decides.
  const std::string at_bound(static_cast<size_t>(64 * per_token), 'a');
  const std::string q = file("bound.jsonl", "{\"input\": \"" + at_bound + "\"}\n{\"input\": \"short\"}\n");
  counting.encoded_bytes = 0;
  o.long_prompts = LongPromptPolicy::kSkip;
  PromptDataset near(q, counting, o);
  EXPECT_GE(counting.encoded_bytes, 64 * per_token);
  EXPECT_EQ(near.size() + near.skipped(), 2);
}

TEST(PromptDataset, APathThatIsNotAFileIsNamed) {
  std::filesystem::create_directories(test::scratch_dir() + "/rollout/prompts_dir");
  EXPECT_EQ(error_of(test::scratch_dir() + "/rollout/prompts_dir"),
            test::scratch_dir() + "/rollout/prompts_dir: is a directory, not the prompt file; set "
                                  "data.prompts to a JSONL or parquet file");
  EXPECT_NE(error_of(test::scratch_dir() + "/rollout/nope.jsonl").find("nope.jsonl: cannot open the prompt file: No such"),
            std::string::npos);
}

TEST(PromptDataset, ShuffledEpochsResumeFromTheCursor) {
  std::string text;
  for (int i = 0; i < 20; ++i) text += "{\"input\": \"prompt " + std::to_string(i) + "\"}\n";
  const std::string p = file("order.jsonl", text);
  DatasetOptions o;
  o.seed = 7;
  PromptDataset a(p, tokenizer(), o);
  const auto first = a.next(20), second = a.next(20);
  EXPECT_EQ(std::set<int64_t>(first.begin(), first.end()).size(), 20u);   // an epoch is a permutation
  EXPECT_EQ(std::set<int64_t>(second.begin(), second.end()).size(), 20u);
  EXPECT_NE(first, second);                                               // reshuffled per epoch
  std::vector<int64_t> sorted = first;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_NE(first, sorted);
  EXPECT_EQ(a.cursor().epoch, 1);
  EXPECT_EQ(a.cursor().position, 20);

  // Resume: a fresh dataset sought to a saved cursor serves what the first would have.
  PromptDataset b(p, tokenizer(), o);
  b.next(13);
  const DatasetCursor saved = b.cursor();
  const auto want = b.next(30);  // crosses into the next epoch
  PromptDataset c(p, tokenizer(), o);
  c.seek(saved);
  EXPECT_EQ(c.next(30), want);
  EXPECT_THROW(c.seek({0, 21}), ConfigError);

  o.shuffle = false;
  PromptDataset plain(p, tokenizer(), o);
  EXPECT_EQ(plain.next(3), (std::vector<int64_t>{0, 1, 2}));
}

}  // namespace
}  // namespace tiller::data

// The controller's prompt sources (tiller/controller/prompt_source.h) over the data above.
namespace tiller::controller {
namespace {
using data::DatasetCursor;
using data::DatasetOptions;
using data::Prompt;
using data::PromptDataset;
using data::tokenizer;
using data::file;

// data.source: a registered prompt source is the one the job draws from, made with the job's
// tokenizer and templates; the built-in file source gives what PromptDataset gives; what is wrong
// is named.
class CountingPrompts final : public PromptSource {
 public:
  CountingPrompts(const PromptSourceContext& c, int64_t base) : make_(c.make_prompt), base_(base) {}
  int64_t next() override { return position_++; }
  const Prompt& at(int64_t i) const override {
    auto it = made_.find(i);
    if (it == made_.end()) {
      Prompt p = make_("count to " + std::to_string(base_ + i), std::to_string(base_ + i));
      p.line = i + 1;
      it = made_.emplace(i, std::move(p)).first;
    }
    return it->second;
  }
  DatasetCursor cursor() const override { return {0, position_}; }
  void seek(const DatasetCursor& c) override { position_ = c.position; }

 private:
  std::function<Prompt(const std::string&, const std::string&)> make_;
  int64_t base_;
  int64_t position_ = 0;
  mutable std::map<int64_t, Prompt> made_;
};

TEST(PromptSources, ARegisteredSourceIsTheOneTheJobDrawsFrom) {
  static const bool registered = [] {
    PromptSourceDef d;
    d.make = [](const PromptSourceContext& c) -> std::unique_ptr<PromptSource> {
      return std::make_unique<CountingPrompts>(c, std::stoll(c.job->data.source_args));
    };
    register_prompt_source("test_counting", d);
    return true;
  }();
  ASSERT_TRUE(registered);
  JobConfig cfg;
  cfg.data.source = "test_counting";
  cfg.data.source_args = "40";
  cfg.data.input_template = "Q: {}\nA:";
  auto src = make_job_prompt_source(cfg, tokenizer());
  EXPECT_EQ(src->next(), 0);
  EXPECT_EQ(src->next(), 1);
  const Prompt& p = src->at(1);
  EXPECT_EQ(p.text, "Q: count to 41\nA:");
  EXPECT_EQ(p.label, "41");
  EXPECT_EQ(p.tokens, tokenizer().encode("Q: count to 41\nA:", false));
  EXPECT_EQ(src->cursor().position, 2);
  src->seek({0, 7});
  EXPECT_EQ(src->next(), 7);
  EXPECT_EQ(src->size(), -1);
  // The make_prompt helper refuses a prompt over rollout.max_prompt_tokens.
  cfg.rollout.max_prompt_tokens = 3;
  auto tight = make_job_prompt_source(cfg, tokenizer());
  EXPECT_NE(tiller::error_of([&] { tight->at(0); }).find("data.source = test_counting: a prompt of"), std::string::npos);

  // file: the built-in, through the same registry, serves data.prompts as PromptDataset does.
  const std::string path = file("source_file.jsonl", "{\"input\": \"a b\", \"label\": \"1\"}\n"
                                                     "{\"input\": \"c d e\", \"label\": \"2\"}\n");
  JobConfig fc;
  fc.data.prompts = path;
  fc.data.shuffle = false;
  auto files = make_job_prompt_source(fc, tokenizer());
  EXPECT_EQ(files->size(), 2);
  EXPECT_EQ(files->at(files->next()).label, "1");
  EXPECT_EQ(files->at(files->next()).label, "2");
  EXPECT_EQ(files->cursor().position, 2);
  const auto names = prompt_source_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "file"), names.end());
  fc.data.prompts = "";
  EXPECT_EQ(tiller::error_of([&] { make_job_prompt_source(fc, tokenizer()); }),
            "data.prompts: set the file of prompts (JSONL or parquet)");
  fc.data.source = "test_countng";
  EXPECT_NE(tiller::error_of([&] { make_job_prompt_source(fc, tokenizer()); })
                .find("data.source = 'test_countng': not a registered prompt source (registered: "),
            std::string::npos);
}

}  // namespace
}  // namespace tiller::controller
