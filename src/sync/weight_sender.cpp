// The actor side of a weight sync (weight_sync.h).
#include <chrono>

#include <fmt/format.h>

#include "sync/bucket_packer.h"
#include "sync/sync_protocol.h"
#include "tiller/core/deadline.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/sync/weight_sync.h"
#include "tiller/zero/sharded_model.h"

namespace tiller::sync {

struct WeightSender::Impl {
  zero::ShardedModel& actor;
  dist::Communicator& comm;
  BucketPlan plan;
  double timeout_s;
  BucketPacker packer;

  Impl(zero::ShardedModel& a, dist::Communicator& c, BucketPlan p, double t)
      : actor(a), comm(c), plan(std::move(p)), timeout_s(t), packer(plan, actor, "weight sync") {}
};

WeightSender::WeightSender(zero::ShardedModel& actor, dist::Communicator& comm, BucketPlan plan, double timeout_s)
    : impl_(std::make_unique<Impl>(actor, comm, std::move(plan), timeout_s)) {
  Impl& m = *impl_;
  if (m.plan.senders != actor.world() || comm.rank() != actor.rank() || comm.size() <= actor.world())
    throw ConfigError(fmt::format("weight sync: the plan is for {} actor ranks and the actor group has {}; actor rank "
                                  "{} must be rank {} of the sync communicator ({} ranks: the actor's, then the engines')",
                                  m.plan.senders, actor.world(), actor.rank(), comm.rank(), comm.size()));
}

WeightSender::~WeightSender() = default;

const BucketPlan& WeightSender::plan() const { return impl_->plan; }

SyncStats WeightSender::send(uint64_t version) {
  Impl& m = *impl_;
  const auto [t0, deadline, control, me] = protocol::begin_send(m.comm, m.timeout_s, m.packer.device());

  at::Tensor header = at::zeros({protocol::kHeaderWords}, control);
  if (me == 0) {
    std::vector<int64_t> h{protocol::kMagic, protocol::to_word(version), protocol::to_word(m.plan.id),
                           static_cast<int64_t>(m.plan.buckets.size())};
    header.copy_(at::tensor(h, at::kLong));
  }
  m.comm.broadcast(header, 0)->wait(deadline);
  // Senders take part by construction; the engines vote on the header.
  at::Tensor votes = at::zeros({m.comm.size()}, control);
  m.comm.all_reduce(votes)->wait(deadline);
  if (votes.cpu().count_nonzero().item<int64_t>() != 0)
    throw SyncRefused(fmt::format("weight sync to version {} refused: {}; no weight changed", version,
                                  protocol::refusals(votes, m.plan.senders)));

  {
    protocol::SideStream pack(m.packer.device());  // packing, and the order NCCL follows for each bucket
    std::vector<dist::WorkPtr> works(m.plan.buckets.size());
    for (size_t k = 0; k < m.plan.buckets.size(); ++k) {
      // The buffer's last use (bucket k - 2) must be off the wire before it is written again.
      if (k >= 2) works[k - 2]->wait_on_stream();
      m.packer.pack(k, me);
      works[k] = m.comm.broadcast(m.packer.buffer(k), m.plan.buckets[k].sender);
    }
    for (auto& w : works) w->wait(deadline);
  }
  // Done: returns once every engine rank has its copies in place.
  at::Tensor done = at::ones({1}, control);
  m.comm.all_reduce(done, dist::ReduceOp::kMin)->wait(deadline);
  SyncStats st;
  st.version = version;
  st.buckets = static_cast<int64_t>(m.plan.buckets.size());
  st.wire_bytes = m.plan.wire_bytes();
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (done.cpu().item<int64_t>() != 1)
    throw CommError(fmt::format("weight sync to version {}: an engine rank failed to place its weights (see its log)",
                                version));
  return st;
}

}  // namespace tiller::sync
