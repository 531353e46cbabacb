// Rule rewards: answer extraction and comparison, the registry and its errors.
#include <gtest/gtest.h>

#include "tiller/core/error.h"
#include "tiller/reward/rule_reward.h"

namespace tiller::reward {
namespace {

double score(const std::string& spec, const std::string& response, const std::string& label = "") {
  return rule_reward_for(spec)(Sample{"prompt", response, label});
}

TEST(RuleReward, MathAnswers) {
  EXPECT_EQ(extract_answer("so 3 + 4 = 7\n#### 7"), "7");
  EXPECT_EQ(extract_answer("#### 1\nthen again #### 12 apples\nmore"), "12 apples");
  EXPECT_EQ(extract_answer("the answer is \\boxed{\\frac{1}{2}}."), "\\frac{1}{2}");
  EXPECT_EQ(extract_answer("\\boxed{1} and finally \\boxed{ 42 }"), "42");
  EXPECT_EQ(extract_answer("no answer here"), std::nullopt);
  EXPECT_EQ(extract_answer("\\boxed{unclosed"), std::nullopt);
  EXPECT_TRUE(answers_match("1,000", "1000.0"));
  EXPECT_TRUE(answers_match("$18", "18"));
  EXPECT_TRUE(answers_match("-3.", "-3"));
  EXPECT_FALSE(answers_match("17", "18"));
  EXPECT_TRUE(answers_match(" x+1 ", "x+1"));
  EXPECT_FALSE(answers_match("1,0000", "10000"));  // not a comma between thousands: text, and different

  // GSM8K labels carry "#### n"; MATH labels are bare or boxed.
  EXPECT_EQ(score("math_answer", "Janet has 16 eggs... #### 18", "She sells 9... #### 18"), 1.0);
  EXPECT_EQ(score("math_answer", "... \\boxed{18}", "18"), 1.0);
  EXPECT_EQ(score("math_answer", "... \\boxed{17}", "18"), 0.0);
  EXPECT_EQ(score("math_answer", "I think it is 18", "18"), 0.0);  // no final answer marked
}

TEST(RuleReward, ExactMatchAndRegexFormat) {
  EXPECT_EQ(score("exact_match", "  Paris\n", "Paris"), 1.0);
  EXPECT_EQ(score("exact_match", "paris", "Paris"), 0.0);
  const std::string fmt = "regex:<think>[^]*</think>\\s*#### -?[0-9]+\\s*";
  EXPECT_EQ(score(fmt, "<think>2 + 2\nis 4</think>\n#### 4"), 1.0);
  EXPECT_EQ(score(fmt, "#### 4"), 0.0);
  try {
    rule_reward_for("regex:(unclosed");
    ADD_FAILURE() << "a bad regex was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("not a valid regular expression"), std::string::npos) << e.what();
  }
}

TEST(RuleReward, RegistryTakesUserFunctions) {
  register_rule_reward("test_length", [](const Sample& s) { return static_cast<double>(s.response_text.size()); });
  EXPECT_EQ(score("test_length", "abcd"), 4.0);
  EXPECT_THROW(register_rule_reward("test_length", [](const Sample&) { return 0.0; }), ConfigError);
  EXPECT_THROW(register_rule_reward("regex:x", [](const Sample&) { return 0.0; }), ConfigError);
  EXPECT_THROW(register_rule_reward("test_nothing", RewardFn()), ConfigError);
  const auto all = rule_reward_names();
  EXPECT_NE(std::find(all.begin(), all.end(), "math_answer"), all.end());
  EXPECT_NE(std::find(all.begin(), all.end(), "test_length"), all.end());
  EXPECT_EQ(find_rule_reward("test_length")({"", "abc", ""}), 3.0);
  try {
    rule_reward_for("toy_digit");
    ADD_FAILURE() << "an unknown reward was found";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("reward.rule = 'toy_digit': not a registered rule reward (registered: "), std::string::npos)
        << what;
    EXPECT_NE(what.find("math_answer"), std::string::npos) << what;
    EXPECT_NE(what.find("did you mean 'toy_digits'?"), std::string::npos) << what;
  }
  // The names before the registry scheme forward for one release.
  register_fn("test_old_name", [](const Sample&) { return 2.0; });
  EXPECT_EQ(find("test_old_name")({"", "", ""}), 2.0);
}

TEST(RuleReward, ToyTasks) {
  const RewardFn digits = rule_reward_for("toy_digits");
  EXPECT_DOUBLE_EQ(digits({"", "12ab", ""}), 0.5);
  EXPECT_DOUBLE_EQ(digits({"", "2024", ""}), 1.0);
  EXPECT_DOUBLE_EQ(digits({"", "", ""}), 0.0);
  EXPECT_DOUBLE_EQ(digits({"", "\xc3\xa9" "7", ""}), 0.5);  // "é7": two characters, one digit
  const RewardFn echo = rule_reward_for("toy_echo");
  EXPECT_DOUBLE_EQ(echo({"", "abcx", "abcd"}), 0.75);
  EXPECT_DOUBLE_EQ(echo({"", " abcd ", "abcd"}), 1.0);
  EXPECT_DOUBLE_EQ(echo({"", "zz", "abcd"}), 0.0);
}

}  // namespace
}  // namespace tiller::reward
