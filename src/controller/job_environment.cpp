#include "controller/job_environment.h"

#include <fmt/format.h>

#include "tiller/core/deadline.h"
#include "tiller/core/logging.h"
#include "tiller/core/tls.h"
#include "tiller/env/environment.h"
#include "tiller/env/remote_env.h"
#include "tiller/text/chat_template.h"
#include "tiller/text/tokenizer.h"

namespace tiller::controller {
namespace {

std::shared_ptr<env::Environment> job_environment(const JobConfig& cfg) {
  if (cfg.env.type == EnvType::kRemote) {
    env::RemoteEnvOptions eo;
    eo.address = cfg.env.address;
    eo.timeout_seconds = cfg.env.timeout_s;
    eo.retries = static_cast<int>(cfg.env.retries);
    if (!cfg.env.token_file.empty()) eo.token = read_secret_file(cfg.env.token_file, "env.token_file");
    eo.tls.ca = cfg.env.tls_ca;
    eo.tls.server_name = cfg.env.tls_server_name;
    auto remote = std::make_shared<env::RemoteEnvironment>(eo);
    const std::string name = remote->check_health(Deadline::after_seconds(cfg.timeouts.startup_s));
    log::info("env: the service at {} runs '{}' (at most {} turns, {} response tokens a sample)", eo.address, name,
              cfg.rollout.max_turns, cfg.response_limit());
    return remote;
  }
  std::shared_ptr<env::Environment> environment = env::make_env(cfg.env.name);
  log::info("env: {} in-process (at most {} turns, {} response tokens a sample)", environment->name(),
            cfg.rollout.max_turns, cfg.response_limit());
  return environment;
}

}  // namespace

LoopSources make_job_loop_sources(const JobConfig& cfg, const text::Tokenizer& tokenizer) {
  LoopSources s;
  if (cfg.env.type != EnvType::kNone) s.environment = job_environment(cfg);
  const text::Tokenizer* tok = &tokenizer;
  // Observations inside the chat template's tool turn.
  const text::ChatTemplate chat = text::job_chat_template(cfg.data, cfg.roles.actor.model, tokenizer);
  s.observation_tokens = [tok, chat, role = cfg.env.observation_role](const std::string& text, bool closed, bool raw) {
    return tok->encode(raw ? text : chat.observation_turn(text, closed, role), /*add_special_tokens=*/false);
  };
  s.decode = [tok](const std::vector<int64_t>& ids) { return tok->decode(ids, true); };
  s.session_prefix = fmt::format("{}-{}", cfg.run.name, cfg.run.seed);
  s.tokenizer = std::shared_ptr<const text::Tokenizer>(tok, [](const text::Tokenizer*) {});  // outlives the loop
  // The agent endpoint renders chat requests with the model's template (data.chat_template), whether
  // or not the dataset's prompts go through it (data.apply_chat_template).
  s.chat = std::make_shared<const text::ChatTemplate>(
      cfg.agent_loop() ? text::load_chat_template(cfg.data.chat_template, cfg.roles.actor.model, tokenizer,
                                                   cfg.data.chat_template_kwargs)
                       : chat);
  return s;
}

}  // namespace tiller::controller
