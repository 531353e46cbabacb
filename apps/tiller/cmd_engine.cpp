// tiller engine: one inference engine behind its gRPC service (under mpirun for --tp > 1).
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "controller/standalone_engines.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/core/signals.h"
#include "tiller/core/tls.h"
#include "tiller/engine/engine.h"
#include "tiller/engine/engine_weights.h"
#include "tiller/engine/openai_server.h"
#include "tiller/engine/server.h"
#include "tiller/sync/weight_push.h"
#include "tiller/text/chat_template.h"
#include "tiller/text/tokenizer.h"

namespace tiller::cli {
namespace {

struct EngineCmdOptions {
  std::string model, host = "127.0.0.1", device = "auto", dtype = "auto", token_file, tls_cert, tls_key, lora;
  bool insecure = false;
  int port = 50051;
  int openai_port = -1;  // >= 0: also serve the OpenAI-compatible endpoint there (0: any free port)
  std::string served_model_name, chat_template = "auto";
  double openai_timeout_s = 600;
  int openai_threads = 0;  // 0: the engine's max_num_seqs + 16
  std::string tool_call_parser = "none";
  int tp = 1;
  engine::EngineOptions engine;
  bool no_chunked_prefill = false;
  bool no_cuda_graphs = false;
  bool no_async = false;
  double timeout_s = 120;
  double sync_timeout_s = 600;
  std::string join_dir, advertise;
  std::string drain, tls_ca;  // --drain HOST:PORT: drain that engine, and exit
};

// An engine reachable from other machines serves only callers with its token, unless the user
// says --insecure: generation and weight updates are not for anyone on the network.
std::string engine_token_for(const EngineCmdOptions& o) {
  const std::string token = read_engine_token(o.token_file, "--token-file");
  if (!token.empty() || is_loopback_host(o.host)) return token;
  if (!o.insecure)
    throw ConfigError(fmt::format("--host {} serves beyond this machine, and no token is set: give one "
                                  "(--token-file or $TILLER_ENGINE_TOKEN), bind 127.0.0.1, or pass --insecure to "
                                  "let anyone who can reach the port generate and replace the weights",
                                  o.host));
  log::warn("engine: --insecure: serving on {} without a token; anyone who can reach the port can generate and "
            "replace the weights",
            o.host);
  return token;
}

// tiller engine --drain HOST:PORT: tells a running engine to drain, and prints what it still holds.
int drain_engine(const EngineCmdOptions& o) {
  engine::ClientOptions co;
  co.address = o.drain;
  co.token = read_engine_token(o.token_file, "--token-file");
  co.tls.ca = o.tls_ca;
  co.timeout_seconds = o.timeout_s;
  engine::EngineClient client(co);
  const int64_t live = client.drain();
  std::printf("%s\n", nlohmann::json{{"event", "draining"}, {"engine", o.drain}, {"live_requests", live}}.dump().c_str());
  return 0;
}

int run_engine(EngineCmdOptions o, int* argc, char*** argv) {
  if (!o.drain.empty()) return drain_engine(o);
  if (o.model.empty()) throw ConfigError("tiller engine: --model is required (or --drain HOST:PORT)");
  block_stop_signals();  // taken by the watcher below; before any thread starts
  const std::string token = engine_token_for(o);  // before any work: a refusal costs nothing

  dist::MpiEnv env(argc, argv);
  log::init(env.rank(), env.rank() == 0 ? "engine" : "engine.tp", log::Level::kInfo);
  if (env.size() != o.tp)
    throw ConfigError(fmt::format("--tp {} needs exactly {} ranks (mpirun -np {}); this job has {}", o.tp, o.tp, o.tp,
                                  env.size()));
  const int gpus = at::detail::getCUDAHooks().getNumGPUs();
  RankComm rc;
  if (o.tp > 1) {
    rc = open_rank_comm(env, o.device == "cpu" ? "mpi" : "auto", o.timeout_s, "engine.tp");
    o.engine.device = rc.device.str();
  } else {
    o.engine.device = o.device == "auto" ? (gpus > 0 ? "cuda:0" : "cpu") : o.device;
  }
  o.engine.limits.chunked_prefill = !o.no_chunked_prefill;
  o.engine.cuda_graphs = !o.no_cuda_graphs;
  o.engine.async_scheduling = !o.no_async;
  dist::Communicator* tp = o.tp > 1 ? &rc.comm() : nullptr;
  if (tp) tp->set_timeout(o.timeout_s);
  o.model = fetch_hub_model(o.model, "--model", &env);  // a hub id: once per node (TP ranks), within 2 h
  engine::EngineWeights w = engine::load_engine_weights(o.model, env.rank(), o.tp, o.dtype, o.engine.device);
  if (!o.lora.empty()) {  // a PEFT adapter, unmerged beside the base (fp32, each rank its slice)
    const model::PeftAdapter a = model::read_peft_adapter(o.lora, w.config);
    engine::bind_lora_for_tp(w.config, a.spec, a.tensors, w.weights, env.rank(), o.tp, o.engine.device, o.lora);
  }
  engine::Engine eng(w.config, std::move(w.weights), o.engine, tp);
  // Weight syncs pushed by a job's actor ranks (delta sync, docs/sync.md): this engine is no rank of
  // that job, so its weights come over its own service.
  sync::PushReceiver pushed(eng, tp, o.sync_timeout_s);
  eng.set_weight_sink(&pushed);
  if (!eng.is_leader()) {
    eng.follow();
    return 0;
  }
  engine::ServerOptions so;
  so.address = fmt::format("{}:{}", o.host, o.port);
  so.token = token;
  so.tls.cert = o.tls_cert;
  so.tls.key = o.tls_key;
  engine::EngineServer server(eng, so);
  std::unique_ptr<engine::OpenAiServer> openai;
  if (o.openai_port >= 0) {
    // The model's tokenizer and chat template, as `tiller generate` and the trainer read them.
    std::shared_ptr<const text::Tokenizer> tok = text::load_tokenizer(o.model);
    const text::ChatTemplate chat = text::load_chat_template(o.chat_template, o.model, *tok);
    engine::OpenAiOptions ao;
    ao.host = o.host;
    ao.port = o.openai_port;
    ao.token = token;
    ao.tls.cert = o.tls_cert;
    ao.tls.key = o.tls_key;
    ao.model_name = !o.served_model_name.empty() ? o.served_model_name : o.model;
    ao.request_timeout_s = o.openai_timeout_s;
    ao.tool_call_parser = o.tool_call_parser;
    // One thread per open request: fewer than the engine's sequences would cap its batch (16
    // threads held a 1.5B engine to 8k tokens/s at 64 and 256 clients, 0.16-0.32x the gRPC path).
    ao.threads = o.openai_threads > 0 ? o.openai_threads
                                      : static_cast<int>(std::min<int64_t>(o.engine.limits.max_num_seqs + 16, 4096));
    openai = std::make_unique<engine::OpenAiServer>(server, tok, chat, text::eos_token_ids(o.model, w.config, *tok),
                                                    eng.max_model_len(), ao);
    log::info("engine: OpenAI-compatible endpoint on {}://{}:{}/v1 (model '{}', chat template {})",
              o.tls_cert.empty() ? "http" : "https", o.host, openai->port(), ao.model_name, chat.name());
  }
  // A job's rendezvous folder (engines.rendezvous_dir): the job takes this engine in at its next
  // weight sync. The announcement goes when the engine stops.
  std::string announced;
  if (!o.join_dir.empty()) {
    std::string host = o.advertise;
    if (host.empty()) host = (o.host == "0.0.0.0" || o.host == "::" || o.host.empty()) ? env.hostname() : o.host;
    const std::string address = fmt::format("{}:{}", host, server.port());
    announced = controller::announce_engine(o.join_dir, address, static_cast<long>(getpid()));
    log::info("engine: announced as {} in {}", address, announced);
  }
  std::printf("%s\n", nlohmann::json{{"event", "serving"},
                                     {"port", server.port()},
                                     {"openai_port", openai ? openai->port() : -1},
                                     {"pid", static_cast<int64_t>(getpid())},
                                     {"model", o.model},
                                     {"lora", o.lora},
                                     {"tp", o.tp},
                                     {"device", o.engine.device},
                                     {"max_model_len", eng.max_model_len()},
                                     {"kv_blocks", eng.stats().kv_blocks_total}}
                          .dump()
                          .c_str());
  std::fflush(stdout);
  {
    // The first signal drains (the requests it holds finish, a job moves the rest elsewhere); the
    // second stops at once.
    std::atomic<int> signals{0};
    StopSignalWatcher watcher([&] {
      if (signals++ == 0) {
        log::info("engine: draining on a signal (a second one stops it at once)");
        if (!announced.empty()) std::remove(announced.c_str());  // no job takes it in any more
        server.drain();
      } else {
        log::info("engine: stopping on a second signal");
        server.shutdown();
      }
    });
    server.wait();
  }
  if (!announced.empty()) std::remove(announced.c_str());
  if (openai) openai->shutdown();
  const std::string failure = server.error();
  server.shutdown();
  if (!failure.empty()) throw Error("the engine loop failed: " + failure);
  const engine::EngineStats s = eng.stats();
  log::info("engine: served {} requests, {} generated tokens in {} steps", s.requests_finished, s.generated_tokens,
            s.steps);
  return 0;
}

}  // namespace

std::string read_engine_token(const std::string& file, const char* flag) {
  try {
    return sync::standalone_engine_token(file);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("{} {}", flag, e.what()));
  }
}

