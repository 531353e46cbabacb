// The data of supervised fine-tuning (src/offline/sft_data.h): conversations masked per turn (only
// the assistant's content and end of turn trained), prompt/response pairs, the length policies, the
// held-out split, and bad records named by file:line; and the pairs of reward-model training and
// DPO (preference_data.h): each side's mask on its response after the shared prompt, margins. Tokenizers: the Qwen2 (ChatML) and Llama-3
// fixtures (make_hf_fixtures.py).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <tuple>
#include <set>

#include "../model/fixtures.h"
#include "offline/preference_data.h"
#include "offline/sft_data.h"
#include "data/records.h"
#include "tiller/core/error.h"
#include "tiller/text/tokenizer.h"
#include "tiller/data/epoch_order.h"

namespace tiller::offline {
namespace {

const text::Tokenizer& qwen2() {
  static auto t = text::load_tokenizer(test::hf_fixtures() + "/tokenizers/qwen2");
  return *t;
}
const text::Tokenizer& llama3() {
  static auto t = text::load_tokenizer(test::hf_fixtures() + "/tokenizers/llama3");
  return *t;
}

std::string file(const std::string& name, const std::string& text) {
  std::filesystem::create_directories(test::scratch_dir() + "/offline");
  const std::string p = test::scratch_dir() + "/offline/" + name;
  test::write_text(p, text);
  return p;
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

// The trained tokens, and the others, as text.
std::pair<std::string, std::string> split_text(const SftSample& s, const text::Tokenizer& tok) {
  std::vector<int64_t> on, off;
  for (size_t i = 0; i < s.tokens.size(); ++i) (s.loss_mask[i] ? on : off).push_back(s.tokens[i]);
  return {tok.decode(on), tok.decode(off)};
}

const std::vector<text::ChatMessage> kTalk = {{"system", "Be brief."},
                                              {"user", "What is 2+2?"},
                                              {"assistant", "4"},
                                              {"user", "And 3+3?"},
                                              {"tool", "calc: 6"},
                                              {"assistant", "It is 6."}};

// Every token comes from the whole conversation as the template writes it, and exactly the
// assistant turns' content and end of turn are trained, in ChatML and Llama-3.
TEST(SftData, AConversationTrainsTheAssistantTurnsOnly) {
  for (auto [chat, tok, end] : {std::tuple{text::ChatFormat::kChatML, &qwen2(), std::string("<|im_end|>\n")},
                                std::tuple{text::ChatFormat::kLlama3, &llama3(), std::string("<|eot_id|>")}}) {
    const SftSample s = encode_conversation("talk", kTalk, *tok, chat);
    ASSERT_EQ(s.tokens.size(), s.loss_mask.size());
    EXPECT_EQ(tok->decode(s.tokens), text::apply_chat_template(chat, kTalk, false)) << text::chat_format_name(chat);
    const auto [trained, rest] = split_text(s, *tok);
    EXPECT_EQ(trained, "4" + end + "It is 6." + end) << text::chat_format_name(chat);
    for (const char* never : {"Be brief.", "What is 2+2?", "And 3+3?", "calc: 6", "assistant"})
      EXPECT_NE(rest.find(never), std::string::npos) << never << " should not be trained (" << text::chat_format_name(chat) << ")";
    EXPECT_EQ(s.loss_mask.front(), 0);
  }
  EXPECT_NE(error_of([] { encode_conversation("x.jsonl:3", {{"user", "hi"}}, qwen2(), text::ChatFormat::kChatML); })
                .find("x.jsonl:3: the conversation has no assistant turn"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              encode_conversation("x.jsonl:4", {{"user", "hi"}, {"bot", "yo"}}, qwen2(), text::ChatFormat::kChatML);
            }).find("x.jsonl:4: message 2 has the role 'bot'"),
            std::string::npos);
  EXPECT_NE(error_of([] { encode_conversation("x.jsonl:5", kTalk, qwen2(), text::ChatFormat::kNone); })
                .find("needs a chat template"),
            std::string::npos);
}

#if TILLER_HAVE_PYTHON
// With the model's own Jinja templates (make_chat_templates.py): the conversation's tokens are
// transformers' apply_chat_template ids, and the assistant turns' content and end are trained.
// Mistral's template moves the system message into the last user turn, so its prefixes are not the
// whole's: a conversation with a system message cannot be masked per turn, and says so.
TEST(SftData, JinjaTemplatesTrainWhatTransformersWrites) {
  const auto ref = nlohmann::ordered_json::parse(test::read_text(test::hf_fixtures() + "/chat_templates/reference.json"));
  int checked = 0, with_tools = 0;
  for (const std::string name : {"qwen2.5", "llama3.1", "mistral", "gemma", "deepseek"}) {
    const std::string dir = test::hf_fixtures() + "/chat_templates/" + name;
    auto tok = text::load_tokenizer(dir);
    const text::ChatTemplate chat = text::load_chat_template("model", dir, *tok);
    for (const auto& c : ref[name]["cases"]) {
      if (c["add_generation_prompt"].get<bool>()) continue;
      // A case with tools: the record's tools (offline.tools_key) go to the template.
      const std::string tools = c["tools"].is_null() ? "" : c["tools"].dump();
      const auto messages = data::chat_messages("case", c["messages"], "messages");
      if (name == "mistral" && messages.front().role == "system") {
        EXPECT_NE(error_of([&] { encode_conversation("x.jsonl:2", messages, *tok, chat, 0, tools); })
                      .find("x.jsonl:2: the chat template does not extend the conversation turn by turn"),
                  std::string::npos);
        continue;
      }
      bool extends = true;
      SftSample s;
      const std::string err = error_of([&] { s = encode_conversation("case", messages, *tok, chat, 0, tools); });
      if (!tools.empty() && err.find("does not extend the conversation turn by turn") != std::string::npos) {
        extends = false;  // a template that writes the tools into the last user turn (Llama-3.1's)
      }
      ASSERT_TRUE(err.empty() || !extends) << name << ": " << err;
      if (!extends) continue;
      if (!tools.empty()) ++with_tools;
      EXPECT_EQ(s.tokens, c["ids"].get<std::vector<int64_t>>()) << name << ": " << c["messages"].dump();
      // Each assistant turn as its template writes it: Mistral's after a space, Llama's, Mistral's
      // and Gemma's trimmed, then its end of turn.
      const std::map<std::string, std::tuple<std::string, bool, std::string>> turn = {
          {"qwen2.5", {"", false, "<|im_end|>\n"}},  {"llama3.1", {"", true, "<|eot_id|>"}},
          {"mistral", {" ", true, "</s>"}},          {"gemma", {"", true, "<end_of_turn>\n"}},
          {"deepseek", {"", false, "<｜end▁of▁sentence｜>"}}};
      const auto& [lead, trimmed, end] = turn.at(name);
      if (!tools.empty() && std::any_of(messages.begin(), messages.end(), [](const text::ChatMessage& m) {
            return m.fields_json.find("tool_calls") != std::string::npos;
          })) {
        // The call's turn is trained as the template writes the call (ids checked above), then the answer's.
        const auto [trained, rest] = split_text(s, *tok);
        EXPECT_NE(trained.find("17*3"), std::string::npos) << name << ": " << trained;
        EXPECT_EQ(rest.find("17*3"), std::string::npos) << name << ": " << rest;
        EXPECT_EQ(rest.find("17 + 25 = 42."), std::string::npos) << name << ": " << rest;
        ++checked;
        continue;
      }
      std::string want;
      for (const auto& m : messages)
        if (m.role == "assistant") {
          std::string content = m.content;
          if (trimmed) {
            content.erase(0, content.find_first_not_of(" \n"));
            content.erase(content.find_last_not_of(" \n") + 1);
          }
          want += lead + content + end;
        }
      EXPECT_EQ(split_text(s, *tok).first, want) << name << ": " << c["messages"].dump();
      ++checked;
    }
  }
  EXPECT_GE(checked, 9);
  EXPECT_GE(with_tools, 3);  // Qwen2.5's, Llama-3.1's and Mistral's tool conversations
}
#endif

// A prompt/response pair: with a template, the conversation [user, assistant]; without one, the
// prompt (through the input template), the response and EOS, the last two trained.
TEST(SftData, APromptAndResponsePair) {
  SftDataOptions o;
  o.chat = text::ChatFormat::kChatML;
  const SftSample c = encode_pair("p", "Q?", "A.", qwen2(), o);
  EXPECT_EQ(split_text(c, qwen2()).first, "A.<|im_end|>\n");
  o.chat = text::ChatFormat::kNone;
  o.input_template = "Question: {}\nAnswer:";
  o.eos_id = qwen2().eos_id;
  ASSERT_TRUE(o.eos_id.has_value());
  const SftSample p = encode_pair("p", "Q?", " A.", qwen2(), o);
  EXPECT_EQ(qwen2().decode(p.tokens), "Question: Q?\nAnswer: A." + qwen2().id_to_token(*o.eos_id));
  EXPECT_EQ(split_text(p, qwen2()).first, " A." + qwen2().id_to_token(*o.eos_id));
  o.eos_id.reset();
  EXPECT_NE(error_of([&] { encode_pair("p:1", "Q?", "A.", qwen2(), o); }).find("p:1: without a chat template"),
            std::string::npos);
}

// The file: both record kinds, custom keys, the length policies, the split, and bad records by
// file:line.
TEST(SftData, AFileOfRecordsWithItsPoliciesAndSplit) {
  const std::string long_answer(400, 'x');
  const std::string path = file("sft.jsonl",
                                R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})"
                                "\n\n"
                                R"({"q": "2+2?", "a": "4"})"
                                "\n"
                                R"({"q": "long?", "a": ")" + long_answer + R"("})" "\n"
                                R"({"q": "3+3?", "a": "6"})" "\n");
  SftDataOptions o;
  o.chat = text::ChatFormat::kChatML;
  o.prompt_key = "q";
  o.response_key = "a";
  o.max_tokens = 64;
  SftDataset d(path, qwen2(), o);
  ASSERT_EQ(d.size(), 3);
  EXPECT_EQ(d.skipped(), 1);
  EXPECT_EQ(d.at(0).line, 1);
  EXPECT_EQ(d.at(1).line, 3);  // a blank line is allowed, and counted
  EXPECT_EQ(d.at(2).line, 5);
  EXPECT_EQ(split_text(d.at(1), qwen2()).first, "4<|im_end|>\n");
  o.long_samples = LongSamples::kTruncate;
  SftDataset t(path, qwen2(), o);
  ASSERT_EQ(t.size(), 4);
  EXPECT_EQ(t.truncated(), 1);
  EXPECT_EQ(static_cast<int64_t>(t.at(2).tokens.size()), 64);
  EXPECT_GT(t.at(2).trained(), 0);
  o.long_samples = LongSamples::kError;
  EXPECT_NE(error_of([&] { SftDataset(path, qwen2(), o); }).find("sft.jsonl:4: the sample has"), std::string::npos);

