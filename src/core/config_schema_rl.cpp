// The config schema's keys of the RL loop: rollout (generation), algo, data (the prompt dataset),
// reward, env (multi-turn), agent (OpenAI-endpoint harnesses) and train (optimisation)
// (config_schema_builder.h).
#include "config_schema_builder.h"

namespace tiller::config_schema::detail {

void add_rl_fields(Builder& b) {
  b.add("rollout.batch_size", TILLER_FIELD(rollout.batch_size), "Prompts per PPO step.").range(1, 1 << 24);
  b.add("rollout.n_samples_per_prompt", TILLER_FIELD(rollout.n_samples_per_prompt),
        "Completions sampled for each prompt.").range(1, 1024);
  b.add("rollout.max_prompt_tokens", TILLER_FIELD(rollout.max_prompt_tokens),
        "Longest prompt in tokens; longer ones follow data.long_prompt_policy.").range(1, kMaxSampleTokens);
  b.add("rollout.max_new_tokens", TILLER_FIELD(rollout.max_new_tokens), "Most tokens generated per completion.")
      .range(1, kMaxSampleTokens);
  b.add("rollout.temperature", TILLER_FIELD(rollout.temperature), "Sampling temperature (0: greedy).")
      .range(0.0, 100.0);
  b.add("rollout.top_p", TILLER_FIELD(rollout.top_p), "Nucleus sampling threshold (1: off).").range(0.0, 1.0);
  b.add("rollout.top_k", TILLER_FIELD(rollout.top_k), "Top-k sampling (-1: off).").range(-1, kMaxSampleTokens);
  b.add("rollout.micro_batch_tokens", TILLER_FIELD(rollout.micro_batch_tokens),
        "Token budget of one packed scoring micro-batch (log-probs, values, rewards).")
      .range(1, kMaxBatchTokens);
  b.add_enum("rollout.mode", TILLER_FIELD(rollout.mode),
             "sync: each step generates, scores, trains, then syncs the weights. async: the engines keep "
             "generating the next steps' samples while the trainers score and train, within "
             "rollout.max_staleness (docs/training.md).");
  b.add("rollout.max_staleness", TILLER_FIELD(rollout.max_staleness),
        "async: weight versions a sample's oldest token may lag the weights it is trained from (-1: 1). "
        "0 is the on-policy loop of sync mode. Sync mode needs -1 or 0.")
      .range(-1, 8);
  b.add_enum("rollout.stale_policy", TILLER_FIELD(rollout.stale_policy),
             "async: wait (a step trains the prompts in the order they were sent, waiting for stragglers; no "
             "sample is ever too stale) or drop (a step trains the groups that finished first; a group that "
             "would lag more than max_staleness is dropped and counted in rollout/stale_dropped_groups).");
  b.add("rollout.partial", TILLER_FIELD(rollout.partial),
        "async: at a weight sync the engines keep their in-flight samples (tokens and log-probs), recompute "
        "their KV cache with the new weights and continue, instead of finishing them before the sync.");
  b.add("rollout.filter_groups", TILLER_FIELD(rollout.filter_groups),
        "DAPO dynamic sampling: drop prompt groups whose n rewards are all equal (no learning signal) and "
        "sample more prompts until the step has rollout.batch_size informative groups.");
  b.add("rollout.filter_max_extra_batches", TILLER_FIELD(rollout.filter_max_extra_batches),
        "With filter_groups: at most this many x rollout.batch_size prompts beyond the batch per step; when "
        "they run out the step trains the informative groups it has (logged).")
      .range(0, 64);

  b.add("rollout.loop", TILLER_FIELD(rollout.loop),
        "How a prompt's samples are made: a registered sample loop. Built in: single_turn (one engine request of "
        "n samples) and multi_turn (episodes with the environment, env.*); unset: multi_turn with an "
        "environment, single_turn without. A trainer of your own registers its agent loops (docs/library.md).");
  b.add("rollout.loop_args", TILLER_FIELD(rollout.loop_args),
        "A registered sample loop's settings, a string in a format of its own.");
  b.add("rollout.max_turns", TILLER_FIELD(rollout.max_turns),
        "With an environment (env.type): most model turns of one sample; the episode ends at its environment's "
        "done, at this many turns, or at rollout.max_response_tokens. With an agent harness (openai_agent): the "
        "requests one sample may send (more are refused).")
      .range(1, 1024);
  b.add("rollout.max_response_tokens", TILLER_FIELD(rollout.max_response_tokens),
        "With an environment or an agent harness: most tokens after the prompt of one sample, the model's turns "
        "and the observations (or the harness's text) together (0: max_new_tokens x max_turns). Each turn generates at most max_new_tokens, and fewer when "
        "this limit is near.")
      .range(0, kMaxSampleTokens);

  b.add("algo.advantage_estimator", TILLER_FIELD(algo.advantage_estimator),
        "A registered advantage estimator. Built in: gae (PPO with a critic), reinforce (REINFORCE++), rloo, "
        "reinforce_baseline, group_norm (GRPO), dr_grpo; a trainer of your own registers more "
        "(docs/library.md).");
  b.add("algo.policy_loss", TILLER_FIELD(algo.policy_loss),
        "A registered policy loss. Built in: ppo (the clipped surrogate, with clip_eps_low/high and dual_clip), pg "
        "(-A * logp, no ratio or clipping: GPG); a trainer of your own registers more (docs/library.md). The KL loss "
        "and the entropy bonus are added to it.");
  b.add("algo.gamma", TILLER_FIELD(algo.gamma), "Discount factor.").range(0.0, 1.0);
  b.add("algo.lambd", TILLER_FIELD(algo.lambd), "GAE lambda.").range(0.0, 1.0);
  b.add("algo.clip_eps_low", TILLER_FIELD(algo.clip_eps_low), "PPO ratio clip below 1.").range(0.0, 1.0);
  b.add("algo.clip_eps_high", TILLER_FIELD(algo.clip_eps_high), "PPO ratio clip above 1 (asymmetric clip).")
      .range(0.0, 10.0);
  b.add("algo.dual_clip", TILLER_FIELD(algo.dual_clip), "Dual-clip constant c > 1 for negative advantages (0: off).")
      .range(0.0, 100.0);
  b.add("algo.value_loss", TILLER_FIELD(algo.value_loss),
        "A registered value loss (the critic's). Built in: clipped (PPO's, clipped around the old values by "
        "algo.value_clip); a trainer of your own registers more (docs/library.md).");
  b.add("algo.value_clip", TILLER_FIELD(algo.value_clip), "Value-loss clip range (0: off).").range(0.0, 100.0);
  b.add("algo.kl_coef", TILLER_FIELD(algo.kl_coef), "Initial KL coefficient against the reference model.")
      .range(0.0, 100.0);
  b.add("algo.distill_coef", TILLER_FIELD(algo.distill_coef),
        "On-policy distillation (0: off): the reference role is the teacher (roles.ref.model: a larger or better "
        "model with the same tokenizer, frozen, sharded, colocatable) and every sampled token's advantage gains "
        "distill_coef x (log p_teacher - log p_student), the per-token reverse KL, beside the task reward's "
        "advantage (docs/training.md, Distillation). Usually with algo.kl_coef 0.")
      .range(0.0, 1000.0);
  b.add("algo.kl_estimator", TILLER_FIELD(algo.kl_estimator),
        "A registered KL estimator. Built in: k1 (logp - ref), k2 (its square over 2), k3 (exp(-d) - 1 + d); a "
        "trainer of your own registers more (docs/library.md).");
  b.add("algo.kl_in_reward", TILLER_FIELD(algo.kl_in_reward),
        "true: KL penalty in the per-token reward (PPO); false: KL as a loss term (GRPO).");
  b.add("algo.target_kl", TILLER_FIELD(algo.target_kl), "Adaptive KL controller target (0: fixed kl_coef).")
      .range(0.0, 100.0);
  b.add("algo.kl_horizon", TILLER_FIELD(algo.kl_horizon), "Horizon of the adaptive KL controller, in samples.")
      .range(1.0, 1e12);
  b.add_enum("algo.importance_correction", TILLER_FIELD(algo.importance_correction),
             "Off-policy correction of the policy loss against the engine's log-probs (the behaviour policy; the "
             "PPO ratio is taken against the actor's recomputed log-probs, the proximal policy). none; tis: each "
             "token's loss weighted by w = exp(proximal - behaviour) truncated at algo.tis_cap; mis: weighted by w "
             "where it lies in [algo.is_cap_lower, algo.tis_cap], masked out elsewhere; decoupled: decoupled PPO, "
             "weighted by w, tokens with w > algo.tis_cap masked out (0: none masked). tis and mis take w at "
             "algo.is_level.");
  b.add("algo.tis_cap", TILLER_FIELD(algo.tis_cap),
        "Cap of the importance weights: truncation (tis), upper mask bound (mis) or mask threshold (decoupled; 0: "
        "no mask).")
      .range(0.0, 1000.0);
  b.add_enum("algo.is_level", TILLER_FIELD(algo.is_level),
             "tis and mis: the weight w of each token. token: its own exp(d); sequence: its sample's product of "
             "ratios exp(sum d); geometric: their geometric mean exp(mean d). A sample-level weight is truncated "
             "or masked as a whole.");
  b.add("algo.is_cap_lower", TILLER_FIELD(algo.is_cap_lower),
        "mis: the lower mask bound of the weights (0: 1 / algo.tis_cap).")
      .range(0.0, 1.0);
  b.add("algo.is_veto", TILLER_FIELD(algo.is_veto),
        "Rejection: a sample with any token whose weight exp(proximal - behaviour) is below this is left out of the "
        "policy loss (a token the engine drew and the trainer finds near impossible; e.g. 1e-4). 0: off. Counted "
        "in off_policy/rejected_samples.")
      .range(0.0, 1.0);
  b.add_enum("algo.logprob_match", TILLER_FIELD(algo.logprob_match),
             "off: the fastest kernels, and the engine's log-probs differ from the trainer's in their last bits "
             "(mismatch/*). bitwise: every rank runs batch-invariant forward kernels (one reduction order whatever "
             "the batch), so each sampled token's engine log-prob equals the trainer's bit for bit "
             "(mismatch/tokens_differing is 0) and the first mini-batch's PPO ratio is exactly 1, and a synchronous "
             "run on the CPU is reproducible to the bit. CPU and CUDA; needs engines.tp = 1 (docs/training.md).");
  b.add("algo.routing_replay", TILLER_FIELD(algo.routing_replay),
        "Routing replay (mixture-of-experts actors): the engine records the experts that routed every prompt and "
        "generated token, the controller ships them with the micro-batches, and the actor's scoring and training "
        "forwards take those experts (the router's probabilities at them still weight them and get the gradient). "
        "Dense actors are refused (docs/training.md).");
  b.add("algo.seq_mask_ratio", TILLER_FIELD(algo.seq_mask_ratio),
        "Sequence-level mask: a sample whose geometric-mean importance weight exp(mean(proximal - behaviour)) "
        "is outside [1/r, r] is left out of the policy loss (r > 1; 0: off). Counted in off_policy/masked_samples.")
      .range(0.0, 1000.0);
  b.add("algo.entropy_coef", TILLER_FIELD(algo.entropy_coef), "Entropy bonus coefficient.").range(0.0, 10.0);
  b.add("algo.whiten_advantages", TILLER_FIELD(algo.whiten_advantages), "Normalise advantages over the batch.");
  b.add("algo.ppo_epochs", TILLER_FIELD(algo.ppo_epochs), "Passes over each rollout batch.").range(1, 100);

  b.add("data.source", TILLER_FIELD(data.source),
        "Where prompts come from: a registered prompt source. Built in: file (data.prompts); a trainer of your "
        "own registers more, e.g. a generator of tasks (docs/library.md).");
  b.add("data.source_args", TILLER_FIELD(data.source_args),
        "data.source other than file: the source's settings, a string in a format of its own.");
  b.add("data.prompts", TILLER_FIELD(data.prompts),
        "File of prompts: JSONL, or parquet (a name ending in .parquet or .pq; read with the embedded Python's "
        "pyarrow).");
  b.add("data.input_key", TILLER_FIELD(data.input_key),
        "Key of the prompt: text, or a list of chat messages ({role, content}; needs data.apply_chat_template). "
        "A dotted path reaches into nested objects.");
  b.add("data.label_key", TILLER_FIELD(data.label_key),
        "Key of the label given to rewards (verl: reward_model.ground_truth); a value that is not text is kept as "
        "its JSON.");
  b.add("data.data_source_key", TILLER_FIELD(data.data_source_key),
        "Key of the sample's data source, passed to Python rewards as data_source.");
  b.add("data.extra_info_key", TILLER_FIELD(data.extra_info_key),
        "Key of the record's extra information (any JSON), passed to Python rewards as extra_info.");
  b.add("data.input_template", TILLER_FIELD(data.input_template),
        "Template with one {} where the prompt goes (empty: the prompt as is).");
  b.add("data.apply_chat_template", TILLER_FIELD(data.apply_chat_template),
        "Wrap each prompt (and SFT conversation, preference pair, multi-turn observation) in the model's chat "
        "template (data.chat_template).");
  b.add("data.chat_template", TILLER_FIELD(data.chat_template),
        "Which chat template: auto (the model's own Jinja template, tokenizer_config.json's chat_template or "
        "chat_template.jinja, rendered as transformers' apply_chat_template; else ChatML or Llama-3 by the "
        "tokenizer's special tokens), model (its own; an error when it has none), chatml, llama3, none, or a path "
        "to a .jinja file.");
  b.add("data.chat_template_kwargs", TILLER_FIELD(data.chat_template_kwargs),
        "Extra variables for a Jinja chat template, as transformers' apply_chat_template(**kwargs) passes them: a "
        "mapping, e.g. {enable_thinking: false} for Qwen3's thinking switch (they override the special tokens' "
        "names; messages, tools, documents and add_generation_prompt are tiller's). Empty: none.")
      .as_json_map();
  b.add("data.tools_key", TILLER_FIELD(data.tools_key),
        "Key of a prompt's tool schemas (a JSON list, as transformers' apply_chat_template takes them), given to "
        "the chat template as `tools`; a prompt without it has none.");
  b.add("data.shuffle", TILLER_FIELD(data.shuffle), "Shuffle prompts each epoch with run.seed.");
  b.add_enum("data.long_prompt_policy", TILLER_FIELD(data.long_prompt_policy),
        "Prompts over rollout.max_prompt_tokens: skip them (counted in the log), keep their last tokens "
        "(truncate_left), or stop with an error naming the line.")
      ;
  b.add("data.max_samples", TILLER_FIELD(data.max_samples), "Use at most this many prompts (0: all).")
      .range(0, kMaxCount);

  b.add_enum("reward.type", TILLER_FIELD(reward.type),
             "model (the reward role scores), rule (a registered function), remote (a gRPC reward service), "
             "python (a Python function run in-process: reward.python), env (the environment's rewards only), scorer (a batch scorer a trainer of your own "
             "registers: reward.scorer). With "
             "an environment, the other types score the whole response and the environment's rewards add to it.");
  b.add("reward.rule", TILLER_FIELD(reward.rule), "Registered rule reward used when reward.type is rule.");
  b.add("reward.remote_address", TILLER_FIELD(reward.remote_address),
        "host:port of the remote reward service (proto/tiller/reward.proto) when reward.type is remote.");
  b.add("reward.remote_timeout_s", TILLER_FIELD(reward.remote_timeout_s), "Deadline of one Score call to the remote reward service.")
      .range(0.001, kMaxSeconds);
  b.add("reward.remote_retries", TILLER_FIELD(reward.remote_retries),
        "Retries of a Score call that failed with UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED or ABORTED "
        "(backoff doubling from 0.5 s); other errors end the job at once.")
      .range(0, 100);
  b.add("reward.remote_batch_size", TILLER_FIELD(reward.remote_batch_size),
        "Samples per Score call; a call leaves as soon as this many samples have finished generating.")
      .range(1, 1000000);
  b.add("reward.remote_concurrency", TILLER_FIELD(reward.remote_concurrency), "Score calls in flight at once.")
      .range(1, 1024);
  b.add("reward.remote_token_file", TILLER_FIELD(reward.remote_token_file),
        "File whose first line is the token sent to the remote reward service as x-tiller-token (empty: none; "
        "examples/reward_server/server.py --token-file checks it).");
  b.add("reward.remote_tls_ca", TILLER_FIELD(reward.remote_tls_ca),
        "PEM roots to verify the remote reward service's certificate with; set, the call goes over TLS.");
  b.add("reward.remote_tls_server_name", TILLER_FIELD(reward.remote_tls_server_name),
        "The name the reward service's certificate must carry; empty: the host of reward.remote_address.");
  b.add("reward.python", TILLER_FIELD(reward.python),
        "FILE.py:FUNCTION run in the controller's embedded Python when reward.type is python; verl's "
        "compute_score(data_source, solution_str, ground_truth, extra_info) works as is (docs/training.md).");
  b.add("reward.python_batched", TILLER_FIELD(reward.python_batched),
        "The function takes lists (data_sources, solution_strs, ground_truths, extra_infos) and returns a list: "
        "one call per batch.");
  b.add("reward.python_batch_size", TILLER_FIELD(reward.python_batch_size),
        "Samples per batch handed to a Python worker; a batch leaves as soon as this many samples have finished.")
      .range(1, 4096);
  b.add("reward.python_workers", TILLER_FIELD(reward.python_workers),
        "Threads calling the Python function. Pure Python runs one at a time (the GIL); more threads help "
        "functions that wait on I/O or release the GIL.")
      .range(1, 64);
  b.add("reward.python_timeout_s", TILLER_FIELD(reward.python_timeout_s),
        "Deadline of one call (a sample; a batch when batched): a call past it is interrupted and the job ends.")
      .range(0.001, 86400.0);
  b.add("reward.scorer", TILLER_FIELD(reward.scorer),
        "reward.type scorer: a batch scorer that a trainer of your own registers by this name "
        "(tiller::reward::register_batch_scorer; docs/library.md).");
  b.add("reward.scorer_args", TILLER_FIELD(reward.scorer_args),
        "reward.type scorer: the scorer's settings, a string in a format of its own (a path, JSON, key=value).");
  b.add("reward.scorer_batch_size", TILLER_FIELD(reward.scorer_batch_size),
        "reward.type scorer: samples per batch (a scorer's factory may choose otherwise).").range(1, 4096);
  b.add("reward.scorer_concurrency", TILLER_FIELD(reward.scorer_concurrency),
        "reward.type scorer: batches scored at once, each on a worker thread.").range(1, 256);
  b.add("reward.clip", TILLER_FIELD(reward.clip), "Rewards are clipped to [-clip, clip] (0: off).")
      .range(0.0, 1e9);
  b.add("reward.normalize", TILLER_FIELD(reward.normalize), "Normalise rewards with running mean and std.");
  b.add("reward.overlong_buffer", TILLER_FIELD(reward.overlong_buffer),
        "DAPO's soft overlong penalty: a response longer than rollout.max_new_tokens - this many tokens loses "
        "reward.overlong_penalty x (its excess / this), the full penalty at max_new_tokens (0: off).")
      .range(0, 1 << 24);
  b.add("reward.overlong_penalty", TILLER_FIELD(reward.overlong_penalty),
        "The overlong penalty at rollout.max_new_tokens (see reward.overlong_buffer).")
      .range(0.0, 1000.0);

  b.add_enum("env.type", TILLER_FIELD(env.type),
        "Multi-turn rollouts: none (single-turn samples), remote (a gRPC environment service, "
        "proto/tiller/env.proto; examples/envs/), or inprocess (a C++ environment registered with "
        "tiller::env::register_env under env.name).")
      ;
  b.add("env.name", TILLER_FIELD(env.name), "env.type inprocess: the name the environment was registered under.");
  b.add("env.address", TILLER_FIELD(env.address), "env.type remote: host:port of the environment service.");
  b.add("env.observation_role", TILLER_FIELD(env.observation_role),
        "The chat template's role of an environment's answer: tool (Qwen2.5 writes it as a <tool_response> user "
        "turn, Llama-3 as ipython) or user (for templates without a tool role, such as Gemma's).")
      .one_of({"tool", "user"});
  b.add("env.timeout_s", TILLER_FIELD(env.timeout_s),
        "Deadline of one Start, Step or Close call, retries included; a call past it ends the job.")
      .range(0.001, kMaxSeconds);
  b.add("env.retries", TILLER_FIELD(env.retries),
        "Retries of a remote call that failed with UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED or ABORTED "
        "(backoff doubling from 0.5 s; the service's calls must be idempotent); other errors end the job at once.")
      .range(0, 100);
  b.add("env.concurrency", TILLER_FIELD(env.concurrency), "Environment calls in flight at once (threads).")
      .range(1, 4096);
  b.add("env.token_file", TILLER_FIELD(env.token_file),
        "File whose first line is the token sent to the environment service as x-tiller-token (empty: none).");
  b.add("env.tls_ca", TILLER_FIELD(env.tls_ca),
        "PEM roots to verify the environment service's certificate with; set, the calls go over TLS.");
  b.add("env.tls_server_name", TILLER_FIELD(env.tls_server_name),
        "The name the environment service's certificate must carry; empty: the host of env.address.");

  b.add("agent.harness", TILLER_FIELD(agent.harness),
        "rollout.loop openai_agent: the agent harness run for each sample, FILE.py:FUNCTION (called with the "
        "sample's base_url and api_key for the openai client; docs/agents.md), command (agent.command), or the "
        "name of one registered in C++.");
  b.add("agent.command", TILLER_FIELD(agent.command),
        "agent.harness command: the shell command run for each sample, with OPENAI_BASE_URL, OPENAI_API_KEY and "
        "TILLER_AGENT_* (the prompt, label, ...) in its environment; the last line it prints is the reward "
        "(docs/agents.md).");
  b.add_enum("agent.drift", TILLER_FIELD(agent.drift),
        "What a harness request whose prompt does not extend the sample's tokens so far (retokenization drift) "
        "does: error (the job ends naming the sample and the first differing token), split (the sample goes on as "
        "a new segment from that prompt; what came before is not trained), or drop (none of the sample is trained).");
  b.add("agent.concurrency", TILLER_FIELD(agent.concurrency), "Harness calls at once (threads).").range(1, 4096);
  b.add("agent.timeout_s", TILLER_FIELD(agent.timeout_s),
        "Deadline of one harness call (a whole sample); past it the job ends naming the sample.")
      .range(0.001, kMaxSeconds);
  b.add("agent.host", TILLER_FIELD(agent.host),
        "Address the agent endpoint listens on (the harnesses run in the controller's process: 127.0.0.1).");
  b.add("agent.port", TILLER_FIELD(agent.port), "Port of the agent endpoint; 0: a free one.").range(0, 65535);
  b.add("agent.tool_call_parser", TILLER_FIELD(agent.tool_call_parser),
        "How chat replies' tool calls are read out of their text when a request gives tools: none, or hermes "
        "(Qwen2.5's <tool_call> blocks).")
      .one_of({"none", "hermes"});

  b.add("train.num_steps", TILLER_FIELD(train.num_steps), "PPO steps to run.").range(1, kMaxCount);
  b.add("train.train_batch_size", TILLER_FIELD(train.train_batch_size), "Samples per optimizer step.")
      .range(1, kMaxCount);
  b.add("train.micro_batch_tokens", TILLER_FIELD(train.micro_batch_tokens),
        "Token budget of one packed training micro-batch per rank.").range(1, kMaxBatchTokens);
  b.add_enum("train.recompute", TILLER_FIELD(train.recompute),
        "What the trained roles recompute in the backward pass instead of keeping: blocks (keep each block's input, "
        "recompute the block: least memory), attention_only (also keep the MLP's activations, recompute the attention "
        "half), none (keep everything), or auto: the most kept that the memory plan fits on the GPU (tiller plan prints "
        "the choice; blocks on CPU).")
      ;
  b.add("train.recompute_layers", TILLER_FIELD(train.recompute_layers),
        "How many blocks, from the first, keep what train.recompute keeps; the others recompute whole blocks. -1: "
        "every block. With train.recompute auto the memory plan sets it: attention_only for as many blocks as fit "
        "when not all of them do.")
      .range(-1, 1 << 20);
  b.add_enum("train.compute_shard", TILLER_FIELD(train.compute_shard),
        "Whether the trained roles keep a persistent bf16 copy of their fp32 master shards: keep (2 bytes per "
        "parameter / N more, no cast per gather), cast (each all-gather casts the master shard first, as FSDP2 does), "
        "or auto: keep when the memory plan fits it beside the activations train.recompute keeps (tiller plan prints "
        "the choice; cast when no GPU size is known). Moot with fp32 compute or optimizer_offload: cpu.")
      ;
  b.add("train.optimizer_threads", TILLER_FIELD(train.optimizer_threads),
        "Threads of each rank's CPU AdamW (roles.<role>.optimizer_offload: cpu). 0: the host's cores divided by the "
        "ranks on it.")
      .range(0, 4096);
  b.add("train.step_hooks", TILLER_FIELD(train.step_hooks),
        "Step hooks of a trainer of your own, by registered name, comma-separated, run in that order on the "
        "controller: after each step is scored (filter or reweight), at its end (metrics, stop), after each "
        "checkpoint (docs/library.md). Empty: none.");
  b.add_enum("train.reduce_dtype", TILLER_FIELD(train.reduce_dtype),
        "The dtype gradients are reduce-scattered in across a role's ranks: fp32, or bf16 (half the traffic; the "
        "ranks' sum is rounded to bf16 before it joins the fp32 accumulator, as FSDP2's reduce_dtype=bf16).")
      ;
  b.add_enum("train.old_logprobs", TILLER_FIELD(train.old_logprobs),
        "Where the policy loss's old log-probs come from: recompute (the actor scores every sample before training, "
        "a forward pass per token) or forward (strictly on-policy runs only: sync mode, one PPO epoch, one mini-batch, "
        "no KL in the reward, no importance correction; the training forward's own log-probs, detached, so the ratio "
        "is 1 and the actor's scoring pass is skipped).")
      ;
  b.add("train.actor_lr", TILLER_FIELD(train.actor_lr), "Actor learning rate.").range(0.0, 1.0);
  b.add("train.critic_lr", TILLER_FIELD(train.critic_lr), "Critic learning rate.").range(0.0, 1.0);
  b.add("train.weight_decay", TILLER_FIELD(train.weight_decay), "AdamW weight decay (not on norms and biases).")
      .range(0.0, 1.0);
  b.add("train.adam_beta1", TILLER_FIELD(train.adam_beta1), "AdamW beta1.").range(0.0, 1.0);
  b.add("train.adam_beta2", TILLER_FIELD(train.adam_beta2), "AdamW beta2.").range(0.0, 1.0);
  b.add("train.adam_eps", TILLER_FIELD(train.adam_eps), "AdamW epsilon.").range(0.0, 1.0);
  b.add("train.max_grad_norm", TILLER_FIELD(train.max_grad_norm), "Global gradient-norm clip (0: off).")
      .range(0.0, 1e9);
  b.add_enum("train.lr_schedule", TILLER_FIELD(train.lr_schedule), "constant, linear or cosine, after the warmup.")
      ;
  b.add("train.warmup_steps", TILLER_FIELD(train.warmup_steps), "Linear warmup in optimizer steps.")
      .range(0, kMaxCount);
  b.add("train.min_lr_ratio", TILLER_FIELD(train.min_lr_ratio), "Floor of linear/cosine decay, as a fraction of the LR.")
      .range(0.0, 1.0);

  b.add("train.critic_warmup_steps", TILLER_FIELD(train.critic_warmup_steps),
        "First steps that train only the critic: no actor update and no weight sync.")
      .range(0, kMaxCount);
}

}  // namespace tiller::config_schema::detail
