#include "offline/offline_run.h"

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <system_error>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>

#include "tiller/algo/preference.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/files.h"
#include "tiller/core/logging.h"
#include "tiller/dist/mpi_env.h"
#include "tiller/dist/rank_plan.h"
#include "tiller/model/lora.h"
#include "tiller/model/safetensors.h"
#include "tiller/model/storage_swap.h"
#include "tiller/offline/offline.h"
#include "tiller/text/chat_template.h"
#include "tiller/text/tokenizer.h"
#include "tiller/zero/checkpoint.h"

namespace tiller::offline {

namespace fs = std::filesystem;

OfflineRun::OfflineRun(const JobConfig& c, dist::MpiEnv& env, const std::string& n, model::Head h)
    : cfg(c), name(n), head(h), checkpoints_(c.checkpoint.dir, c.checkpoint.keep_last) {
  const int gpus = at::detail::getCUDAHooks().getNumGPUs();
  const dist::DeviceChoice placed =
      dist::choose_device(cfg.cluster, gpus, dist::MpiEnv::have_nccl(), env.rank(), env.hostname());
  const bool cpu = placed.cpu;
  const BackendKind backend = placed.backend;

  rank = env.rank();
  world = env.size();
  if (world != cfg.roles.actor.gpus)
    throw ConfigError(fmt::format("tiller {} trains roles.actor over every rank: roles.actor.gpus = {}, the job has {} "
                                  "ranks; run it with mpirun -np {}",
                                  name, cfg.roles.actor.gpus, world, cfg.roles.actor.gpus));
  log::init(rank, name, log::parse_level(cfg.logging.level, "logging.level"));
  world_comm_ = env.world(cfg.timeouts.startup_s);
  const dist::NodeMap nodes = env.node_map(static_cast<int>(cfg.cluster.gpus_per_node), cpu, cfg.timeouts.startup_s);
  if (!cpu) {
    const int gpu = nodes.local_position(rank).index % gpus;
    device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(gpu));
    c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(device);
  }
  // The default generators, whose states checkpoints save, from the run's seed and the rank.
  zero::seed_default_generators(static_cast<uint64_t>(cfg.run.seed), rank, device);
  if (backend == BackendKind::kNccl) {
    device_comm_ = dist::MpiEnv::nccl(*world_comm_, device.index(), name, cfg.timeouts.startup_s);
    comm_ = device_comm_.get();
  } else {
    comm_ = world_comm_.get();
  }
  comm_->set_timeout(cfg.timeouts.collective_s);
  world_comm_->set_timeout(cfg.timeouts.collective_s);

  if (cfg.roles.actor.model.empty()) throw ConfigError(fmt::format("roles.actor.model: tiller {} needs the model to train", name));
  model_config = model::load_model_config(cfg.roles.actor.model);
  attention_tokens = model::attention_cost_tokens(model_config);
  // The plan before any allocation; every rank takes the least-memory choice of any.
  int64_t gpu_bytes = static_cast<int64_t>(cfg.cluster.gpu_memory_gb * double(int64_t{1} << 30));
  if (gpu_bytes == 0 && !cpu) gpu_bytes = model::device_memory(device).total;
  const job::MemoryPlan plan = offline_memory_plan(cfg, model_config, cpu ? 0 : gpu_bytes, name, !cpu);
  at::Tensor choice = at::tensor({job::recompute_order(plan.recompute, plan.recompute_layers),
                                  plan.keep_compute_shard ? 1.0 : 0.0, plan.expandable_segments ? 0.0 : 1.0},
                                 at::kDouble);
  world_comm_->all_reduce(choice, dist::ReduceOp::kMin)->wait();
  const auto [recompute, layers] = job::recompute_from_order(choice[0].item<double>());
  // cluster.expandable_segments: on if any rank planned it, before the model loads.
  if (!cpu) model::set_expandable_segments(choice[2].item<double>() < 0.5);
  zero::ShardedModelOptions mo = zero::role_options("actor", cfg.roles.actor, cfg.train, true, head, device);
  if (head == model::Head::kValue && cfg.roles.actor.lora.rank > 0)
    throw ConfigError(fmt::format("roles.actor.lora.rank = {}: tiller {} trains a reward model's full weights (its "
                                  "export is a sequence classifier); set roles.actor.lora.rank=0",
                                  cfg.roles.actor.lora.rank, name));
  zero::apply_lora(mo, cfg.roles.actor.lora, model_config, static_cast<uint64_t>(cfg.run.seed));  // lora.rank 0: none
  mo.recompute = recompute;
  mo.recompute_layers = layers;
  mo.keep_compute_shard = choice[1].item<double>() > 0.5;
  if (rank == 0 && !cpu) log::info("memory plan:\n{}", plan.table());
  if (rank == 0 && mo.fp8) log::info("actor: {}", zero::fp8_summary(mo));
  model = std::make_unique<zero::ShardedModel>(model_config, *comm_, mo);
  sp = static_cast<int>(cfg.roles.actor.sequence_parallel);
  if (sp > 1) {
    const int cp = static_cast<int>(cfg.roles.actor.context_parallel);
    zero::check_sequence_parallel(model_config, sp, "roles.actor.sequence_parallel", cp);
    sequence_group_ = comm_->split(rank / sp, rank, name + ".sequence");
    model->set_sequence_group(*sequence_group_, cp);
  }
  sp_rank = rank % sp;
  dp = world / sp;
  dp_rank = rank / sp;

