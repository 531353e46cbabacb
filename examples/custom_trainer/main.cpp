// A trainer of your own: tiller's launcher with a reward function that tiller does not ship.
//
//   mpirun -np 4 build-trainer/custom_trainer train -c configs/quickstart.yaml \
//       --set reward.rule=label_digits
//
// Every rank registers the function before run_main (the controller is the one that calls it).
// Everything else - the rank plan, the engines, ZeRO-3, the weight sync, checkpoints, metrics -
// is the stock `tiller train`; the other subcommands (plan, config, bench, ...) work too.
#include <set>
#include <string>

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

}  // namespace

int main(int argc, char** argv) {
  tiller::reward::register_fn("label_digits", label_digits);
  return tiller::run_main(argc, argv);
}