  // The split: disjoint, complete, in file order, the same for the same seed.
  const auto s1 = t.split(2, 7), s2 = t.split(2, 7);
  EXPECT_EQ(s1.eval, s2.eval);
  ASSERT_EQ(s1.eval.size(), 2u);
  ASSERT_EQ(s1.train.size(), 2u);
  std::set<int64_t> all(s1.eval.begin(), s1.eval.end());
  all.insert(s1.train.begin(), s1.train.end());
  EXPECT_EQ(all.size(), 4u);
  EXPECT_TRUE(std::is_sorted(s1.eval.begin(), s1.eval.end()));
  EXPECT_NE(error_of([&] { t.split(4, 7); }).find("keep at least one for training"), std::string::npos);

  o.long_samples = LongSamples::kSkip;
  const std::string bad = file("bad.jsonl", R"({"q": "2+2?", "a": "4"})" "\n" R"({"question": "x"})" "\n");
  EXPECT_NE(error_of([&] { SftDataset(bad, qwen2(), o); })
                .find("bad.jsonl:2: neither chat messages under 'messages' nor text under 'q' and 'a'"),
            std::string::npos);
  const std::string msgs = file("msgs.jsonl", R"({"messages": [{"role": "user"}]})" "\n");
  EXPECT_NE(error_of([&] { SftDataset(msgs, qwen2(), o); }).find("msgs.jsonl:1: the messages under 'messages' must be"),
            std::string::npos);
  // Tools (offline.tools_key) only through a template that writes them, and only as a list.
  const std::string tools = file("tools.jsonl", R"({"q": "2+2?", "a": "4", "tools": [{"type": "function"}]})" "\n"
                                                R"({"q": "2+2?", "a": "4", "tools": "calc"})" "\n");
  EXPECT_NE(error_of([&] { SftDataset(tools, qwen2(), o); })
                .find("tools.jsonl:1: the record has tools, and the chatml chat format has no place for them"),
            std::string::npos);
  o.tools_key = "none_here";  // another key: the records' "tools" are not read
  EXPECT_EQ(SftDataset(tools, qwen2(), o).size(), 2);
  o.tools_key = "tools";
  o.chat = text::ChatFormat::kNone;
  EXPECT_NE(error_of([&] { SftDataset(tools, qwen2(), o); }).find("tools.jsonl:1: the record has tools, which only a chat"),
            std::string::npos);
  const std::string bad_tools = file("bad_tools.jsonl", R"({"q": "2+2?", "a": "4", "tools": "calc"})" "\n");
  EXPECT_NE(error_of([&] { SftDataset(bad_tools, qwen2(), o); })
                .find("bad_tools.jsonl:1: 'tools' must be a list of tool schemas, not string"),
            std::string::npos);
  o.chat = text::ChatFormat::kChatML;
  o.path_key = "data.train_file";
  std::filesystem::create_directories(test::scratch_dir() + "/offline/dir");
  EXPECT_NE(error_of([&] { SftDataset(test::scratch_dir() + "/offline/dir", qwen2(), o); })
                .find("is a directory, not the SFT data file; set data.train_file"),
            std::string::npos);
}

