// Every collective of the Communicator under test, on odd sizes and fp32/bf16/int64, checked
// against values each rank can compute for every other rank. Run with 2 and 4 ranks, on the MPI
// backend (CPU) and on NCCL (GPU). Values are small integers, exact in bf16.
#include <chrono>
#include <string>

#include <gtest/gtest.h>

#include "dist/mpi_check.h"
#include "mpi_env_for_tests.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/dist/groups.h"

namespace tiller::test {
namespace {

using dist::ReduceOp;

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kBFloat16, at::kLong};
// Odd sizes, one smaller than any group (some ranks' all-reduce chunks are empty), one large
// enough to leave MPI's eager protocol.
const std::vector<std::int64_t> kSizes = {1, 3, 1001, 300007};

dist::Communicator& comm() { return *mpi_test_env().comm; }
at::TensorOptions on_device(at::ScalarType t) { return mpi_test_env().device.dtype(t); }

// The value rank r contributes at index i: small integers (exact in bf16 when summed over 4 ranks).
at::Tensor pattern(std::int64_t n, int r, at::ScalarType t) {
  auto i = at::arange(n, at::kLong);
  return ((i * 7 + r * 13) % 61).to(t);
}

std::string what(const char* op, at::ScalarType t, std::int64_t n) {
  return std::string(op) + " " + c10::toString(t) + " n=" + std::to_string(n);
}

void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& ctx) {
  auto g = got.cpu().to(at::kDouble);
  auto w = want.cpu().to(at::kDouble);
  ASSERT_EQ(g.sizes(), w.sizes()) << ctx;
  EXPECT_TRUE(at::equal(g, w)) << ctx << ": max diff " << (g - w).abs().max().item<double>();
}

TEST(Communicator, AllGather) {
  const int p = comm().size(), me = comm().rank();
  for (auto t : kDtypes) {
    for (auto n : kSizes) {
      auto in = pattern(n, me, t).to(on_device(t));
      auto out = at::full({n * p}, -1, on_device(t));
      comm().all_gather(in, out)->wait();
      std::vector<at::Tensor> parts;
      for (int r = 0; r < p; ++r) parts.push_back(pattern(n, r, t));
      expect_equal(out, at::cat(parts), what("all_gather", t, n));
    }
  }
}

TEST(Communicator, ReduceScatter) {
  const int p = comm().size(), me = comm().rank();
  for (auto t : kDtypes) {
    for (auto m : kSizes) {
      for (auto op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
        auto in = pattern(m * p, me, t).to(on_device(t));
        auto out = at::full({m}, -1, on_device(t));
        comm().reduce_scatter(in, out, op)->wait();
        auto want = pattern(m * p, 0, at::kLong);
        for (int r = 1; r < p; ++r) {
          auto x = pattern(m * p, r, at::kLong);
          want = op == ReduceOp::kSum ? want + x : op == ReduceOp::kMax ? at::maximum(want, x) : at::minimum(want, x);
        }
        expect_equal(out, want.narrow(0, me * m, m).to(t), what("reduce_scatter", t, m));
      }
    }
  }
}

TEST(Communicator, AllToAllExchangesChunksAndIsItsOwnInverse) {
  const int p = comm().size(), me = comm().rank();
  for (auto t : kDtypes) {
    for (auto m : kSizes) {
      // Chunk j of rank r holds pattern(m, r * p + j): every (sender, receiver) pair is distinct.
      std::vector<at::Tensor> mine;
      for (int j = 0; j < p; ++j) mine.push_back(pattern(m, me * p + j, t));
      auto in = at::cat(mine).to(on_device(t));
      auto out = at::full({m * p}, -1, on_device(t));
      comm().all_to_all(in, out)->wait();
      std::vector<at::Tensor> want;
      for (int r = 0; r < p; ++r) want.push_back(pattern(m, r * p + me, t));
      expect_equal(out, at::cat(want), what("all_to_all", t, m));
      auto back = at::full({m * p}, -1, on_device(t));
      comm().all_to_all(out, back)->wait();
      expect_equal(back, in, what("all_to_all inverse", t, m));
    }
  }
  auto uneven = at::zeros({p * 3 + 1}, on_device(at::kFloat));
  EXPECT_THROW(comm().all_to_all(uneven, uneven.clone()), Error);
}