void add_engine_command(CLI::App& app, Runner& run, int& argc, char**& argv) {
  auto* cmd = app.add_subcommand("engine", "Serve one inference engine over gRPC (mpirun -np N for --tp N)");
  auto o = std::make_shared<EngineCmdOptions>();
  cmd->add_option("--model", o->model, "HF model directory (config.json + safetensors), or a hub id (Org/Name[@rev]): from the HF cache, or downloaded");
  cmd->add_option("--drain", o->drain,
                  "HOST:PORT of a running engine to drain (it finishes its requests, takes no new one, then stops; a "
                  "job moves its prompts elsewhere), with --token-file and --tls-ca as it needs; SIGTERM to the "
                  "engine does the same");
  cmd->add_option("--tls-ca", o->tls_ca, "With --drain: PEM roots to verify the engine's certificate (dials TLS)");
  cmd->add_option("--host", o->host,
                  "Address to bind (default 127.0.0.1: this machine only; another address needs a token or "
                  "--insecure)");
  cmd->add_flag("--insecure", o->insecure, "Serve a non-loopback --host without a token (logged as a warning)");
  cmd->add_option("--tls-cert", o->tls_cert, "PEM certificate to serve TLS with (with --tls-key)");
  cmd->add_option("--tls-key", o->tls_key, "PEM private key of --tls-cert");
  cmd->add_option("--port", o->port, "Port to bind (0: any free port; printed on stdout)")->check(CLI::Range(0, 65535));
  cmd->add_option("--openai-port", o->openai_port,
                  "Also serve an OpenAI-compatible HTTP endpoint (/v1/completions, /v1/chat/completions, /v1/models) "
                  "on this port of --host, with the same token (as 'Authorization: Bearer') and TLS; 0: any free port "
                  "(printed); docs/engine.md")
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--served-model-name", o->served_model_name,
                  "The model id the OpenAI endpoint lists and accepts (default: --model)");
  cmd->add_option("--chat-template", o->chat_template,
                  "The OpenAI endpoint's chat format: auto (the model's own), model, chatml, llama3, none, or a .jinja file");
  cmd->add_option("--openai-timeout", o->openai_timeout_s, "Seconds one OpenAI request may take")
      ->check(CLI::Range(1.0, 1e6));
  cmd->add_option("--openai-threads", o->openai_threads,
                  "OpenAI requests served at once, a thread each (default: the engine's --max-num-seqs + 16; more "
                  "wait in a queue, so fewer threads than clients caps the engine's batch)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--tool-call-parser", o->tool_call_parser,
                  "none, or hermes: chat replies' <tool_call>{...}</tool_call> blocks (Hermes, Qwen2.5) become "
                  "message.tool_calls when the request gives tools")
      ->check(CLI::IsMember({"none", "hermes"}));
  cmd->add_option("--lora", o->lora,
                  "A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors), served unmerged "
                  "beside the base in fp32, as PEFT and tiller's trainer run it");
  cmd->add_option("--tp", o->tp, "Tensor-parallel size (the number of ranks)")->check(CLI::Range(1, 64));
  cmd->add_option("--device", o->device, "auto, cpu or cuda[:N] (TP ranks take the GPU of their local rank)");
  cmd->add_option("--dtype", o->dtype, "auto (bf16 on GPU, fp32 on CPU), bf16, fp16 or fp32");
  cmd->add_option("--block-size", o->engine.block_size, "Tokens per KV block")->check(CLI::Range(1, 1024));
  cmd->add_option("--num-blocks", o->engine.num_blocks, "KV blocks (default: from --kv-cache-gb or free memory)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--kv-cache-gb", o->engine.kv_cache_gb, "KV cache size in GiB")->check(CLI::Range(0.001, 65536.0));
  cmd->add_option("--quantization", o->engine.quantization,
                  "none, or fp8: the linear layers in 128x128 blocks of e4m3, their GEMMs in FP8 (docs/engine.md)")
      ->check(CLI::IsMember({"none", "fp8"}));
  cmd->add_option("--fp8-scaling", o->engine.fp8_scaling,
                  "With --quantization fp8: block (128x128 blocks; default), channel (one scale per weight row and token) "
                  "or tensor (one per weight and one for a GEMM's activations)")
      ->check(CLI::IsMember({"channel", "block", "tensor"}));
  cmd->add_option("--kv-cache-dtype", o->engine.kv_cache_dtype,
                  "auto (the weights' dtype) or fp8: e4m3 with a scale per token and KV head, about half the bytes "
                  "(docs/engine.md)")
      ->check(CLI::IsMember({"auto", "fp8"}));
  cmd->add_option("--gpu-memory-fraction", o->engine.gpu_memory_fraction,
                  "Fraction of the free GPU memory (after the weights) for the KV cache")
      ->check(CLI::Range(0.01, 0.99));
  cmd->add_option("--max-num-seqs", o->engine.limits.max_num_seqs, "Sequences running at once")
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_option("--max-batched-tokens", o->engine.limits.max_batched_tokens, "Tokens per step")
      ->check(CLI::Range(1, 1 << 24));
  cmd->add_flag("--no-chunked-prefill", o->no_chunked_prefill, "Prefill each prompt in one step");
  cmd->add_flag("--no-cuda-graphs", o->no_cuda_graphs, "Run decode steps eagerly (no CUDA graphs)");
  cmd->add_flag("--no-async-scheduling", o->no_async,
                "Wait for each step's draws before launching the next (no host/GPU overlap)");
  cmd->add_option("--max-graph-batch", o->engine.max_graph_batch,
                  "Largest decode batch replayed from a CUDA graph (default: max-num-seqs, at most 512)")
      ->check(CLI::Range(1, 1 << 16));
  cmd->add_flag("--record-routes", o->engine.record_routes,
                "Routing replay: return each sample's experts per token (mixture-of-experts models)");
  cmd->add_option("--max-model-len", o->engine.max_model_len, "Prompt + new tokens at most (default: the config's)")
      ->check(CLI::Range(int64_t{1}, engine::kMaxModelLen));
  cmd->add_option("--token-file", o->token_file,
                  "File whose first line is the shared secret clients must send (default: $TILLER_ENGINE_TOKEN)");
  cmd->add_option("--join", o->join_dir,
                  "A running job's engines.rendezvous_dir: announce this engine there once it serves; the job takes "
                  "it in at its next weight sync (docs/cluster.md, standalone engines)");
  cmd->add_option("--advertise", o->advertise,
                  "The host the job reaches this engine by (default: --host, or this machine's name when --host is "
                  "0.0.0.0)");
  cmd->add_option("--sync-timeout", o->sync_timeout_s,
                  "Seconds one pushed weight sync may take, from Begin to the last bucket in place")
      ->check(CLI::Range(0.001, 1e7));
  cmd->add_option("--timeout", o->timeout_s, "TP: seconds a rank waits for the others before giving up")->check(CLI::Range(0.001, 1e7));
  cmd->callback([&run, o, &argc, &argv] { run = [o, &argc, &argv] { return run_engine(*o, &argc, &argv); }; });
}

}  // namespace tiller::cli