// Preference pairs in their three shapes: text prompt and answers; a prompt of messages with
// answers as text or turns; whole conversations without a prompt. Each side shares the prompt's
// tokens and trains only its response (a history's earlier assistant turns are not trained).
TEST(PreferenceData, PairsShareThePromptAndTrainTheirResponseOnly) {
  const std::string path = file("pairs.jsonl",
      R"({"prompt": "2+2?", "chosen": "4", "rejected": "5", "margin": 1.5})" "\n"
      R"({"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"}], "chosen": "4", "rejected": [{"role": "assistant", "content": "five"}]})" "\n"
      R"({"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "good"}], "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "bad"}]})" "\n");
  PreferenceDataOptions o;
  o.chat = text::ChatFormat::kChatML;
  PreferenceDataset d(path, qwen2(), o);
  ASSERT_EQ(d.size(), 3);
  EXPECT_TRUE(d.has_margins());
  EXPECT_DOUBLE_EQ(d.at(0).margin, 1.5);
  EXPECT_DOUBLE_EQ(d.at(1).margin, 0);
  const std::vector<std::pair<std::string, std::string>> want = {
      {"4<|im_end|>\n", "5<|im_end|>\n"}, {"4<|im_end|>\n", "five<|im_end|>\n"}, {"good<|im_end|>\n", "bad<|im_end|>\n"}};
  for (int64_t i = 0; i < d.size(); ++i) {
    const PreferencePair& p = d.at(i);
    EXPECT_EQ(split_text(p.chosen, qwen2()).first, want[static_cast<size_t>(i)].first) << "pair " << i;
    EXPECT_EQ(split_text(p.rejected, qwen2()).first, want[static_cast<size_t>(i)].second) << "pair " << i;
    // The untrained prefix (prompt and assistant header) is the same tokens on both sides.
    size_t c = 0, r = 0;
    while (!p.chosen.loss_mask[c]) ++c;
    while (!p.rejected.loss_mask[r]) ++r;
    ASSERT_EQ(c, r) << "pair " << i;
    EXPECT_TRUE(std::equal(p.chosen.tokens.begin(), p.chosen.tokens.begin() + static_cast<std::ptrdiff_t>(c),
                           p.rejected.tokens.begin()))
        << "pair " << i;
  }
  const std::string bad = file("bad_pairs.jsonl", R"({"prompt": "q", "chosen": "a"})" "\n"
                                                  R"({"prompt": "q", "chosen": "a", "rejected": "b", "margin": "big"})" "\n");
  EXPECT_NE(error_of([&] { PreferenceDataset(bad, qwen2(), o); }).find("bad_pairs.jsonl:1: no response under 'rejected'"),
            std::string::npos);
  const std::string bad2 = file("bad_pairs2.jsonl", R"({"prompt": "q", "chosen": "a", "rejected": "b", "margin": "big"})" "\n");
  EXPECT_NE(error_of([&] { PreferenceDataset(bad2, qwen2(), o); }).find("bad_pairs2.jsonl:1: the margin under 'margin'"),
            std::string::npos);
  // A side over max_tokens leaves the pair out (both sides, so pairs stay pairs).
  o.max_tokens = 20;
  const std::string longer = file("long_pairs.jsonl", R"({"prompt": "q", "chosen": "a", "rejected": "b"})" "\n"
                                                      R"({"prompt": "q", "chosen": "a", "rejected": ")" + std::string(200, 'z') + R"("})" "\n");
  PreferenceDataset l(longer, qwen2(), o);
  EXPECT_EQ(l.size(), 1);
  EXPECT_EQ(l.skipped(), 1);
}

