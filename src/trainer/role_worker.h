// A trainer rank of `tiller train`: the models of the roles the rank plan gives it (actor,
// critic, reference, reward; several when colocated), serving the controller's requests
// (messages.h) in the order they come until it says stop. Private to src/trainer.
//
// A request that fails is answered with an ErrorReply (the controller names this rank and the
// call), then the error ends this rank too.
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

namespace tiller::sync {
class LocalWeightSink;
}

namespace tiller::trainer {

class RoleWorker {
 public:
  // Loads this rank's roles (collective within each role's group).
  RoleWorker(const JobConfig& cfg, const dist::RankPlan& plan, int rank, dist::GroupCommunicators& groups,
             dist::Communicator& world, const std::string& device);
  ~RoleWorker();
  // Hybrid (cluster.hybrid), actor ranks: the weight syncs go to this rank's own engine through
  // its sink (sync/hybrid_handoff.h), which must outlive the worker. Before serve().
  void hand_off_to(sync::LocalWeightSink& sink);
  void serve();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tiller::trainer
