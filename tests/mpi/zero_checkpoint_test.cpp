// ZeRO-3 state on disk and on the host: resume equality, offload and reload, the host optimizer's
// checkpoints, the cast-while-gathering shard, atomic saves under faults, refusals, HF export.
#include "zero_fixture.h"

namespace tiller::test {
namespace {

// Trains `steps` steps of fixed data, starting at `first`.
void train(ShardedModel& m, const ModelConfig& cfg, int first, int steps) {
  for (int s = first; s < first + steps; ++s) {
    const MicroBatch mb = micro_batch(cfg, 10 + s, comm().rank(), 0, comm().size());
    loss_of(forward(m, mb), mb, 20).backward();
    m.step(1e-2);
  }
}

void expect_same_parameters(const NamedTensors& a, const NamedTensors& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [n, t] : a) {
    if (on_gpu()) {  // flash attention's backward accumulates with atomics: not bitwise repeatable
      EXPECT_LT((t - b.at(n)).abs().max().item<double>(), 1e-3) << what << ": " << n;
    } else {
      EXPECT_TRUE(at::equal(t, b.at(n))) << what << ": " << n;
    }
  }
}

TEST(Zero, ResumeContinuesAsIfNeverStopped) {
  const ModelConfig cfg = config("tiny-qwen2");
  const std::string dir = scratch("resume");
  const auto o = options(Head::kLm, {0.9, 0.95, 1e-8, 0.05}, 0.5);
  ShardedModel a(cfg, comm(), o);
  a.load(model::init_weights(cfg, Head::kLm, 3, at::kFloat), "init");
  train(a, cfg, 0, 2);
  zero::save_checkpoint(a, dir);
  EXPECT_EQ(zero::checkpoint_steps(dir), 2);
  EXPECT_FALSE(fs::exists(dir + ".tmp"));
  train(a, cfg, 2, 2);

  ShardedModel b(cfg, comm(), o);
  b.load(model::init_weights(cfg, Head::kLm, 99, at::kFloat), "other init");
  zero::load_checkpoint(b, dir);
  EXPECT_EQ(b.steps(), 2);
  train(b, cfg, 2, 2);
  expect_same_parameters(b.gather_parameters(), a.gather_parameters(), "resumed vs uninterrupted");
  EXPECT_EQ(b.steps(), 4);
}

// A LoRA model's checkpoint holds its adapters and their moments (not the frozen base, which the
// role loads from the source model): a model of the same base resumes from it as if never
// stopped; other LoRA settings, or a checkpoint of the other kind, are refused by name; export
// refuses it.
TEST(Zero, LoraCheckpointResumesTheAdapters) {
  const ModelConfig cfg = config("tiny-qwen2");
  const std::string dir = scratch("lora_resume");
  const NamedTensors base = model::init_weights(cfg, Head::kLm, 3, at::kFloat);
  auto o = options(Head::kLm, {0.9, 0.95, 1e-8, 0.05}, 0.5);
  o.lora.rank = 4;
  o.lora.alpha = 8;
  o.lora.targets.fill(true);
  ShardedModel a(cfg, comm(), o);
  a.load(base, "init");
  train(a, cfg, 0, 2);
  zero::save_checkpoint(a, dir);
  EXPECT_EQ(zero::checkpoint_steps(dir), 2);
  EXPECT_TRUE(fs::exists(dir + "/lora.safetensors"));
  train(a, cfg, 2, 2);

  o.lora_seed = 99;  // other initial adapters: the checkpoint's must replace them
  ShardedModel b(cfg, comm(), o);
  b.load(base, "init");
  zero::load_checkpoint(b, dir);
  EXPECT_EQ(b.steps(), 2);
  train(b, cfg, 2, 2);
  expect_same_parameters(b.lora_parameters(), a.lora_parameters(), "resumed adapters vs uninterrupted");
  expect_same_parameters(b.gather_parameters(), a.gather_parameters(), "the frozen bases");

  auto refused = [&](const zero::ShardedModelOptions& opts) {
    ShardedModel c(cfg, comm(), opts);
    c.load(base, "init");
    try {
      zero::load_checkpoint(c, dir);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  auto other = o;
  other.lora.rank = 8;
  EXPECT_NE(refused(other).find("resume with the same LoRA settings"), std::string::npos);
  auto full = o;
  full.lora = {};
  EXPECT_NE(refused(full).find("holds LoRA adapters; this role trains no adapters"), std::string::npos);
  if (comm().rank() == 0)
    EXPECT_THROW(zero::export_hf(dir, scratch("lora_export"), at::kFloat), ConfigError);
}

// roles.<r>.offload: the state leaves the device and comes back bit for bit; a forward (scoring)
// runs meanwhile from the compute shards; the next step is the one without offload.
TEST(Zero, OffloadThenReloadIsBitExactAndTheNextStepEqualsOneWithout) {
  const ModelConfig cfg = config("tiny-qwen2");
  const auto o = options(Head::kLm, {0.9, 0.95, 1e-8, 0.05}, 0.5);
  ShardedModel a(cfg, comm(), o), b(cfg, comm(), o);
  for (ShardedModel* m : {&a, &b}) {
    m->load(model::init_weights(cfg, Head::kLm, 3, at::kFloat), "init");
    train(*m, cfg, 0, 2);
  }
  const zero::ShardMemory before = b.memory();
  // Moments, the fp32 masters unless they are the compute shards, and the step counts (a few fp32
  // scalars). The gradient accumulators hold nothing between steps: freed, not moved.
  const int64_t state = before.optimizer + (o.compute_dtype == at::kFloat ? 0 : before.parameters * 4 / 6);
  const int64_t moved = b.offload_state();
  EXPECT_GE(moved, state);
  EXPECT_LT(moved, state + 4096);
  EXPECT_TRUE(b.state_offloaded());
  EXPECT_EQ(b.offload_state(), 0);  // already off
  const MicroBatch mb = micro_batch(cfg, 7, comm().rank(), 0, comm().size());
  {
    c10::AutoGradMode no_grad(false);
    EXPECT_TRUE(at::equal(forward(b, mb), forward(a, mb))) << "scoring while offloaded";
  }
  EXPECT_THROW(b.step(1e-2), Error);
  EXPECT_THROW(b.unit_states(), Error);
  EXPECT_GT(b.reload_state(), 0);
  EXPECT_FALSE(b.state_offloaded());
  const auto sa = a.unit_states(), sb = b.unit_states();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t u = 0; u < sa.size(); ++u) {
    EXPECT_TRUE(at::equal(sa[u].master.cpu(), sb[u].master.cpu())) << sa[u].name;
    EXPECT_TRUE(at::equal(sa[u].exp_avg.cpu(), sb[u].exp_avg.cpu())) << sa[u].name;
    EXPECT_TRUE(at::equal(sa[u].exp_avg_sq.cpu(), sb[u].exp_avg_sq.cpu())) << sa[u].name;
  }
  train(a, cfg, 2, 1);
  train(b, cfg, 2, 1);
  expect_same_parameters(b.gather_parameters(), a.gather_parameters(), "offloaded and reloaded vs never");

  // With a gradient pending (a backward, no step yet) the accumulators move too, and the step
  // after the reload is the one without offload.
  for (ShardedModel* m : {&a, &b}) {
    const MicroBatch pending = micro_batch(cfg, 31, comm().rank(), 0, comm().size());
    loss_of(forward(*m, pending), pending, 20).backward();
  }
  const int64_t with_grads = b.offload_state();
  EXPECT_GE(with_grads, state + before.gradients);
  EXPECT_LT(with_grads, state + before.gradients + 4096);
  b.reload_state();
  a.step(1e-2);
  b.step(1e-2);
  expect_same_parameters(b.gather_parameters(), a.gather_parameters(), "offloaded with a pending gradient");
}

// The state a host optimizer keeps: the device holds the compute shard and the gradient
// accumulator only; checkpoints written by either optimizer load into the other and training goes
// on as if never stopped; an offload for the hybrid engine moves nothing (the state is on the
// host already) and frees the accumulators; the next step equals one without it.
TEST(Zero, OptimizerOnTheHostCheckpointsResumesAndOffloads) {
  const ModelConfig cfg = config("tiny-qwen2");
  const std::string dir = scratch("host_adamw");
  // eps above the rounding noise of gradients that are zero in exact arithmetic (see
  // expect_sharded_equals_unsharded): the two optimizers' last-bit differences stay that small.
  auto o = options(Head::kLm, {0.9, 0.95, 1e-4, 0.05}, 0.5);
  o.optimizer_on_host = true;
  o.optimizer_threads = 3;
  ShardedModel a(cfg, comm(), o);
  a.load(model::init_weights(cfg, Head::kLm, 3, at::kFloat), "init");
  const zero::ShardMemory mem = a.memory();
  EXPECT_EQ(mem.optimizer, 0);
  EXPECT_EQ(mem.parameters, mem.gradients * at::elementSize(compute_dtype()) / 4);
  EXPECT_GE(mem.host, 3 * mem.gradients);  // masters and two moments
  ASSERT_NE(a.host_optimizer(), nullptr);
  EXPECT_EQ(a.host_optimizer()->threads(), 3);
  train(a, cfg, 0, 2);
  zero::save_checkpoint(a, dir);
  train(a, cfg, 2, 2);

  // Resumed with the host optimizer, and with the device's: the same parameters as uninterrupted
  // (the device's AdamW within fp32 rounding of the host's over 2 steps).
  ShardedModel b(cfg, comm(), o);
  zero::load_checkpoint(b, dir);
  EXPECT_EQ(b.steps(), 2);
  train(b, cfg, 2, 2);
  expect_same_parameters(b.gather_parameters(), a.gather_parameters(), "host optimizer resumed vs uninterrupted");
  auto on_device = o;
  on_device.optimizer_on_host = false;
  ShardedModel c(cfg, comm(), on_device);
  zero::load_checkpoint(c, dir);
  train(c, cfg, 2, 2);
  const NamedTensors pa = a.gather_parameters(), pc = c.gather_parameters();
  for (const auto& [n, t] : pa)
    EXPECT_LT((t - pc.at(n)).abs().max().item<double>(), on_gpu() ? 2e-2 : 1e-5) << "device optimizer resumed: " << n;

  // The hybrid engine's offload: nothing moves, the accumulators are freed, scoring still runs.
  const int64_t before = b.memory().gradients;
  EXPECT_EQ(b.offload_state(), 0);
  EXPECT_TRUE(b.state_offloaded());
  const MicroBatch mb = micro_batch(cfg, 7, comm().rank(), 0, comm().size());
  {
    c10::AutoGradMode no_grad(false);
    EXPECT_TRUE(at::equal(forward(b, mb), forward(a, mb))) << "scoring while offloaded";
  }
  EXPECT_THROW(b.step(1e-2), Error);
  b.reload_state();
  EXPECT_EQ(b.memory().gradients, before);
  train(a, cfg, 4, 1);
  train(b, cfg, 4, 1);
  expect_same_parameters(b.gather_parameters(), a.gather_parameters(), "after an offload");
}

// train.compute_shard cast: no persistent compute-dtype shard; each gather casts the fp32 master
// first. In bf16 (on the CPU too) the gathered weights are the same bits as the persistent shard's,
// so training, scoring, an offload for generation and a checkpoint round trip equal the kept
// shard's bit for bit, with blocks recomputed and with activations kept (the graph's parked
// units), on 1, 2 and 4 ranks. The memory saved is the shard's.
TEST(Zero, CastWhileGatheringEqualsThePersistentShardBitForBit) {
  const ModelConfig cfg = config("tiny-qwen3");  // untied head: the LM head's own unit
  for (zero::Recompute mode : {zero::Recompute::kBlocks, zero::Recompute::kNone}) {
    auto keep = options(Head::kLm, {0.9, 0.95, 1e-8, 0.05}, 0.5);
    keep.compute_dtype = at::kBFloat16;
    keep.recompute = mode;
    auto cast = keep;
    cast.keep_compute_shard = false;
    ShardedModel a(cfg, comm(), keep), b(cfg, comm(), cast);
    for (ShardedModel* m : {&a, &b}) m->load(model::init_weights(cfg, Head::kLm, 3, at::kFloat), "init");
    EXPECT_EQ(a.memory().parameters - b.memory().parameters, a.memory().gradients / 2) << "the bf16 shard";
    for (const auto& u : b.shards()) EXPECT_FALSE(u.compute.defined()) << u.name;
    for (int s = 0; s < 3; ++s) {
      train(a, cfg, s, 1);
      train(b, cfg, s, 1);
      expect_same_parameters(b.gather_parameters(), a.gather_parameters(),
                             fmt::format("cast vs kept, {} step {}", zero::recompute_name(mode), s));
    }
    const MicroBatch mb = micro_batch(cfg, 9, comm().rank(), 0, comm().size());
    c10::AutoGradMode no_grad(false);
    const at::Tensor want = forward(a, mb);
    EXPECT_TRUE(on_gpu() || at::equal(forward(b, mb), want)) << "scoring";
    b.offload_state();  // compute shards made for the scoring meanwhile
    for (const auto& u : b.shards()) EXPECT_TRUE(u.compute.defined()) << u.name;
    EXPECT_TRUE(on_gpu() || at::equal(forward(b, mb), want)) << "scoring while offloaded";
    b.reload_state();
    for (const auto& u : b.shards()) EXPECT_FALSE(u.compute.defined()) << u.name;
  }
}

// zero_grad() leaves the accumulators as they are (the next backward overwrites them): a step with
// no backward since then must see zero gradients, not the last step's, also after an offload
// freed their memory.
TEST(Zero, AStepWithNoBackwardSinceZeroGradSeesNoGradient) {
  const ModelConfig cfg = config("tiny-qwen2");
  const auto o = options(Head::kLm, {0.9, 0.95, 1e-8, 0.05}, 0.5);
  ShardedModel m(cfg, comm(), o);
  m.load(model::init_weights(cfg, Head::kLm, 3, at::kFloat), "init");
  const MicroBatch mb = micro_batch(cfg, 12, comm().rank(), 0, comm().size());
  loss_of(forward(m, mb), mb, 20).backward();
  EXPECT_GT(m.step(1e-2).grad_norm, 0);
  EXPECT_EQ(m.step(1e-2).grad_norm, 0) << "the step before's gradients";
  loss_of(forward(m, mb), mb, 20).backward();
  m.zero_grad();
  EXPECT_EQ(m.step(1e-2).grad_norm, 0) << "a gradient from before zero_grad";
  loss_of(forward(m, mb), mb, 20).backward();
  EXPECT_GT(m.step(1e-2).grad_norm, 0);
  m.offload_state();
  m.reload_state();
  EXPECT_EQ(m.step(1e-2).grad_norm, 0) << "the reloaded accumulators' contents";
}

TEST(Zero, FailedSaveLeavesThePreviousCheckpoint) {
  const ModelConfig cfg = config("tiny-llama");
  const std::string dir = scratch("atomic");
  const int last = comm().size() - 1;
  ShardedModel m(cfg, comm(), options(Head::kLm, {}, 1.0));
  m.load(model::init_weights(cfg, Head::kLm, 4, at::kFloat), "init");
  train(m, cfg, 0, 1);
  zero::save_checkpoint(m, dir);
  const NamedTensors saved = m.gather_parameters();
  train(m, cfg, 1, 1);
  zero::SaveOptions fail;
  fail.after_write = [&](int rank) {
    if (rank == last) throw IoError("disk full (injected)");
  };
  try {
    zero::save_checkpoint(m, dir, fail);
    ADD_FAILURE() << "the save did not fail";
  } catch (const IoError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(fmt::format("rank {} failed to write its shard", last)), std::string::npos) << msg;
    EXPECT_NE(msg.find("previous checkpoint is untouched"), std::string::npos) << msg;
  }
  EXPECT_FALSE(fs::exists(dir + ".tmp"));
  EXPECT_EQ(zero::checkpoint_steps(dir), 1);
  ShardedModel back(cfg, comm(), options(Head::kLm, {}, 1.0));
  zero::load_checkpoint(back, dir);
  expect_same_parameters(back.gather_parameters(), saved, "after a failed save");
}

// The file system failing under a save: a full disk part-way through the last rank's shard, a
// failed fsync of meta.json, a failed rename of the new directory into place (after the old one
// was moved aside). Each save fails with IoError and the checkpoint that loads is the previous
// one, bit for bit. A failed fsync of the parent after the rename also fails the save (so the
// controller does not commit the step), with a whole checkpoint in place.
TEST(Zero, FileSystemFaultsNeverHalfCommitASave) {
  const ModelConfig cfg = config("tiny-llama");
  const std::string dir = scratch("fs_faults");
  const int last = comm().size() - 1;
  ShardedModel m(cfg, comm(), options(Head::kLm, {}, 1.0));
  m.load(model::init_weights(cfg, Head::kLm, 5, at::kFloat), "init");
  train(m, cfg, 0, 1);
  zero::save_checkpoint(m, dir);
  const NamedTensors saved = m.gather_parameters();
  train(m, cfg, 1, 1);
  const std::vector<std::pair<std::string, std::function<void(test::FaultyFileSystem&)>>> faults = {
      {"full disk", [&](auto& f) { f.full_disk_in = fmt::format("rank_{:05d}.safetensors", last); f.disk_left = 1000; }},
      {"meta.json fsync", [](auto& f) { f.fail_sync_in = "meta.json"; }},
      {"rename into place", [&](auto& f) { f.fail_rename_exact_to = dir; }},
  };
  for (const auto& [name, arm] : faults) {
    test::FaultyFileSystem faulty;
    if (comm().rank() == 0 || name == "full disk") arm(faulty);
    {
      FileSystem::Override use(faulty);
      EXPECT_THROW(zero::save_checkpoint(m, dir), IoError) << name;
    }
    EXPECT_EQ(zero::checkpoint_steps(dir), 1) << name;
    ShardedModel back(cfg, comm(), options(Head::kLm, {}, 1.0));
    zero::load_checkpoint(back, dir);
    expect_same_parameters(back.gather_parameters(), saved, "after a save that met: " + name);
  }
  test::FaultyFileSystem parent;
  if (comm().rank() == 0) parent.fail_sync_dir_exact = parent_dir(dir);
  {
    FileSystem::Override use(parent);
    EXPECT_THROW(zero::save_checkpoint(m, dir), IoError);
  }
  EXPECT_EQ(zero::checkpoint_steps(dir), 2);
  const NamedTensors now = m.gather_parameters();
  ShardedModel back(cfg, comm(), options(Head::kLm, {}, 1.0));
  zero::load_checkpoint(back, dir);
  expect_same_parameters(back.gather_parameters(), now, "after a failed fsync of the parent");
  zero::save_checkpoint(m, dir);  // and without faults a save succeeds
  EXPECT_FALSE(fs::exists(dir + ".old"));
}

TEST(Zero, LoadRefusesWhatDoesNotFit) {
  const ModelConfig cfg = config("tiny-llama");
  const std::string dir = scratch("refuse");
  ShardedModel m(cfg, comm(), options(Head::kLm, {}, 1.0));
  zero::save_checkpoint(m, dir);
  auto expect_error = [&](ShardedModel& into, const std::string& needle) {
    try {
      zero::load_checkpoint(into, dir);
      ADD_FAILURE() << "loaded; expected: " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  ShardedModel other(config("tiny-qwen3"), comm(), options(Head::kLm, {}, 1.0));
  expect_error(other, "is it the same model shape?");
  ShardedModel critic(cfg, comm(), options(Head::kValue, {}, 1.0));
  expect_error(critic, "with the lm head, this role needs the value head");
  comm().all_reduce(at::zeros({1}, mpi_test_env().device.dtype(at::kFloat)))->wait();  // every rank has read
  if (comm().rank() == 0) {
    auto meta = nlohmann::json::parse(*read_file(dir + "/meta.json"));
    meta["world"] = comm().size() + 1;
    write_file_atomic(dir + "/meta.json", meta.dump());
  }
  comm().all_reduce(at::zeros({1}, mpi_test_env().device.dtype(at::kFloat)))->wait();
  expect_error(m, fmt::format("saved by a group of {} ranks, this group has {}", comm().size() + 1, comm().size()));
}

TEST(Zero, ExportRoundTripsBothHeads) {
  for (Head head : {Head::kLm, Head::kValue}) {
    const ModelConfig cfg = config("tiny-qwen2");
    const std::string dir = scratch(head == Head::kLm ? "export_lm" : "export_value");
    ShardedModel m(cfg, comm(), options(head, {}, 1.0));
    m.load(model::init_weights(cfg, head, 6, at::kFloat), "init");
    train(m, cfg, 0, 1);
    zero::save_checkpoint(m, dir + "/ckpt");
    const NamedTensors params = m.gather_parameters();
    if (comm().rank() != 0) continue;  // export is one process
    zero::export_hf(dir + "/ckpt", dir + "/hf", at::kFloat);
    const auto loaded = model::load_model(dir + "/hf", head, at::kFloat, at::kCPU);
    ASSERT_EQ(loaded.tensors.size(), params.size());
    for (const auto& [n, t] : params) EXPECT_TRUE(at::equal(loaded.tensors.at(n), t.cpu().to(at::kFloat))) << n;
  }
}

// Writes a trained, exported model and the logits tiller computes for it; tests/zero/export_check.sh
// then checks them with transformers. Runs only when TILLER_ZERO_EXPORT_DIR is set.
TEST(ZeroExport, CheckpointForTransformers) {
  const char* out = std::getenv("TILLER_ZERO_EXPORT_DIR");
  if (!out) GTEST_SKIP() << "TILLER_ZERO_EXPORT_DIR is not set";
  const ModelConfig cfg = config("tiny-qwen2");
  ShardedModel m(cfg, comm(), options(Head::kLm, {}, 1.0));
  m.load(model::init_weights(cfg, Head::kLm, 8, at::kFloat), "init");
  train(m, cfg, 0, 2);
  zero::save_checkpoint(m, std::string(out) + "/ckpt");
  const NamedTensors params = m.gather_parameters();
  if (comm().rank() != 0) return;
  const std::vector<std::vector<int64_t>> inputs{{1, 5, 9, 200, 31}, {7, 7, 7, 400, 2, 3, 11, 12}};
  NamedTensors fp32;
  for (const auto& [n, t] : params) fp32[n] = t.cpu().to(at::kFloat);
  const auto w = model::bind_weights(cfg, fp32, Head::kLm, "trained");
  NamedTensors logits;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto batch = model::PackedBatch::pack({inputs[i]}, at::kCPU);
    logits["logits_" + std::to_string(i)] = model::logits(model::forward_hidden(cfg, w, batch), w.lm_head);
  }
  model::write_safetensors(std::string(out) + "/reference_logits.safetensors", logits);
  nlohmann::json manifest;
  manifest["inputs"] = inputs;
  manifest["models"] = {"hf"};
  write_file_atomic(std::string(out) + "/manifest.json", manifest.dump());
}

}  // namespace
}  // namespace tiller::test