// The order the offline trainers draw their training split in: each epoch a permutation, another
// one the next epoch, the same for the same seed, and a resumed order continues from its cursor.
TEST(EpochOrder, EpochsArePermutationsAndAResumeContinuesFromTheCursor) {
  data::EpochOrder a(5, true, 3), b(5, true, 3);
  const std::vector<int64_t> first = a.next(5), second = a.next(5);
  EXPECT_EQ(std::set<int64_t>(first.begin(), first.end()).size(), 5u);
  EXPECT_EQ(std::set<int64_t>(second.begin(), second.end()).size(), 5u);
  EXPECT_NE(first, second) << "each epoch is shuffled anew";
  std::vector<int64_t> want = first;
  want.insert(want.end(), {second[0], second[1]});
  EXPECT_EQ(b.next(7), want);
  data::EpochOrder c(5, true, 3);
  c.seek(b.cursor(), "samples");
  EXPECT_EQ(c.next(3), (std::vector<int64_t>{second[2], second[3], second[4]}));
  EXPECT_THROW(c.seek({0, 6}, "samples"), ConfigError);
  data::EpochOrder plain(3, false, 0);
  EXPECT_EQ(plain.next(4), (std::vector<int64_t>{0, 1, 2, 0}));
}

}  // namespace
}  // namespace tiller::offline
