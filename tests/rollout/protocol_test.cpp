// The controller <-> rank messages (src/wire/messages.h): each one survives encode and decode
// unchanged (every message, walked through its own field list), and a frame that disagrees with
// itself is refused with the message's name.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <sstream>
#include <tuple>

#include "../common/error_of.h"
#include "controller/batch.h"
#include "tiller/controller/experience.h"
#include "tiller/core/error.h"
#include "wire/messages.h"

namespace tiller::controller {
namespace {

at::Tensor longs(std::vector<int64_t> v) { return at::tensor(v, at::kLong); }
at::Tensor floats(std::vector<float> v) { return at::tensor(v, at::kFloat); }

// Two sequences: 3 + 2 tokens (prompt 2) and 4 tokens (prompt 1): 1 + 3 response tokens.
wire::PackedSequences batch() {
  return {longs({5, 6, 7, 8, 9, 1, 2, 3, 4}), longs({5, 4}), longs({2, 1})};
}

void expect_batch(const wire::PackedSequences& a, const wire::PackedSequences& b) {
  EXPECT_TRUE(at::equal(a.tokens, b.tokens));
  EXPECT_TRUE(at::equal(a.seq_lens, b.seq_lens));
  EXPECT_TRUE(at::equal(a.prompt_lens, b.prompt_lens));
}

// Every field of every message, from the message's own field list: `Fill` gives each field a
// value of its own (present or absent for the optional tensors, by `present`), `Show` prints every
// field, so a field that the encoder or the decoder dropped, reordered or mangled shows as a
// difference. Sizes follow batch() (6 response rows, 2 ends) and the names' count.
struct Fill {
  bool present = true;
  double next = 1;
  size_t n_lines = 0;
  at::Tensor make(at::ScalarType dtype, wire::Rows rows) {
    const int64_t n = rows == wire::Rows::kResponse ? 6 : rows == wire::Rows::kEnds ? 2 : rows == wire::Rows::kLines ? static_cast<int64_t>(n_lines) : 3;
    next += 1;
    return (at::arange(n, at::kDouble) + next).remainder(dtype == at::kByte ? 2 : 1000).to(dtype);
  }
  void batch(wire::PackedSequences& b) { b = tiller::controller::batch(); }
  void tensor(at::Tensor& t, const char*, at::ScalarType dtype, wire::Rows rows) { t = make(dtype, rows); }
  void optional(at::Tensor& t, const char*, at::ScalarType dtype, wire::Rows rows) {
    t = present ? make(dtype, rows) : at::Tensor();
  }
  void num(double& x, const char*) { x = next++ + 0.5; }
  void flag(bool& b, const char*) { b = present; }
  void version(uint64_t& v, const char*) { v = static_cast<uint64_t>(next++); }
  void role(Role& r, const char*) { r = Role::kCritic; }
  void roles(RoleSet& r, const char*) { r = present ? RoleSet::from_bits(15) : RoleSet{}; }
  void per_role(std::array<double, kRoleCount>& a, const char*) {
    for (double& x : a) x = next++;
  }
  void text(std::string& s, const char*, bool) { s = "text " + std::to_string(next++); }
  void lines(std::vector<std::string>& v, const char*, size_t) {
    v = {"a" + std::to_string(next), "b" + std::to_string(next)};
    next += 1;
    n_lines = v.size();
  }
  void values(std::vector<double>& v, const char*) {
    v.clear();
    for (size_t i = 0; i < n_lines; ++i) v.push_back(next++);
  }
  void named(std::vector<std::pair<std::string, double>>& v, const char*, size_t) {
    v = {{"m" + std::to_string(next), next + 0.25}, {"n" + std::to_string(next), next + 0.75}};
    next += 1;
  }
};

struct Show {
  std::ostringstream out;
  void put(const char* what, const at::Tensor& t) {
    out << what << "=";
    if (!t.defined()) {
      out << "none;";
      return;
    }
    const at::Tensor d = t.to(at::kDouble);
    out << c10::toString(t.scalar_type()) << "[";
    for (int64_t i = 0; i < d.numel(); ++i) out << d.data_ptr<double>()[i] << ",";
    out << "];";
  }
  void batch(wire::PackedSequences& b) {
    put("tokens", b.tokens);
    put("seq_lens", b.seq_lens);
    put("prompt_lens", b.prompt_lens);
    out << "window=" << b.first_row << "," << b.next_token << ";";
  }
  void tensor(at::Tensor& t, const char* what, at::ScalarType, wire::Rows) { put(what, t); }
  void optional(at::Tensor& t, const char* what, at::ScalarType, wire::Rows) { put(what, t); }
  void num(double& x, const char* what) { out << what << "=" << x << ";"; }
  void flag(bool& b, const char* what) { out << what << "=" << b << ";"; }
  void version(uint64_t& v, const char* what) { out << what << "=" << v << ";"; }
  void role(Role& r, const char* what) { out << what << "=" << role_name(r) << ";"; }
  void roles(RoleSet& r, const char* what) { out << what << "=" << r.bits() << ";"; }
  void per_role(std::array<double, kRoleCount>& a, const char* what) {
    out << what << "=";
    for (double x : a) out << x << ",";
    out << ";";
  }
  void text(std::string& s, const char* what, bool) { out << what << "='" << s << "';"; }
  void lines(std::vector<std::string>& v, const char* what, size_t) {
    out << what << "=";
    for (const auto& s : v) out << "'" << s << "',";
    out << ";";
  }
  void values(std::vector<double>& v, const char* what) {
    out << what << "=";
    for (double x : v) out << x << ",";
    out << ";";
  }
  void named(std::vector<std::pair<std::string, double>>& v, const char* what, size_t) {
    out << what << "=";
    for (const auto& [n, x] : v) out << n << ":" << x << ",";
    out << ";";
  }
};

template <typename M>
std::string show(M m) {
  Show s;
  m.fields(s);
  return s.out.str();
}

template <typename M>
M decode_any(const wire::Frame& f) {
  if constexpr (std::is_same_v<M, wire::ScoreReply>) {
    return M::decode(f, batch());
  } else {
    return M::decode(f);
  }
}

TEST(Protocol, EveryMessageRoundTripsEveryFieldOfItsList) {
  int messages = 0;
  std::apply(
      [&](auto... proto) {
        const auto one = [&](auto m0) {
          using M = decltype(m0);
          for (bool present : {true, false}) {
            M m;
            Fill fill;
            fill.present = present;
            m.fields(fill);
            const wire::Frame f = m.encode();
            EXPECT_EQ(f.op, M::kOp);
            const std::string want = show(m), got = show(decode_any<M>(f));
            EXPECT_EQ(got, want) << wire::op_name(M::kOp) << (present ? "" : " (optional fields absent)");
            if (!want.empty()) {
              EXPECT_NE(want.find('='), std::string::npos);
            }
          }
          ++messages;
        };
        (one(proto), ...);
      },
      wire::Messages{});
  EXPECT_EQ(messages, 20);
}

TEST(Protocol, ScoreRequestRoundTrips) {
  wire::ScoreRequest r{batch(), 0.7};
  const wire::ScoreRequest d = wire::ScoreRequest::decode(r.encode());
  expect_batch(d.batch, r.batch);
  EXPECT_EQ(d.temperature, 0.7);
  EXPECT_EQ(d.batch.response_tokens(), 6);
}

TEST(Protocol, ScoreReplyRoundTripsEveryRoleSet) {
  for (unsigned bits = 1; bits < 16; ++bits) {
    wire::ScoreReply r;
    r.roles = RoleSet::from_bits(bits);
    const at::Tensor per_token = floats({-1, -2, -3, -4, -5, -6});
    if (r.roles.has(Role::kActor)) {
      r.actor_logp = per_token;
      r.actor_entropy = per_token * 2;
    }
    if (r.roles.has(Role::kCritic)) r.critic_values = per_token * 3;
    if (r.roles.has(Role::kRef)) r.ref_logp = per_token * 4;
    if (r.roles.has(Role::kReward)) r.reward_scores = floats({0.25, 0.75});
    r.seconds = {1, 2, 3, 4};
    const wire::ScoreReply d = wire::ScoreReply::decode(r.encode(), batch());
    EXPECT_EQ(d.roles.bits(), bits);
    EXPECT_EQ(d.seconds, r.seconds);
    for (auto [got, want] : {std::pair{d.actor_logp, r.actor_logp}, {d.actor_entropy, r.actor_entropy},
                             {d.critic_values, r.critic_values}, {d.ref_logp, r.ref_logp},
                             {d.reward_scores, r.reward_scores}}) {
      ASSERT_EQ(got.defined(), want.defined()) << "roles " << bits;
      if (want.defined()) EXPECT_TRUE(at::equal(got, want)) << "roles " << bits;
    }
  }
}

TEST(Protocol, ScoreReplyOfTheWrongSizeIsRefused) {
  wire::ScoreReply r;
  r.roles.add(Role::kRef);
  r.ref_logp = floats({-1, -2});  // the request has 6 response tokens
  EXPECT_NE(error_of([&] { wire::ScoreReply::decode(r.encode(), batch()); }).find("reference log-probs has 2 elements, expected 6"),
            std::string::npos);
}

TEST(Protocol, TrainActorRequestRoundTripsWithAndWithoutItsOptionalTensors) {
  for (int variant = 0; variant < 8; ++variant) {
    wire::TrainActorRequest r;
    r.batch = batch();
    r.old_logp = floats({-1, -2, -3, -4, -5, -6});
    r.advantages = floats({1, 0, -1, 2, 0, 1});
    if (variant & 1) r.ref_logp = floats({-1.5, -2, -3, -4, -5, -6});
    if (variant & 2) r.is_weights = floats({1, 1, 0.5, 2, 1, 0});
    if (variant & 4) r.loss_mask = at::tensor(std::vector<uint8_t>{1, 0, 0, 1, 1, 0}, at::kByte);
    r.normalizer = 12;
    r.kl_coef = 0.05;
    r.step_rows = 40;
    const wire::TrainActorRequest d = wire::TrainActorRequest::decode(r.encode());
    expect_batch(d.batch, r.batch);
    EXPECT_TRUE(at::equal(d.old_logp, r.old_logp));
    EXPECT_TRUE(at::equal(d.advantages, r.advantages));
    ASSERT_EQ(d.ref_logp.defined(), r.ref_logp.defined());
    ASSERT_EQ(d.is_weights.defined(), r.is_weights.defined());
    if (r.ref_logp.defined()) EXPECT_TRUE(at::equal(d.ref_logp, r.ref_logp));
    if (r.is_weights.defined()) EXPECT_TRUE(at::equal(d.is_weights, r.is_weights));
    ASSERT_EQ(d.loss_mask.defined(), r.loss_mask.defined());
    if (r.loss_mask.defined()) EXPECT_TRUE(at::equal(d.loss_mask, r.loss_mask));
    EXPECT_EQ(d.normalizer, 12);
    EXPECT_EQ(d.kl_coef, 0.05);
    EXPECT_EQ(d.step_rows, 40);
  }
}

TEST(Protocol, TrainCriticRequestRoundTrips) {
  for (bool masked : {false, true}) {
    wire::TrainCriticRequest r{batch(), floats({1, 2, 3, 4, 5, 6}), floats({6, 5, 4, 3, 2, 1}), {}, 6};
    if (masked) r.loss_mask = at::tensor(std::vector<uint8_t>{0, 1, 1, 1, 0, 1}, at::kByte);
    const wire::TrainCriticRequest d = wire::TrainCriticRequest::decode(r.encode());
    expect_batch(d.batch, r.batch);
    EXPECT_TRUE(at::equal(d.old_values, r.old_values));
    EXPECT_TRUE(at::equal(d.returns, r.returns));
    ASSERT_EQ(d.loss_mask.defined(), masked);
    if (masked) EXPECT_TRUE(at::equal(d.loss_mask, r.loss_mask));
    EXPECT_EQ(d.normalizer, 6);
  }
  // A mask of the wrong size is refused with what it is.
  wire::TrainCriticRequest bad{batch(), floats({1, 2, 3, 4, 5, 6}), floats({6, 5, 4, 3, 2, 1}), {}, 6};
  bad.loss_mask = at::ones({5}, at::kByte);
  EXPECT_NE(error_of([&] { wire::TrainCriticRequest::decode(bad.encode()); }).find("loss mask"), std::string::npos);
}

TEST(Protocol, StepMessagesRoundTrip) {
  const wire::StepRequest d = wire::StepRequest::decode(wire::StepRequest{Role::kCritic, 3e-6}.encode());
  EXPECT_EQ(d.role, Role::kCritic);
  EXPECT_EQ(d.lr, 3e-6);
  EXPECT_NE(error_of([] { wire::StepRequest::decode(wire::StepRequest{Role::kRef, 1}.encode()); }).find("does not train"),
            std::string::npos);
  wire::StepReply r;
  r.stats = {1.5, true, 2.5, 3, 4, 5, 6, 7, 8, 9};
  const wire::StepStats s = wire::StepReply::decode(r.encode()).stats;
  EXPECT_EQ(s.grad_norm, 1.5);
  EXPECT_TRUE(s.skipped);
  EXPECT_EQ(s.loss, 2.5);
  EXPECT_EQ(s.clip_tokens, 3);
  EXPECT_EQ(s.approx_kl_tokens, 4);
  EXPECT_EQ(s.entropy_sum, 5);
  EXPECT_EQ(s.tokens, 6);
  EXPECT_EQ(s.train_seconds, 7);
  EXPECT_EQ(s.step_seconds, 8);
  EXPECT_EQ(s.peak_host_mb, 9);
  EXPECT_EQ(s.peak_device_gb, 0);
  EXPECT_TRUE(s.loss_metrics.empty());
  // A policy loss's named metrics travel after the fixed scalars, their names one per line.
  r.stats.loss_metrics = {{"weight_mean", 0.75}, {"ratio.max", 3.5}};
  r.stats.peak_device_gb = 61.25;
  const wire::StepStats m = wire::StepReply::decode(r.encode()).stats;
  ASSERT_EQ(m.loss_metrics.size(), 2u);
  EXPECT_EQ(m.loss_metrics[0], (std::pair<std::string, double>{"weight_mean", 0.75}));
  EXPECT_EQ(m.loss_metrics[1], (std::pair<std::string, double>{"ratio.max", 3.5}));
  EXPECT_EQ(m.peak_host_mb, 9);
  EXPECT_EQ(m.peak_device_gb, 61.25);
  wire::Frame bad = r.encode();
  bad.text += "extra\n";  // a name without its value
  EXPECT_NE(error_of([&] { wire::StepReply::decode(bad); }).find("loss metrics has 2 elements, expected 3"), std::string::npos)
      << error_of([&] { wire::StepReply::decode(bad); });
}

TEST(Protocol, ControlMessagesRoundTrip) {
  EXPECT_EQ(wire::SyncRequest::decode(wire::SyncRequest{42}.encode()).version, 42u);
  const wire::SyncReply s = wire::SyncReply::decode(wire::SyncReply{0.05, 1.5e10}.encode());
  EXPECT_EQ(s.seconds, 0.05);
  EXPECT_EQ(s.wire_bytes, 1.5e10);
  EXPECT_TRUE(s.failed.empty());
  // A push to standalone engines: its targets, and those it failed to.
  const wire::SyncRequest push =
      wire::SyncRequest::decode(wire::SyncRequest{7, {"node3:50051", "10.0.0.2:41233"}}.encode());
  EXPECT_EQ(push.version, 7u);
  EXPECT_EQ(push.targets, (std::vector<std::string>{"node3:50051", "10.0.0.2:41233"}));
  EXPECT_EQ(wire::SyncReply::decode(wire::SyncReply{0.5, 1e6, {"node3:50051"}}.encode()).failed,
            std::vector<std::string>{"node3:50051"});
  EXPECT_EQ(wire::SaveRequest::decode(wire::SaveRequest{"out/step_000003"}.encode()).dir, "out/step_000003");
  EXPECT_EQ(wire::LoadRequest::decode(wire::LoadRequest{"ckpt/step_000001"}.encode()).dir, "ckpt/step_000001");
  wire::DoneReply::decode(wire::DoneReply{}.encode());
  wire::TraceRequest::decode(wire::TraceRequest{}.encode());
  wire::StopRequest::decode(wire::StopRequest{}.encode());
  EXPECT_EQ(wire::StopReply::decode(wire::StopReply{123.5}.encode()).peak_host_mb, 123.5);
  EXPECT_EQ(wire::EngineHello::decode(wire::EngineHello{"secret"}.encode()).token, "secret");
  EXPECT_EQ(wire::EngineAddress::decode(wire::EngineAddress{"node1:50051"}.encode()).address, "node1:50051");
  EXPECT_EQ(wire::ErrorReply::decode(wire::ErrorReply{"CUDA out of memory"}.encode()).what, "CUDA out of memory");
}

TEST(Protocol, TraceReplyRoundTrips) {
  wire::TraceReply r;
  r.names = {"score.actor", "train.actor", "sync"};
  r.begin_us = {1, 3, 5};
  r.end_us = {2, 4, 6};
  const wire::TraceReply d = wire::TraceReply::decode(r.encode());
  EXPECT_EQ(d.names, r.names);
  EXPECT_EQ(d.begin_us, r.begin_us);
  EXPECT_EQ(d.end_us, r.end_us);
  EXPECT_TRUE(wire::TraceReply::decode(wire::TraceReply{}.encode()).names.empty());
}

// Sequence parallelism: the controller's cut and the counts each slice's answers are checked by.
TEST(Protocol, SlicesOfAPackedRowCoverItsRowsAndResponseTokensInOrder) {
  const wire::PackedSequences whole = batch();  // rows 0-4: prompt 2 (response rows 1-3); rows 5-8: prompt 1 (rows 5-7)
  EXPECT_TRUE(whole.whole());
  EXPECT_EQ(whole.rows(), 9);
  for (int parts : {1, 2, 3, 4, 9, 12}) {
    const auto slices = whole.cut(parts);
    ASSERT_EQ(slices.size(), static_cast<size_t>(parts));
    int64_t rows = 0, responses = 0, ends = 0;
    for (const auto& s : slices) {
      EXPECT_EQ(s.first_row, rows) << parts;
      EXPECT_EQ(s.response_before(), responses) << parts;
      EXPECT_EQ(s.ends_before(), ends) << parts;
      // Each slice survives the wire, window and all.
      const wire::ScoreRequest d = wire::ScoreRequest::decode(wire::ScoreRequest{s, 1.0}.encode());
      EXPECT_EQ(d.batch.first_row, s.first_row);
      EXPECT_EQ(d.batch.next_token, s.next_token);
      EXPECT_EQ(d.batch.response_tokens(), s.response_tokens());
      if (s.held() > 0 && s.first_row + s.held() < 9)
        EXPECT_EQ(s.next_token, whole.tokens[s.first_row + s.held()].item<int64_t>()) << parts;
      rows += s.held();
      responses += s.response_tokens();
      ends += s.ends();
    }
    EXPECT_EQ(rows, 9);
    EXPECT_EQ(responses, 6);
    EXPECT_EQ(ends, 2);
  }
  // Two slices: rows 0-4 hold response rows 1-3 and the first sequence's end; rows 5-8 the rest.
  const auto two = whole.cut(2);
  EXPECT_EQ(two[0].response_tokens(), 3);
  EXPECT_EQ(two[0].ends(), 1);
  EXPECT_EQ(two[1].response_tokens(), 3);
  EXPECT_EQ(two[1].next_token, 0);
  EXPECT_EQ(two[0].next_token, 1);
}

TEST(Protocol, AFrameThatDisagreesWithItselfIsRefusedByName) {
  wire::Frame f = wire::ScoreRequest{batch(), 1.0}.encode();
  f.tensors[3] = longs({5, 0});  // rows past the end of the packed row
  EXPECT_NE(error_of([&] { wire::ScoreRequest::decode(f); }).find("malformed 'score' message: rows [5, 14) of a packed row of 9"),
            std::string::npos);
  wire::Frame g = wire::ScoreRequest{batch(), 1.0}.encode();
  g.tensors[2] = longs({5, 1});  // a prompt as long as its sequence: no response
  EXPECT_NE(error_of([&] { wire::ScoreRequest::decode(g); }).find("sample 0: prompt of 5 tokens in a sequence of 5"),
            std::string::npos);
  // A reply where a request was expected, and an error reply where a result was.
  EXPECT_NE(error_of([] { wire::StepRequest::decode(wire::DoneReply{}.encode()); }).find("expected a 'step' message, got 'done'"),
            std::string::npos);
  EXPECT_EQ(error_of([] { wire::StepReply::decode(wire::ErrorReply{"rank 3 ran out of memory"}.encode()); }),
            "rank 3 ran out of memory");
  wire::Frame h = wire::TrainActorRequest{batch(), floats({1, 2, 3, 4, 5, 6}), floats({1, 2, 3, 4, 5, 6}), {}, {}, {}, 0, 0}.encode();
  EXPECT_NE(error_of([&] { wire::TrainActorRequest::decode(h); }).find("normalizer 0"), std::string::npos);
  wire::TrainActorRequest rows{batch(), floats({1, 2, 3, 4, 5, 6}), floats({1, 2, 3, 4, 5, 6}), {}, {}, {}, 1, 0};
  rows.step_rows = -3;  // the router losses' weights
  EXPECT_NE(error_of([&] { wire::TrainActorRequest::decode(rows.encode()); }).find("step_rows -3"), std::string::npos);
}

}  // namespace
}  // namespace tiller::controller

