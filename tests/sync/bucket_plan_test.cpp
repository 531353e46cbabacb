// The bucket plan without communication: the whole data path of a sync simulated on the host.
// Actor shards are filled from a full model; each bucket is packed from its sender's shards as
// the sender does; each engine TP rank places its slices as the receiver does; the result must
// equal the engine's own slicing of the full model (slice_for_tp), bit for bit.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tiller/core/error.h"
#include "tiller/engine/engine_weights.h"
#include "tiller/model/weights.h"
#include "tiller/sync/bucket_plan.h"
#include "tiller/zero/flat_layout.h"

namespace tiller {
namespace {

// Runs `plan` on the host: returns each TP rank's parameters by name.
std::vector<model::NamedTensors> simulate(const sync::BucketPlan& plan, const model::ModelConfig& cfg,
                                          const model::NamedTensors& full) {
  const auto layouts = zero::model_layouts(cfg, model::Head::kLm, plan.senders);
  std::vector<std::vector<at::Tensor>> shards(plan.senders);  // [rank][unit]
  for (int r = 0; r < plan.senders; ++r)
    for (const auto& l : layouts) {
      at::Tensor s = at::full({l.shard_numel()}, -7.0f);  // padding must never land anywhere
      l.fill_shard(r, full, s, "test");
      shards[r].push_back(s);
    }
  std::vector<model::NamedTensors> out(plan.tp_size);
  for (int t = 0; t < plan.tp_size; ++t)
    for (const auto& p : plan.params) out[t][p.name] = at::full(sync::local_shape(p, plan.tp_size), -1.0f);
  for (const auto& b : plan.buckets) {
    at::Tensor wire = at::full({b.numel}, -3.0f);
    for (const auto& s : b.sources)
      wire.narrow(0, s.bucket_offset, s.numel).copy_(shards[b.sender][s.unit].narrow(0, s.shard_begin, s.numel));
    for (int t = 0; t < plan.tp_size; ++t)
      for (const auto& g : b.segments)
        for (const auto& c : sync::slice_copies(plan, g, t)) {
          at::Tensor d = out[t][plan.params[c.param].name].view({-1});
          d.as_strided({c.rows, c.cols}, {c.dst_stride, 1}, c.dst_offset)
              .copy_(wire.as_strided({c.rows, c.cols}, {c.src_stride, 1}, c.src_offset));
        }
  }
  return out;
}

TEST(BucketPlan, SimulatedSyncPlacesEveryTpSliceBitForBit) {
  for (const char* name : {"tiny-qwen2", "tiny-llama"}) {
    const model::ModelConfig cfg = model::preset(name);
    const model::NamedTensors full = model::init_weights(cfg, model::Head::kLm, 5, at::kFloat);
    const model::ModelWeights bound = model::bind_weights(cfg, full, model::Head::kLm, name);
    for (int senders : {1, 2, 3})
      for (int tp : {1, 2})
        for (int64_t bytes : {int64_t{100}, int64_t{4096}, int64_t{40000}, int64_t{1} << 40}) {
          SCOPED_TRACE(fmt::format("{} senders {} tp {} bucket {} B", name, senders, tp, bytes));
          const sync::BucketPlan plan = sync::make_bucket_plan(cfg, senders, tp, "fp32", bytes);
          ASSERT_FALSE(plan.buckets.empty());
          for (size_t k = 0; k < plan.buckets.size(); ++k) {
            EXPECT_LE(plan.buckets[k].numel * 4, std::max<int64_t>(bytes, 4));
            EXPECT_EQ(plan.buckets[k].sender, static_cast<int>(k % senders)) << "bucket " << k;
          }
          if (bytes == (int64_t{1} << 40)) EXPECT_EQ(plan.buckets.size(), static_cast<size_t>(senders));
          const auto got = simulate(plan, cfg, full);
          for (int t = 0; t < tp; ++t) {
            const model::NamedTensors want =
                model::named_weights(cfg, engine::slice_for_tp(cfg, bound, t, tp), model::Head::kLm);
            ASSERT_EQ(got[t].size(), want.size());
            for (const auto& [n, w] : want) {
              ASSERT_TRUE(got[t].count(n)) << n;
              EXPECT_TRUE(at::equal(got[t].at(n), w)) << n << " on TP rank " << t;
            }
          }
        }
  }
}

TEST(BucketPlan, JsonRoundTripAndCorruptionIsRefused) {
  const model::ModelConfig cfg = model::preset("tiny-qwen2");
  const sync::BucketPlan plan = sync::make_bucket_plan(cfg, 2, 2, "bf16", 3000);
  const std::string text = plan.to_json();
  const sync::BucketPlan back = sync::BucketPlan::from_json(text, "test");
  EXPECT_EQ(back.id, plan.id);
  EXPECT_EQ(back.to_json(), text);
  EXPECT_EQ(back.wire_bytes(), plan.wire_bytes());
  // Another bucket size is another plan.
  EXPECT_NE(sync::make_bucket_plan(cfg, 2, 2, "bf16", 3002).id, plan.id);

  auto refused = [](const std::string& t, const std::string& needle) {
    try {
      sync::BucketPlan::from_json(t, "engine0");
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("engine0"), std::string::npos) << e.what();
    }
  };
  refused("{not json", "malformed bucket plan");
  refused("{\"format\": \"other\"}", "not a bucket plan");
  std::string altered = text;
  altered.replace(altered.find("\"tp_size\":2"), 11, "\"tp_size\":1");
  refused(altered, "does not match its contents");
  // Plans whose id matches their contents but which leave a parameter out or send it twice.
  sync::BucketPlan gap = plan;
  gap.buckets.back().segments.pop_back();
  gap.id = gap.content_hash();
  refused(gap.to_json(), "never sent");
  sync::BucketPlan twice = plan;
  twice.buckets.back().segments.push_back(twice.buckets.back().segments.front());
  twice.id = twice.content_hash();
  refused(twice.to_json(), "sent twice");
}

TEST(BucketPlan, SliceRulesMatchTheEngineSlicing) {
  const model::ModelConfig cfg = model::preset("tiny-qwen2");
  const model::NamedTensors full = model::init_weights(cfg, model::Head::kLm, 1, at::kFloat);
  const model::ModelWeights bound = model::bind_weights(cfg, full, model::Head::kLm, "tiny");
  const auto sliced = model::named_weights(cfg, engine::slice_for_tp(cfg, bound, 1, 2), model::Head::kLm);
  for (const auto& [n, t] : full) {
    const sync::PlanParam p{n, t.sizes().vec(), sync::tp_split_dim(n)};
    EXPECT_EQ(sliced.at(n).sizes().vec(), sync::local_shape(p, 2)) << n;
  }
  EXPECT_EQ(sync::tp_split_dim("model.layers.0.self_attn.o_proj.weight"), 1);
  EXPECT_EQ(sync::tp_split_dim("model.layers.0.self_attn.q_proj.bias"), 0);
  EXPECT_EQ(sync::tp_split_dim("model.embed_tokens.weight"), -1);
}

}  // namespace
}  // namespace tiller