TEST(Communicator, AllReduce) {
  const int p = comm().size(), me = comm().rank();
  for (auto t : kDtypes) {
    for (auto n : kSizes) {
      for (auto op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
        auto x = pattern(n, me, t).to(on_device(t));
        comm().all_reduce(x, op)->wait();
        auto want = pattern(n, 0, at::kLong);
        for (int r = 1; r < p; ++r) {
          auto y = pattern(n, r, at::kLong);
          want = op == ReduceOp::kSum ? want + y : op == ReduceOp::kMax ? at::maximum(want, y) : at::minimum(want, y);
        }
        expect_equal(x, want.to(t), what("all_reduce", t, n));
      }
    }
  }
}

TEST(Communicator, AllReduceMultiDimensional) {
  const int p = comm().size(), me = comm().rank();
  auto x = at::full({3, 5, 7}, me + 1, on_device(at::kFloat));
  comm().all_reduce(x)->wait();
  expect_equal(x, at::full({3, 5, 7}, p * (p + 1) / 2, at::kFloat), "all_reduce 3-d");
}

TEST(Communicator, BroadcastFromEveryRoot) {
  const int p = comm().size(), me = comm().rank();
  for (auto t : kDtypes) {
    for (auto n : kSizes) {
      for (int root = 0; root < p; ++root) {
        auto x = (me == root ? pattern(n, root, t) : at::full({n}, -1, t)).to(on_device(t));
        comm().broadcast(x, root)->wait();
        expect_equal(x, pattern(n, root, t), what("broadcast", t, n) + " root " + std::to_string(root));
      }
    }
  }
}

TEST(Communicator, SendRecvPairs) {
  const int p = comm().size(), me = comm().rank();
  const int partner = me ^ 1;
  if (partner >= p) GTEST_SKIP() << "odd group";
  for (auto t : kDtypes) {
    for (auto n : kSizes) {
      auto out = pattern(n, me, t).to(on_device(t));
      auto in = at::full({n}, -1, on_device(t));
      // Opposite orders on the two sides: an NCCL send may wait for its recv.
      if (me % 2 == 0) {
        comm().send(out, partner)->wait();
        comm().recv(in, partner)->wait();
      } else {
        comm().recv(in, partner)->wait();
        comm().send(out, partner)->wait();
      }
      expect_equal(in, pattern(n, partner, t), what("send/recv", t, n));
    }
  }
}

TEST(Communicator, ManyOpsInFlight) {
  // Issue several ops before waiting on any; results must not mix.
  const int p = comm().size(), me = comm().rank();
  std::vector<at::Tensor> xs;
  std::vector<dist::WorkPtr> works;
  for (int k = 0; k < 8; ++k) {
    xs.push_back(at::full({1000 + k}, me + k, on_device(at::kFloat)));
    works.push_back(comm().all_reduce(xs.back()));
  }
  for (auto& w : works) w->wait();
  for (int k = 0; k < 8; ++k) {
    expect_equal(xs[k], at::full({1000 + k}, p * (p - 1) / 2 + p * k, at::kFloat), "op " + std::to_string(k));
  }
}

TEST(Communicator, SplitEvenOdd) {
  const int p = comm().size(), me = comm().rank();
  auto sub = comm().split(me % 2, me, "parity");
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->size(), (p + 1 - me % 2) / 2);
  EXPECT_EQ(sub->rank(), me / 2);
  EXPECT_EQ(sub->name(), "parity");
  auto x = at::full({5}, me, on_device(at::kLong));
  sub->all_reduce(x)->wait();
  std::int64_t want = 0;
  for (int r = me % 2; r < p; r += 2) want += r;
  expect_equal(x, at::full({5}, want, at::kLong), "all_reduce in split");
  // A rank with a negative color takes no part.
  auto only_zero = comm().split(me == 0 ? 0 : -1, 0, "zero");
  EXPECT_EQ(only_zero == nullptr, me != 0);
  if (only_zero) EXPECT_EQ(only_zero->size(), 1);
}