  if (rank == 0) {
    const std::string out = cfg.run.output_dir;
    jsonl_ = std::make_unique<controller::JsonlWriter>(cfg.logging.metrics_jsonl.empty() ? out + "/metrics.jsonl"
                                                                                       : cfg.logging.metrics_jsonl);
    tensorboard_ = std::make_unique<controller::TensorBoardWriter>(
        cfg.logging.tensorboard_dir.empty() ? out + "/tensorboard" : cfg.logging.tensorboard_dir);
    log::info("tiller {}: rank 0 pid {}; {} ranks on {} ({} backend), sequence groups of {}, model {}", name,
              static_cast<int64_t>(getpid()), world, cpu ? "CPU" : "GPUs", comm_->backend(), sp, cfg.roles.actor.model);
  }
  watcher_ = std::make_unique<StopSignalWatcher>([this] { stop_requested_ = true; });
}

OfflineRun::~OfflineRun() = default;

int64_t OfflineRun::budget() const { return cfg.train.micro_batch_tokens * sp; }

HeldOutSplit OfflineRun::split(int64_t data_size, int64_t eval_file_size, const char* what) const {
  HeldOutSplit s;
  if (eval_file_size >= 0) {
    for (int64_t i = 0; i < data_size; ++i) s.train.push_back(i);
    for (int64_t i = 0; i < eval_file_size; ++i) s.eval.push_back(i);
    return s;
  }
  if (cfg.offline.eval_samples >= data_size)
    throw ConfigError(fmt::format("offline.eval_samples = {}: {} holds {} usable {}; hold out fewer",
                                  cfg.offline.eval_samples, cfg.offline.data, data_size, what));
  return held_out_split(data_size, cfg.offline.eval_samples, static_cast<uint64_t>(cfg.run.seed));
}

OfflineRun::Batch OfflineRun::next_batch(data::EpochOrder& order) {
  const int64_t n = order.size();
  Batch b;
  b.at_start = order.cursor();
  if (b.at_start.position == n) b.at_start = {b.at_start.epoch + 1, 0};  // the next epoch starts with this step
  b.picks = order.next(std::min(cfg.train.train_batch_size, n - b.at_start.position));
  b.epochs_done = static_cast<double>(b.at_start.epoch) +
                  static_cast<double>(b.at_start.position + static_cast<int64_t>(b.picks.size())) / static_cast<double>(n);
  return b;
}

