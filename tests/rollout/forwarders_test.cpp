// The one-release forwarding headers of tiller/rollout/: code written against the old paths and
// the tiller::rollout:: names builds, and the names are the new ones (not copies).
#include <gtest/gtest.h>

#include <algorithm>
#include <type_traits>

#include "tiller/rollout/agent.h"
#include "tiller/rollout/epoch_order.h"
#include "tiller/rollout/experience.h"
#include "tiller/rollout/memory_plan.h"
#include "tiller/rollout/metrics.h"
#include "tiller/rollout/packer.h"
#include "tiller/rollout/prompt_dataset.h"
#include "tiller/rollout/prompt_source.h"
#include "tiller/rollout/sample_loop.h"
#include "tiller/rollout/step_hooks.h"
#include "tiller/rollout/train.h"

namespace {

static_assert(std::is_same_v<tiller::rollout::SampleLoop, tiller::controller::SampleLoop>);
static_assert(std::is_same_v<tiller::rollout::StepHookDef, tiller::controller::StepHookDef>);
static_assert(std::is_same_v<tiller::rollout::PromptSource, tiller::controller::PromptSource>);
static_assert(std::is_same_v<tiller::rollout::AgentHarness, tiller::controller::AgentHarness>);
static_assert(std::is_same_v<tiller::rollout::Rollout, tiller::controller::Rollout>);
static_assert(std::is_same_v<tiller::rollout::Metrics, tiller::controller::Metrics>);
static_assert(std::is_same_v<tiller::rollout::MemoryPlan, tiller::job::MemoryPlan>);
static_assert(std::is_same_v<tiller::rollout::TrainOptions, tiller::job::TrainOptions>);
static_assert(std::is_same_v<tiller::rollout::Prompt, tiller::data::Prompt>);
static_assert(std::is_same_v<tiller::rollout::EpochOrder, tiller::data::EpochOrder>);

TEST(RolloutForwarders, TheOldNamesReachTheRegistriesAndFunctions) {
  // A loop registered through the old name is found through the new one, and the other way.
  tiller::rollout::SampleLoopDef d = tiller::controller::find_sample_loop("single_turn");
  tiller::rollout::register_sample_loop("forwarded_single_turn", d);
  const auto names = tiller::controller::sample_loop_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "forwarded_single_turn"), names.end());
  EXPECT_EQ(tiller::rollout::step_hook_names(), tiller::controller::step_hook_names());
  EXPECT_EQ(tiller::rollout::plan_rounds({0, 1}, {3, 3}, 1, 8).size(), 1u);
}

}  // namespace