TEST(Communicator, RejectsBadArguments) {
  const int p = comm().size();
  auto in = at::zeros({4}, on_device(at::kFloat));
  auto wrong = at::zeros({4 * p + 1}, on_device(at::kFloat));
  EXPECT_THROW(comm().all_gather(in, wrong), Error);
  EXPECT_THROW(comm().broadcast(in, p), Error);
  EXPECT_THROW(comm().send(in, comm().rank()), Error);
  if (std::string(comm().backend()) == "mpi") {
    // A CUDA tensor on the MPI backend (or vice versa) is named, not crashed on.
    try {
      comm().all_reduce(at::zeros({4}, at::kFloat).view({2, 2}).t());
      FAIL() << "non-contiguous all_reduce accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("contiguous"), std::string::npos) << e.what();
    }
  } else {
    EXPECT_THROW(comm().all_reduce(at::zeros({4}, at::kFloat)), Error);  // CPU tensor on NCCL
  }
}

// A failing MPI call (a real one: an invalid communicator, which MPI_ERRORS_RETURN hands back as
// MPI_ERR_COMM) becomes a CommError naming what it was for, the call, and MPI's words.
TEST(MpiCheck, AFailingCallNamesTheContextTheCallAndTheError) {
  int rank = -1;
  try {
    TILLER_MPI(MPI_Comm_rank(MPI_COMM_NULL, &rank), "probe of group '{}' (rank {})", "g", 3);
    FAIL() << "MPI_Comm_rank(MPI_COMM_NULL) succeeded";
  } catch (const CommError& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("probe of group 'g' (rank 3): MPI_Comm_rank failed: ", 0), 0u) << m;
    EXPECT_NE(m.find("MPI_ERR_COMM"), std::string::npos) << m;
  }
  TILLER_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "probe");  // a call that succeeds passes through
  EXPECT_GE(rank, 0);
}

// TILLER_CUDA on the NCCL launcher thread with a real failure: an NCCL communicator for a device
// that does not exist fails on every rank with the op, the rank and CUDA's words, and no rank hangs.
TEST(NcclCheck, ACommunicatorOnAMissingDeviceNamesTheCallAndTheError) {
  if (std::string(comm().backend()) != "nccl") GTEST_SKIP() << "NCCL backend only";
  try {
    dist::MpiEnv::nccl(*mpi_test_env().world, 9999, "missing_device", 30);
    FAIL() << "an NCCL communicator on cuda:9999 was created";
  } catch (const CommError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("creating NCCL communicator 'missing_device' (rank " + std::to_string(comm().rank())),
              std::string::npos) << m;
    EXPECT_NE(m.find("cudaSetDevice failed: invalid device ordinal"), std::string::npos) << m;
  }
}

// One rank skips a collective and goes on to its next operation; every rank must get a clear
// TimeoutError within the deadline (not hang), and the communicator is aborted afterwards.
TEST(Communicator, SkippedCollectiveTimesOutOnEveryRank) {
  const int p = comm().size(), me = comm().rank();
  const double timeout = std::string(comm().backend()) == "nccl" ? 5.0 : 2.0;
  auto hang = comm().split(0, me, "hang-test");
  ASSERT_NE(hang, nullptr);
  hang->set_timeout(timeout);
  const int skipper = p - 1;
  auto x = at::ones({16}, on_device(at::kFloat));
  const bool nccl = std::string(comm().backend()) == "nccl";
  // Warm up: NCCL sets up its connections on the host during a communicator's first ops. After
  // this, the hang below is the usual one: kernels spinning on a peer that never arrives.
  hang->all_reduce(x)->wait();
  if (me == 0) hang->send(x, skipper)->wait();
  if (me == skipper) hang->recv(x, 0)->wait();
  const auto t0 = std::chrono::steady_clock::now();
  std::string message;
  try {
    if (me != skipper) {
      hang->all_reduce(x)->wait();
    } else if (!nccl) {
      // The skipper's next collective is a broadcast: the MPI backend's messages carry the op's
      // sequence number and kind, so it is not mistaken for the all_reduce the others are in.
      hang->broadcast(x, 0)->wait();
    } else {
      // NCCL does not check that ranks run the same collective; the skipper's next step is a
      // recv that the others, stuck in the all_reduce, never send.
      hang->recv(x, 0)->wait();
    }
  } catch (const TimeoutError& e) {
    message = e.what();
  }
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(message.empty()) << "rank " << me << " got no TimeoutError";
  EXPECT_NE(message.find("hang-test"), std::string::npos) << message;
  EXPECT_NE(message.find("rank " + std::to_string(me)), std::string::npos) << message;
  EXPECT_NE(message.find("#"), std::string::npos) << message;
  EXPECT_NE(message.find(me != skipper ? "all_reduce" : nccl ? "recv" : "broadcast"), std::string::npos) << message;
  if (!nccl && me != skipper) {
    // The MPI backend knows whose data never came: the hung rank is named.
    EXPECT_NE(message.find("no data from rank(s) " + std::to_string(skipper)), std::string::npos) << message;
  }
  EXPECT_GE(elapsed, timeout * 0.9);
  EXPECT_LT(elapsed, timeout + 3.0) << "the timeout came far too late";
  EXPECT_TRUE(hang->aborted());
  EXPECT_THROW(hang->all_reduce(x), CommError);
}