int OfflineRun::train(const std::vector<int64_t>& train_ids, int64_t start, int64_t total, data::EpochOrder& order,
                      const std::function<Pass(const std::vector<int64_t>& ids)>& train_pass,
                      const std::function<Pass()>& eval_pass) {
  using Clock = std::chrono::steady_clock;
  const int64_t n = static_cast<int64_t>(train_ids.size());
  auto prefixed = [](const std::string& prefix, const controller::Metrics& m) {
    controller::Metrics out;
    for (const auto& [k, v] : m) out.emplace_back(prefix + k, v);
    return out;
  };
  auto evaluate = [&](int64_t step) {
    if (!eval_pass) return;
    const auto t0 = Clock::now();
    const Pass e = eval_pass();
    controller::Metrics m = prefixed("eval/", e.metrics);
    m.emplace_back("time/eval", std::chrono::duration<double>(Clock::now() - t0).count());
    log_metrics(step, m);
    if (rank == 0) log::info("step {}/{}: eval {}", step, total, e.summary);
  };
  int64_t done = start;
  for (int64_t step = start; step < total && !stop_agreed(); ++step) {
    const auto t0 = Clock::now();
    const Batch b = next_batch(order);
    std::vector<int64_t> ids;
    for (int64_t p : b.picks) ids.push_back(train_ids[static_cast<size_t>(p)]);
    const Pass s = train_pass(ids);
    const StepOutcome st = optimizer_step(step);
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    const double rate = s.tokens / seconds / static_cast<double>(world);
    controller::Metrics m = prefixed("train/", s.metrics);
    m.insert(m.end(), {{"train/tokens", s.tokens},
                       {"train/grad_norm", st.grad_norm},
                       {"train/clip_factor", st.clip_factor},
                       {"train/skipped", st.skipped ? 1.0 : 0.0},
                       {"train/lr", st.lr},
                       {"epoch", b.epochs_done},
                       {"time/step", seconds},
                       {"throughput/tokens_per_s_per_gpu", rate}});
    if (cfg.roles.actor.router_aux_loss_coef > 0 || cfg.roles.actor.router_z_loss_coef > 0) {
      // A mixture of experts' router losses: every rank's weighted share, summed (the step's mean).
      const at::Tensor r = sum(model->take_router_stats().to(device));
      m.insert(m.end(), {{"train/router_aux_loss", r[0].item<double>()}, {"train/router_z_loss", r[1].item<double>()}});
    }
    log_metrics(step + 1, m);
    if (rank == 0)
      log::info("step {}/{}: {}, lr {:.3g}, grad norm {:.3f}{}, {:.0f} tokens/s/GPU, epoch {}", step + 1, total, s.summary,
                st.lr, st.grad_norm, st.skipped ? " (skipped: not finite)" : "", rate, b.at_start.epoch + 1);
    const bool last = step + 1 == total;
    if (last || (cfg.offline.eval_every > 0 && (step + 1) % cfg.offline.eval_every == 0)) evaluate(step + 1);
    maybe_save(step + 1, order.cursor(), n, last);
    done = step + 1;
  }
  return finish(done, total, n, order.cursor());
}

job::MemoryPlan offline_memory_plan(const JobConfig& cfg, const model::ModelConfig& shape, int64_t gpu_bytes,
                                        const std::string& command, bool check) {
  job::MemoryPlan plan =
      job::plan_trainer(cfg, shape, cfg.roles.actor.gpus, cfg.train.micro_batch_tokens, gpu_bytes);
  if (check) {
    std::string knobs = "lower train.micro_batch_tokens, raise roles.actor.gpus";
    if (plan.recompute != zero::Recompute::kBlocks) knobs += ", set train.recompute=blocks";
    if (plan.keep_compute_shard && cfg.roles.actor.optimizer_offload != OptimizerOffload::kCpu)
      knobs += ", set train.compute_shard=cast";
    if (cfg.roles.actor.optimizer_offload != OptimizerOffload::kCpu)
      knobs += ", or move the optimizer to the host (roles.actor.optimizer_offload=cpu)";
    job::check_trainer_fits(plan, 0, "tiller " + command + ", " + cfg.roles.actor.model, knobs);
  }
  return plan;
}

