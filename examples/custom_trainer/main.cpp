// A trainer of your own: tiller's launcher with a reward function and an advantage estimator that
// tiller does not ship.
//
//   mpirun -np 4 build-trainer/custom_trainer train -c configs/quickstart.yaml \
//       --set reward.rule=label_digits --set algo.advantage_estimator=clipped_gae
//
// Every rank registers them before run_main (the controller is the one that calls them).
// Everything else - the rank plan, the engines, ZeRO-3, the weight sync, checkpoints, metrics -
// is the stock `tiller train`; the other subcommands (plan, config, bench, ...) work too.
#include <set>
#include <string>

#include <ATen/ATen.h>
#include <tiller/tiller.h>

namespace {

// The share of the label's distinct digits that the response contains: the quickstart's labels
// are two-digit numbers, so "74" earns 0.5 for a response with a 7 and no 4. A random model
// rarely writes digits (about 0.05); it learns to.
double label_digits(const tiller::reward::Sample& s) {
  std::set<char> want;
  for (char c : s.label)
    if (c >= '0' && c <= '9') want.insert(c);
  if (want.empty()) return 0.0;
  int found = 0;
  for (char c : want) found += s.response_text.find(c) != std::string::npos ? 1 : 0;
  return static_cast<double>(found) / static_cast<double>(want.size());
}

// GAE whose advantages are clipped to [-2, 2] before whitening: a young critic's values are far
// off, and a few tokens with huge advantages would otherwise dominate the step. Like GAE it needs
// the critic, whose targets (the returns) stay unclipped.
tiller::algo::AdvantageOutputs clipped_gae(const tiller::algo::AdvantageInputs& in) {
  const tiller::algo::AdvantagesReturns ar = tiller::algo::gae(in.rewards, in.values, in.cu, in.gamma, in.lambda);
  return {at::clamp(ar.advantages, -2.0, 2.0), ar.returns};
}

}  // namespace

int main(int argc, char** argv) {
  tiller::reward::register_fn("label_digits", label_digits);
  tiller::algo::AdvantageEstimatorDef est;
  est.compute = clipped_gae;
  est.needs_critic = true;
  est.summary = "GAE with advantages clipped to [-2, 2]";
  tiller::algo::register_advantage_estimator("clipped_gae", est);
  return tiller::run_main(argc, argv);
}