// The plan's groups become communicators: each role's ranks in the plan's order, engine TP groups.
TEST(GroupCommunicators, FromRankPlan) {
  const int p = comm().size(), me = comm().rank();
  JobConfig c;
  c.roles.critic.enabled = false;
  c.algo.advantage_estimator = "reinforce";
  if (p == 4) {
    c.roles.actor.gpus = 1;
    c.engines.count = 1;
    c.engines.tp = 2;  // ranks: controller, 2 engine ranks, actor (+ref)
  } else {
    c.roles.actor.gpus = p - 1;
    c.engines.count = 0;
  }
  dist::NodeMap nodes;
  nodes.nodes.push_back({"local", {}, -1});
  for (int r = 0; r < p; ++r) nodes.nodes[0].ranks.push_back(r);
  auto plan = dist::make_rank_plan(c, nodes);
  auto groups = dist::make_group_communicators(plan, comm());

  const auto& actor = plan.group("actor")->ranks;
  const bool in_actor = std::find(actor.begin(), actor.end(), me) != actor.end();
  ASSERT_EQ(groups.role(Role::kActor) != nullptr, in_actor);
  ASSERT_EQ(groups.role(Role::kRef) != nullptr, in_actor);  // colocated: same ranks, own communicator
  if (in_actor) {
    auto* a = groups.role(Role::kActor);
    EXPECT_EQ(a->size(), static_cast<int>(actor.size()));
    EXPECT_EQ(actor[a->rank()], me);
    auto x = at::full({3}, me, on_device(at::kLong));
    a->all_reduce(x)->wait();
    std::int64_t want = 0;
    for (int r : actor) want += r;
    expect_equal(x, at::full({3}, want, at::kLong), "actor all_reduce");
    EXPECT_NE(groups.role(Role::kRef), a);
  }
  EXPECT_EQ(groups.engine_tp != nullptr, plan.ranks[me].engine >= 0);
  if (groups.engine_tp) {
    const auto& e = plan.engines[plan.ranks[me].engine];
    EXPECT_EQ(groups.engine_tp->size(), static_cast<int>(e.ranks.size()));
    EXPECT_EQ(groups.engine_tp->rank(), plan.ranks[me].engine_tp_rank);
    auto x = at::full({2}, groups.engine_tp->rank() == 0 ? 7 : 0, on_device(at::kInt));
    groups.engine_tp->broadcast(x, 0)->wait();
    expect_equal(x, at::full({2}, 7, at::kInt), "engine TP broadcast");
  }
  // The weight sync spans the actor's ranks first, then the engines'.
  const auto sync = dist::weight_sync_ranks(plan);
  EXPECT_EQ(sync.empty(), plan.engines.empty());
  const auto at_sync = std::find(sync.begin(), sync.end(), me);
  ASSERT_EQ(groups.weight_sync != nullptr, at_sync != sync.end());
  if (groups.weight_sync) {
    EXPECT_EQ(groups.weight_sync->rank(), static_cast<int>(at_sync - sync.begin()));
    EXPECT_EQ(groups.weight_sync->size(), static_cast<int>(sync.size()));
    for (size_t i = 0; i < actor.size(); ++i) EXPECT_EQ(sync[i], actor[i]);
    auto x = at::full({1}, groups.weight_sync->rank() == 0 ? me : -1, on_device(at::kLong));
    groups.weight_sync->broadcast(x, 0)->wait();
    expect_equal(x, at::full({1}, actor[0], at::kLong), "weight sync broadcast from actor rank 0");
  }
}

}  // namespace
}  // namespace tiller::test