namespace tiller::controller {
namespace {

// Routing replay: the engine's experts travel from the rollout (samples with and without routes,
// the last token's row never recorded) in the packed batch, through encode and decode, and are
// cut with the rows under sequence parallelism.
TEST(Protocol, RoutesTravelWithTheBatchAndAreCutWithItsRows) {
  Rollout ro;
  const std::vector<uint64_t> none;
  ro.add(0, 0, {5, 6}, {7, 8, 9}, {-1, -1, -1}, false, {}, none, 1);
  // Width 4 (2 sparse layers x top-2): rows for the 4 computed tokens of 5.
  ro.set_routes({0, 1, 2, 3, 1, 2, 3, 0, 2, 3, 0, 1, 3, 0, 1, 2}, 4);
  ro.add(0, 1, {1}, {2, 3, 4}, {-1, -1, -1}, false, {}, none, 1);  // no routes recorded
  EXPECT_THROW(ro.set_routes({0, 1, 2}, 4), std::exception);  // not whole rows
  const wire::PackedSequences b = pack_sequences(ro, {0, 1});
  ASSERT_TRUE(b.routes.defined());
  ASSERT_EQ(b.routes.size(0), 9);
  ASSERT_EQ(b.routes.size(1), 4);
  EXPECT_EQ(b.routes[3][2].item<int16_t>(), 1);
  for (int64_t r : {4, 5, 6, 7, 8}) EXPECT_EQ(b.routes[r][0].item<int16_t>(), -1) << "row " << r;
  const wire::ScoreRequest d = wire::ScoreRequest::decode(wire::ScoreRequest{b, 1.0}.encode());
  ASSERT_TRUE(d.batch.routes.defined());
  EXPECT_TRUE(at::equal(d.batch.routes, b.routes));
  int64_t rows = 0;
  for (const wire::PackedSequences& s : b.cut(2)) {
    ASSERT_TRUE(s.routes.defined());
    EXPECT_TRUE(at::equal(s.routes, b.routes.narrow(0, s.first_row, s.held())));
    const wire::ScoreRequest ds = wire::ScoreRequest::decode(wire::ScoreRequest{s, 1.0}.encode());
    EXPECT_TRUE(at::equal(ds.batch.routes, s.routes));
    rows += s.held();
  }
  EXPECT_EQ(rows, 9);
  // Without routes nothing extra travels.
  EXPECT_FALSE(wire::ScoreRequest::decode(wire::ScoreRequest{batch(), 1.0}.encode()).batch.routes.defined());
}

}  // namespace
}  // namespace tiller::controller
