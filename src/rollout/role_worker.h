// A trainer rank of `tiller train`: the models of the roles the rank plan gives it (actor,
// critic, reference, reward; several when colocated), serving the controller's messages
// (protocol.h) until it says stop. Private to src/rollout.
//
// Message layouts (tensors in order; R = response tokens, B = samples of the micro-batch):
//   kScore       in:  tokens, seq_lens, prompt_lens; scalars [temperature]
//                out: per role of this rank, in the order actor, ref, critic, reward:
//                     actor [logp R, entropy R], ref [logp R], critic [values R], reward [scores B];
//                     scalars: seconds per role, same order
//   kTrainActor  in:  tokens, seq_lens, prompt_lens, old_logp R, advantages R, ref_logp R|0,
//                     engine_logp R|0; scalars [normalizer, kl_loss_coef]        (no answer)
//   kTrainCritic in:  tokens, seq_lens, prompt_lens, old_values R, returns R; scalars [normalizer]
//   kStep*       in:  scalars [lr]; out: scalars kStepStats
//   kSync        in:  scalars [version]; out: scalars [seconds, wire bytes]
//   kSave/kLoad  in:  text (directory); out: empty text, or the error
//   kTrace       out: text (span names, one per line), tensors [float64 begin/end pairs, µs]
//   kStop        out: scalars [peak host MB]
// A failure is answered with text "error: ..." (the controller names the rank), then rethrown.
#pragma once

#include <memory>
#include <string>

namespace tiller {
struct JobConfig;
}
namespace tiller::dist {
struct RankPlan;
struct GroupCommunicators;
class Communicator;
}  // namespace tiller::dist

namespace tiller::rollout {

// Indices of kStep* answers' scalars.
enum StepStat { kGradNorm, kSkipped, kLoss, kClipTokens, kApproxKlTokens, kEntropySum, kTokens, kTrainSeconds,
                kStepSeconds, kPeakMb, kStepStatCount };

// Peak resident memory of this process, MB.
double peak_rss_mb();

class RoleWorker {
 public:
  // Loads this rank's roles (collective within each role's group).
  RoleWorker(const JobConfig& cfg, const dist::RankPlan& plan, int rank, dist::GroupCommunicators& groups,
             dist::Communicator& world, const std::string& device);
  ~RoleWorker();
  void serve();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tiller::rollout