SftDataOptions sft_options(const JobConfig& cfg, const text::Tokenizer& tok, const model::ModelConfig& mc,
                           const std::string& path_key) {
  SftDataOptions o;
  o.messages_key = cfg.offline.messages_key;
  o.tools_key = cfg.offline.tools_key;
  o.prompt_key = cfg.offline.prompt_key;
  o.response_key = cfg.offline.response_key;
  o.input_template = cfg.data.input_template;
  o.chat = text::job_chat_template(cfg.data, cfg.roles.actor.model, tok);
  const std::vector<int64_t> eos = text::eos_token_ids(cfg.roles.actor.model, mc, tok);
  if (!eos.empty()) o.eos_id = eos.front();
  o.max_tokens = cfg.offline.max_tokens;
  o.long_samples = static_cast<LongSamples>(static_cast<int>(cfg.offline.long_samples));
  o.max_samples = cfg.data.max_samples;
  o.path_key = path_key;
  return o;
}

PreferenceDataOptions preference_options(const JobConfig& cfg, const text::Tokenizer& tok,
                                         const model::ModelConfig& mc, const std::string& path_key) {
  const SftDataOptions s = sft_options(cfg, tok, mc, path_key);
  PreferenceDataOptions o;
  o.prompt_key = cfg.offline.prompt_key;
  o.chosen_key = cfg.offline.chosen_key;
  o.rejected_key = cfg.offline.rejected_key;
  o.margin_key = cfg.offline.margin_key;
  o.input_template = s.input_template;
  o.chat = s.chat;
  o.eos_id = s.eos_id;
  o.max_tokens = s.max_tokens;
  o.long_samples = s.long_samples;
  o.max_samples = s.max_samples;
  o.path_key = path_key;
  return o;
}

int64_t OfflineRun::start(const OfflineOptions& options, int64_t dataset_size, data::EpochOrder& order) {
  if (options.require_resume && !checkpoints_.enabled())
    throw ConfigError("--resume: checkpoint.dir is empty; set it to the directory the run saved into");
  if (checkpoints_.enabled() && (cfg.checkpoint.resume || options.require_resume)) {
    if (const auto latest = checkpoints_.latest()) {
      const auto& [entry, state] = *latest;
      if (state.dataset_size != dataset_size)
        throw ConfigError(fmt::format("checkpoint {} was made with {} training samples and offline.data now gives {}; "
                                      "resume on the same data, or start in an empty checkpoint.dir",
                                      entry.dir, state.dataset_size, dataset_size));
      if (model->lora()) model->load_hf(cfg.roles.actor.model);  // the frozen base: the checkpoint holds the adapters
      zero::load_checkpoint(*model, entry.dir + "/actor");
      order.seek({state.dataset_epoch, state.dataset_position}, "offline.data");
      saved_step_ = entry.step;
      if (rank == 0) log::info("resumed from {} (step {})", entry.dir, entry.step);
      return entry.step;
    }
    if (options.require_resume)
      throw ConfigError(fmt::format("--resume: no complete checkpoint in {} (checkpoint.dir)", checkpoints_.root()));
  }
  if (head == model::Head::kLm && model->lora() && !cfg.roles.actor.lora.init_from.empty()) {
    // The base with a PEFT adapter to start from, its settings the config's.
    const std::string& from = cfg.roles.actor.lora.init_from;
    model::CheckpointReader reader(cfg.roles.actor.model);
    model::NamedTensors named = reader.all();
    for (const auto& [n, t] : zero::initial_adapters(model->options(), cfg.roles.actor.lora, model_config)) named[n] = t;
    model->load(named, from);
    return 0;
  }
  if (head == model::Head::kLm) {
    model->load_hf(cfg.roles.actor.model);
    return 0;
  }
  model::CheckpointReader reader(cfg.roles.actor.model);
  model::NamedTensors named = reader.all();
  if (!named.count("score.weight")) {
    // Every rank draws the same head (a seeded CPU generator) and keeps its shard of it.
    at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(cfg.run.seed));
    const double std = 1.0 / static_cast<double>(model_config.hidden_size + 1);
    named["score.weight"] = at::empty({1, model_config.hidden_size}, at::kFloat).normal_(0.0, std, gen);
    if (rank == 0) log::info("{} has no value head; starting one (normal, std {:.3g})", cfg.roles.actor.model, std);
  }
  model->load(named, cfg.roles.actor.model);
  return 0;
}

