// A controller rank of `tiller train` (controller.h, run_controller): the controller's wiring from
// the job's config: the actor's tokenizer and model shape, the prompt source, rewards, sample
// loops, the engine pool, the weight sync's plan, tracking and evaluation.
#include <filesystem>
#include <memory>
#include <system_error>

#include "controller/controller.h"
#include "controller/engine_pool.h"
#include "controller/standalone_engines.h"
#include "controller/evaluator.h"
#include "controller/job_environment.h"
#include "controller/job_rewards.h"
#include "python/tracking.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"
#include "tiller/core/tls.h"
#include "tiller/dist/rank_plan.h"
#include "tiller/model/model_config.h"
#include "tiller/sync/bucket_plan.h"
#include "tiller/sync/weight_push.h"
#include "tiller/text/tokenizer.h"

namespace tiller::controller {

int run_controller(const JobConfig& cfg, const dist::RankPlan& plan, dist::Communicator& world,
                   const ControllerOptions& opts) {
  const dist::RoleGroup* actor = plan.group(Role::kActor);
  TILLER_CHECK(actor != nullptr, "the rank plan has no actor group");
  const std::string actor_dir = cfg.roles.actor.model;
  const auto tokenizer = text::load_tokenizer(actor_dir);
  const model::ModelConfig mc = model::load_model_config(actor_dir);
  const std::unique_ptr<PromptSource> prompts = make_job_prompt_source(cfg, *tokenizer);

  const text::Tokenizer* tok = tokenizer.get();
  JobRewards job_rewards = make_job_rewards(cfg, [tok](const std::vector<int64_t>& ids) { return tok->decode(ids, true); });

  TlsFiles engine_tls;
  if (!cfg.engines.tls_cert.empty()) {
    engine_tls.ca = cfg.engines.tls_ca.empty() ? cfg.engines.tls_cert : cfg.engines.tls_ca;
    engine_tls.server_name = cfg.engines.tls_server_name;
  }
  std::vector<std::string> addresses = opts.engine_addresses;
  std::string token = opts.engine_token;
  std::unique_ptr<StandaloneEngines> standalone;
  if (cfg.engines.standalone()) {
    standalone = std::make_unique<StandaloneEngines>(cfg);
    addresses = standalone->addresses();
    token = sync::standalone_engine_token(cfg.engines.token_file);
  }
  EnginePool engines(addresses, token, cfg.timeouts.rpc_s, engine_tls, cfg.engines.standalone());
  if (engines.size() == 0)
    throw ConfigError("engines.count = 0: tiller train needs at least one engine (engines.count, or standalone ones: "
                      "engines.addresses, engines.rendezvous_dir)");
  wire::MpiChannel channel(world);
  ControllerWiring w;
  w.plan = &plan;
  w.engines = &engines;
  w.channel = &channel;
  w.prompts = prompts.get();
  w.rewards = job_rewards.sources;
  w.loop = make_job_loop_sources(cfg, *tokenizer);
  w.sync_plan = sync::job_bucket_plan(cfg, mc, plan).to_json();
  w.require_resume = opts.require_resume;
  w.stop_token_ids = text::eos_token_ids(actor_dir, mc, *tokenizer);
  w.decode_text = [tok](const std::vector<int64_t>& ids) { return tok->decode(ids, false); };
  w.attention_tokens = model::attention_cost_tokens(mc);
  python::TrackingOptions to;
  to.wandb_project = cfg.logging.wandb.project;
  to.wandb_entity = cfg.logging.wandb.entity;
  to.wandb_name = cfg.logging.wandb.name.empty() ? cfg.run.name : cfg.logging.wandb.name;
  to.wandb_tags = cfg.logging.wandb.tags;
  to.wandb_mode = cfg.logging.wandb.mode;
  to.wandb_dir = cfg.logging.wandb.dir.empty() ? cfg.run.output_dir : cfg.logging.wandb.dir;
  to.mlflow_experiment = cfg.logging.mlflow.experiment;
  to.mlflow_tracking_uri = cfg.logging.mlflow.tracking_uri;
  to.mlflow_run_name = cfg.logging.mlflow.run_name.empty() ? cfg.run.name : cfg.logging.mlflow.run_name;
  to.config_yaml = to_yaml(cfg);
  to.output_dir = cfg.run.output_dir;
  std::unique_ptr<python::Tracking> tracking;
  if (to.enabled()) {
    std::error_code ec;
    std::filesystem::create_directories(to.wandb_dir, ec);  // wandb wants its directory to exist
    tracking = std::make_unique<python::Tracking>(to);
  }
  w.tracking = tracking.get();
  w.standalone = standalone.get();
  std::unique_ptr<Evaluator> evaluator;
  if (cfg.eval.enabled()) evaluator = std::make_unique<Evaluator>(cfg, *tokenizer, engines, w.stop_token_ids);
  w.evaluator = evaluator.get();
  Controller controller(cfg, w);
  return controller.run();
}

}  // namespace tiller::controller