int64_t OfflineRun::total_steps(int64_t samples) const {
  const int64_t batch = cfg.train.train_batch_size;
  const int64_t total = (samples + batch - 1) / batch * cfg.offline.epochs;
  return cfg.offline.max_steps > 0 ? std::min(total, cfg.offline.max_steps) : total;
}

OfflineRun::Schedule OfflineRun::schedule(const OfflineOptions& options, int64_t samples) {
  Schedule s{data::EpochOrder(samples, cfg.data.shuffle, static_cast<uint64_t>(cfg.run.seed)), total_steps(samples), 0};
  s.start = start(options, samples, s.order);
  plan_schedule(s.total);
  return s;
}

at::Tensor preference_row(const at::Tensor& loss, const algo::PreferenceLoss& l) {
  return at::stack({loss.detach().to(at::kDouble), l.chosen_reward_sum, l.rejected_reward_sum, l.correct, l.margin_sum});
}

PreferenceSums preference_totals(OfflineRun& run, const at::Tensor& acc, double tokens, double pairs) {
  const at::Tensor t = run.sum(at::cat({acc, at::tensor({tokens}, at::kDouble).to(run.device)}));
  PreferenceSums s;
  s.loss = t[0].item<double>();
  s.chosen = t[1].item<double>();
  s.rejected = t[2].item<double>();
  s.correct = t[3].item<double>();
  s.margin = t[4].item<double>();
  s.tokens = t[5].item<double>();
  s.pairs = pairs;
  return s;
}

OfflineRun::Pass preference_pass(const PreferenceSums& s, const char* accuracy, const char* margin) {
  const double p = std::max(1.0, s.pairs);
  OfflineRun::Pass out;
  out.metrics = {{"loss", s.loss},
                 {accuracy, s.correct / p},
                 {"chosen_reward", s.chosen / p},
                 {"rejected_reward", s.rejected / p},
                 {margin, s.margin / p},
                 {"pairs", s.pairs}};
  out.tokens = s.tokens;
  out.summary = fmt::format("loss {:.4f}, {} {:.3f}, {} {:.4f} over {} pairs", s.loss, accuracy, s.correct / p, margin,
                            s.margin / p, s.pairs);
  return out;
}

void OfflineRun::plan_schedule(int64_t total_steps) {
  schedule_.kind = cfg.train.lr_schedule;
  schedule_.warmup_steps = cfg.train.warmup_steps;
  schedule_.total_steps = std::max<int64_t>(1, total_steps);
  schedule_.min_ratio = cfg.train.min_lr_ratio;
}

OfflineRun::StepOutcome OfflineRun::optimizer_step(int64_t step) {
  StepOutcome o;
  o.lr = cfg.train.actor_lr * schedule_.factor(step);
  const zero::StepResult r = model->step(o.lr);
  o.grad_norm = r.grad_norm;
  o.clip_factor = r.clip_factor;
  o.skipped = r.skipped;
  return o;
}

at::Tensor OfflineRun::sum(const at::Tensor& t) {
  at::Tensor x = t.to(device, at::kDouble).contiguous();
  comm_->all_reduce(x)->wait();
  return x.cpu();
}

void OfflineRun::log_metrics(int64_t step, const controller::Metrics& metrics) {
  if (rank != 0) return;
  jsonl_->write(step, metrics);
  tensorboard_->scalars(step, metrics);
}

bool OfflineRun::stop_agreed() {
  at::Tensor flag = at::tensor({stop_requested_.load() ? 1 : 0}, at::kInt);
  world_comm_->all_reduce(flag, dist::ReduceOp::kMax)->wait();
  stopped_ = flag.item<int>() > 0;
  return stopped_;
}

void OfflineRun::save(int64_t step, const data::DatasetCursor& cursor, int64_t dataset_size) {
  at::Tensor ok = at::ones({1}, at::kInt);
  if (rank == 0) checkpoints_.begin(step);  // the step's directory, incomplete until commit
  world_comm_->all_reduce(ok)->wait();      // every rank sees it before writing into it
  zero::SaveOptions so;
  so.source_model = cfg.roles.actor.model;
  zero::save_checkpoint(*model, checkpoints_.dir(step) + "/actor", so);
  if (rank == 0) {
    zero::RunState st;
    st.step = step;
    st.actor_updates = step;
    st.dataset_epoch = cursor.epoch;
    st.dataset_position = cursor.position;
    st.dataset_size = dataset_size;
    checkpoints_.commit(step, st);
    log::info("step {}: checkpoint {}", step, checkpoints_.dir(step));
  }
  world_comm_->all_reduce(ok)->wait();
  saved_step_ = step;
}

void OfflineRun::maybe_save(int64_t step, const data::DatasetCursor& cursor, int64_t dataset_size, bool force) {
  if (!checkpoints_.enabled() || step == saved_step_) return;
  const int64_t every = cfg.checkpoint.every_steps;
  if (force || (every > 0 && step % every == 0)) save(step, cursor, dataset_size);
}

void OfflineRun::export_model(const std::string& checkpoint) {
  const std::string out = cfg.offline.export_dir.empty() ? cfg.run.output_dir + "/model" : cfg.offline.export_dir;
  if (model->lora()) {  // the adapters as PEFT's files beside the merged model, from the live state
    if (rank == 0) {
      const zero::ShardedModel::LoraState st = model->lora_state();
      const at::ScalarType dtype = cfg.roles.actor.dtype == Precision::kFp32 ? at::kFloat : at::kBFloat16;
      model::write_merged_model(cfg.roles.actor.model, model->options().lora, st.adapters, out, dtype);
      model::write_peft_adapter(out + "/adapter", model_config, model->options().lora, cfg.roles.actor.lora.dropout,
                                st.adapters, cfg.roles.actor.model);
      log::info("exported the merged model to {} (loads as roles.actor.model) and the LoRA adapter to {}/adapter "
                "(PEFT's files)",
                out, out);
    }
    at::Tensor ok = at::ones({1}, at::kInt);
    world_comm_->all_reduce(ok)->wait();
    return;
  }
  if (rank == 0) {
    zero::export_hf(checkpoint, out,
                    cfg.roles.actor.dtype == Precision::kFp32 ? at::kFloat : at::kBFloat16);
    log::info("exported the trained model to {} (loads as {})", out,
              head == model::Head::kValue ? "roles.reward.model" : "roles.actor.model");
  }
  at::Tensor ok = at::ones({1}, at::kInt);
  world_comm_->all_reduce(ok)->wait();
}

int OfflineRun::finish(int64_t steps_done, int64_t total, int64_t dataset_size, const data::DatasetCursor& cursor) {
  if (steps_done < total) {  // stopped by a signal
    if (checkpoints_.enabled()) {
      maybe_save(steps_done, cursor, dataset_size, /*force=*/true);
      if (rank == 0) log::info("stopped after step {} of {}; tiller {} --resume continues from the checkpoint", steps_done, total, name);
    } else if (rank == 0) {
      log::warn("stopped after step {} of {}; nothing saved (checkpoint.dir is empty)", steps_done, total);
    }
    return 0;
  }
  if (checkpoints_.enabled()) {
    maybe_save(steps_done, cursor, dataset_size, /*force=*/true);
    export_model(checkpoints_.dir(steps_done) + "/actor");
    return 0;
  }
  if (model->lora()) {  // exported from the live adapters
    export_model("");
    return 0;
  }
  // No checkpoint directory: a transient checkpoint of the final state is what the export reads.
  const std::string tmp = cfg.run.output_dir + "/.final_checkpoint";
  zero::SaveOptions so;
  so.source_model = cfg.roles.actor.model;
  zero::save_checkpoint(*model, tmp, so);
  export_model(tmp);
  if (rank == 0) {
    try {
      remove_tree(tmp);
    } catch (const std::exception& e) {
      log::warn("could not remove the transient checkpoint {}: {}", tmp, e.what());
    }
  }
  return 0;
}

}  // namespace tiller::offline
