// tiller tokenize | generate | init-model: the model subsystem from the command line.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>

#include <unistd.h>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "tiller/core/error.h"
#include "tiller/core/deadline.h"
#include "tiller/core/files.h"
#include "tiller/engine/server.h"
#include "tiller/text/chat_template.h"
#include "tiller/model/generate.h"
#include "tiller/model/lora.h"
#include "tiller/model/model_config.h"
#include "tiller/model/safetensors.h"
#include "tiller/text/tokenizer.h"
#include "tiller/model/weights.h"

namespace tiller::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string read_all(const std::string& path) {
  auto text = read_file(path);
  if (!text) throw ConfigError(fmt::format("{}: cannot open", path));
  return *text;
}

at::Device parse_device(const std::string& d) {
  if (d == "cpu") return at::kCPU;
  const std::string index = d.rfind("cuda:", 0) == 0 ? d.substr(5) : "";
  if (d == "cuda" || (!index.empty() && index.size() <= 3 &&
                      std::all_of(index.begin(), index.end(), [](char c) { return c >= '0' && c <= '9'; })))
    return at::Device(d);
  throw ConfigError(fmt::format("--device '{}': use cpu or cuda[:N]", d));
}

// --- tokenize -----------------------------------------------------------------------------------
struct TokenizeOptions {
  std::string tokenizer, text, file;
  bool add_special = false;
};

int run_tokenize(const TokenizeOptions& o) {
  auto tok = text::load_tokenizer(o.tokenizer);
  const std::string text = o.file.empty() ? o.text : read_all(o.file);
  const auto ids = tok->encode(text, o.add_special);
  json tokens = json::array();
  for (int64_t id : ids) tokens.push_back(tok->id_to_token(id));
  json out{{"ids", ids}, {"num_tokens", ids.size()}, {"tokens", tokens}};
  std::printf("%s\n", out.dump(-1, ' ', false, json::error_handler_t::replace).c_str());
  return 0;
}

// --- generate -----------------------------------------------------------------------------------
struct GenerateOptions {
  std::string model, tokenizer, prompts, out, input_key = "input", chat_template = "none", input_template;
  std::string chat_template_kwargs;  // a JSON object, as data.chat_template_kwargs
  std::string device = "cpu", dtype = "fp32";
  model::SamplingParams sampling;
  std::vector<int64_t> stop_ids;
  bool ignore_eos = false;
  int64_t batch_size = 16;
  std::string engine, engine_token_file;  // generate on a running engine instead
  std::string engine_tls_ca, engine_tls_server_name;
  double engine_timeout_s = 600;
  std::string lora;  // a PEFT LoRA adapter directory, applied unmerged
};

// The same completions from a running engine (`tiller engine`): one stream, prompt i as request i
// with seed + i, so a greedy or seeded run equals the reference's.
std::vector<model::Completion> generate_on_engine(const GenerateOptions& o, const model::ModelConfig& cfg,
                                                  const std::vector<std::vector<int64_t>>& ids) {
  engine::ClientOptions co;
  co.address = o.engine;
  co.token = read_engine_token(o.engine_token_file, "--engine-token-file");
  co.tls.ca = o.engine_tls_ca;
  co.tls.server_name = o.engine_tls_server_name;
  engine::EngineClient client(co);
  const engine::ServerHealth h = client.health();
  if (h.vocab_size != cfg.vocab_size)
    throw ConfigError(fmt::format("the engine at {} serves a model with vocab_size {}, --model {} has {}: not the same model",
                                  o.engine, h.vocab_size, o.model, cfg.vocab_size));
  std::vector<engine::Request> reqs;
  for (size_t i = 0; i < ids.size(); ++i) {
    engine::Request r;
    r.id = i;
    r.prompt = ids[i];
    r.params = o.sampling;
    r.params.seed = o.sampling.seed + i;
    reqs.push_back(std::move(r));
  }
  std::vector<model::Completion> out(ids.size());
  for (auto& s : client.generate(reqs, Deadline::after_seconds(o.engine_timeout_s))) {
    model::Completion& c = out.at(s.request_id);
    c.tokens = std::move(s.tokens);
    c.logprobs = std::move(s.logprobs);
    c.finish_reason = s.finish_reason;
  }
  return out;
}

struct Prompt {
  std::string text;
  std::vector<int64_t> ids;
};

std::vector<Prompt> read_prompts(const GenerateOptions& o, const text::Tokenizer& tok) {
  std::ifstream in(o.prompts);
  if (!in) throw ConfigError(fmt::format("{}: cannot open the prompts file", o.prompts));
  const text::ChatTemplate chat =
      text::load_chat_template(o.chat_template, o.tokenizer.empty() ? o.model : o.tokenizer, tok,
                                o.chat_template_kwargs);
  std::vector<Prompt> out;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", o.prompts, n);
    json j;
    try {
      j = json::parse(line);
    } catch (const json::exception&) {
      throw ConfigError(fmt::format("{}: not a JSON object (one prompt per line)", where));
    }
    if (!j.is_object() || !j.contains(o.input_key))
      throw ConfigError(fmt::format("{}: no key '{}' (choose the field with --input-key)", where, o.input_key));
    const json& v = j[o.input_key];
    std::vector<text::ChatMessage> messages;
    if (v.is_string()) {
      std::string s = v.get<std::string>();
      if (!o.input_template.empty()) s = text::apply_input_template(o.input_template, s);
      messages.push_back({"user", s});
    } else if (v.is_array()) {
      if (!chat.enabled())
        throw ConfigError(fmt::format("{}: '{}' is a conversation; pass --chat-template auto|model|chatml|llama3|FILE.jinja",
                                      where, o.input_key));
      for (const auto& m : v) {
        if (!m.is_object() || !m.contains("role") || !m.contains("content") || !m["content"].is_string())
          throw ConfigError(fmt::format("{}: messages need 'role' and 'content' strings", where));
        messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
      }
    } else {
      throw ConfigError(fmt::format("{}: '{}' must be a string or a list of messages", where, o.input_key));
    }
    Prompt p;
    if (!chat.enabled()) {
      p.text = messages[0].content;
      p.ids = tok.encode(p.text, /*add_special_tokens=*/true);
    } else {
      try {
        p.text = chat.render(messages, /*add_generation_prompt=*/true);
      } catch (const ConfigError& e) {
        throw ConfigError(fmt::format("{}: {}", where, e.what()));
      }
      p.ids = tok.encode(p.text, /*add_special_tokens=*/false);  // the template carries BOS
    }
    if (p.ids.empty()) throw ConfigError(fmt::format("{}: the prompt encodes to no tokens", where));
    out.push_back(std::move(p));
  }
  if (out.empty()) throw ConfigError(fmt::format("{}: no prompts", o.prompts));
  return out;
}

int run_generate(GenerateOptions o) {
  o.model = fetch_hub_model(o.model, "--model");  // a hub id: from the cache, or downloaded
  if (!o.tokenizer.empty()) o.tokenizer = fetch_hub_model(o.tokenizer, "--tokenizer");
  model::LoadedModel m;
  if (!o.lora.empty() && !o.engine.empty())
    throw ConfigError("--lora with --engine: the engine serves the weights and adapter it loaded; start it with "
                      "`tiller engine --lora DIR`, or merge the adapter into a checkpoint (tiller merge-lora)");
  if (o.engine.empty()) m = model::load_model(o.model, model::Head::kLm, parse_dtype(o.dtype), parse_device(o.device));
  else m.config = model::load_model_config(o.model);  // the engine holds the weights
  if (!o.lora.empty()) {  // PEFT's adapters in fp32 beside the base, as PEFT runs them
    const model::PeftAdapter a = model::read_peft_adapter(o.lora, m.config);
    model::NamedTensors adapters;
    for (const auto& [name, t] : a.tensors) adapters[name] = t.to(parse_device(o.device));
    model::bind_lora(m.config, a.spec, adapters, m.weights, o.lora);
    for (auto& [name, t] : adapters) m.tensors[name] = std::move(t);  // kept alive with the model
  }
  auto tok = text::load_tokenizer(o.tokenizer.empty() ? o.model : o.tokenizer);
  if (tok->vocab_size() > m.config.vocab_size)
    throw ConfigError(fmt::format("the tokenizer has {} tokens but the model's vocab_size is {}", tok->vocab_size(),
                                  m.config.vocab_size));
  const auto prompts = read_prompts(o, *tok);
  o.sampling.stop_token_ids = o.stop_ids;
  if (!o.ignore_eos)
    for (int64_t e : text::eos_token_ids(o.model, m.config, *tok)) o.sampling.stop_token_ids.push_back(e);
  std::vector<std::vector<int64_t>> ids;
  for (const auto& p : prompts) ids.push_back(p.ids);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<model::Completion> completions;
  if (o.engine.empty()) {
    // A batch at a time, with a progress line after each (stderr; the JSONL goes to --out or
    // stdout). Prompt i still samples with seed + i: each batch's seed starts at its first prompt.
    int64_t tokens = 0;
    for (size_t start = 0; start < ids.size(); start += static_cast<size_t>(o.batch_size)) {
      const size_t end = std::min(ids.size(), start + static_cast<size_t>(o.batch_size));
      model::SamplingParams params = o.sampling;
      params.seed = o.sampling.seed + start;
      auto part = model::generate(m.config, m.weights, std::vector<std::vector<int64_t>>(ids.begin() + start, ids.begin() + end),
                                  params, o.batch_size);
      for (auto& c : part) {
        tokens += static_cast<int64_t>(c.tokens.size());
        completions.push_back(std::move(c));
      }
      if (ids.size() > static_cast<size_t>(o.batch_size)) {
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::fprintf(stderr, "generate: %zu/%zu prompts, %lld tokens, %.0f tokens/s\n", end, ids.size(),
                     static_cast<long long>(tokens), s > 0 ? static_cast<double>(tokens) / s : 0.0);
      }
    }
  } else {
    completions = generate_on_engine(o, m.config, ids);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  std::FILE* out = stdout;
  const std::string tmp = o.out + ".tmp";
  if (!o.out.empty()) {
    out = std::fopen(tmp.c_str(), "w");
    if (!out) throw IoError(fmt::format("{}: cannot write", tmp));
  }
  int64_t generated = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto& c = completions[i];
    generated += static_cast<int64_t>(c.tokens.size());
    json j{{"index", i},
           {"prompt", prompts[i].text},
           {"prompt_ids", prompts[i].ids},
           {"response", tok->decode(c.tokens, /*skip_special_tokens=*/true)},
           {"response_ids", c.tokens},
           {"logprobs", c.logprobs},
           {"finish_reason", c.finish_reason}};
    std::fprintf(out, "%s\n", j.dump(-1, ' ', false, json::error_handler_t::replace).c_str());
  }
  if (out != stdout) {
    const bool ok = std::fflush(out) == 0 && fsync(fileno(out)) == 0;
    std::fclose(out);
    if (!ok) throw IoError(fmt::format("{}: write failed", tmp));
    fs::rename(tmp, o.out);
  }
  std::fprintf(stderr, "tiller generate: %zu prompts, %lld tokens in %.3f s (%.1f tokens/s)\n", prompts.size(),
               static_cast<long long>(generated), secs, generated / std::max(secs, 1e-9));
  return 0;
}

// --- merge-lora ---------------------------------------------------------------------------------
struct MergeLoraOptions {
  std::string model, lora, to, dtype;
};

// A full Hugging Face checkpoint: the base with a PEFT adapter merged into its weights as PEFT's
// merge_and_unload does, and the base's other files (config, tokenizer, generation config).
int run_merge_lora(MergeLoraOptions o) {
  o.model = fetch_hub_model(o.model, "--model");  // a hub id: from the cache, or downloaded
  const model::ModelConfig cfg = model::load_model_config(o.model);
  const model::PeftAdapter a = model::read_peft_adapter(o.lora, cfg);
  std::optional<at::ScalarType> dtype;
  if (!o.dtype.empty()) dtype = parse_dtype(o.dtype);
  const int64_t merged = model::write_merged_model(o.model, a.spec, a.tensors, o.to, dtype);
  std::printf("%s\n",
              json{{"model", o.model}, {"lora", o.lora}, {"to", o.to}, {"rank", a.spec.rank}, {"merged_weights", merged}}
                  .dump()
                  .c_str());
  return 0;
}

// --- init-model ---------------------------------------------------------------------------------
struct InitOptions {
  std::string preset, out, dtype = "bf16", tokenizer_from, device = "cpu";
  uint64_t seed = 0;
  bool value_head = false;
  bool config_only = false;
  double rope_yarn = 0;  // > 1: YaRN RoPE scaling by this factor
};

int run_init(const InitOptions& o) {
  model::ModelConfig cfg = model::preset(o.preset);
  if (o.rope_yarn > 0) {  // Qwen2.5's way to 128k: the same weights, YaRN over the trained context
    cfg.rope_scaling.type = "yarn";
    cfg.rope_scaling.factor = o.rope_yarn;
    cfg.rope_scaling.original_max_position_embeddings = cfg.max_position_embeddings;
  }
  const model::Head head = o.value_head ? model::Head::kValue : model::Head::kLm;
  if (o.config_only) {  // the shape alone: what tiller plan's memory plan reads
    fs::create_directories(o.out);
    write_file_atomic(o.out + "/config.json", model::to_hf_config_json(cfg, o.value_head));
    std::printf("%s\n", json{{"preset", o.preset}, {"out", o.out}, {"config_only", true}}.dump().c_str());
    return 0;
  }
  // Drawn on a GPU, a tensor at a time, and stored on the host: in parallel, where the host's
  // generator is serial (other values than the host draws for the seed, the same distribution).
  const at::Device device = parse_device(o.device);
  if (const int gpus = at::detail::getCUDAHooks().getNumGPUs(); !device.is_cpu() && gpus == 0)
    throw ConfigError(fmt::format("--device {}: this build or machine has no CUDA device; use --device cpu", o.device));
  else if (device.has_index() && device.index() >= gpus)
    throw ConfigError(fmt::format("--device {}: this machine has {} CUDA devices (cuda:0 to cuda:{})", o.device, gpus,
                                  gpus - 1));
  model::NamedTensors t = model::init_weights(cfg, head, o.seed, parse_dtype(o.dtype), device, at::Device(at::kCPU));
  model::save_model(o.out, cfg, model::bind_weights(cfg, t, head, o.preset), head);
  if (!o.tokenizer_from.empty()) {
    for (const char* f : {"tokenizer.json", "tokenizer.model", "tokenizer_config.json"}) {
      const fs::path src = fs::path(o.tokenizer_from) / f;
      if (fs::exists(src)) fs::copy_file(src, fs::path(o.out) / f, fs::copy_options::overwrite_existing);
    }
  }
  std::printf("%s\n", json{{"preset", o.preset}, {"out", o.out}, {"parameters", model::num_parameters(cfg)}}.dump().c_str());
  return 0;
}

}  // namespace

void add_model_commands(CLI::App& app, Runner& run) {
  auto* tk = app.add_subcommand("tokenize", "Encode text with a model's tokenizer; prints ids as JSON");
  auto to = std::make_shared<TokenizeOptions>();
  tk->add_option("--tokenizer", to->tokenizer, "Directory with tokenizer.json or tokenizer.model")->required();
  auto* text = tk->add_option("--text", to->text, "Text to encode");
  auto* file = tk->add_option("--file", to->file, "Encode this file's contents");
  text->excludes(file);
  tk->add_flag("--add-special-tokens", to->add_special, "Apply the tokenizer's template (e.g. BOS)");
  tk->callback([&run, to, text, file] {
    if (text->count() + file->count() != 1) throw CLI::ValidationError("tokenize", "give --text or --file");
    run = [to] { return run_tokenize(*to); };
  });

  auto* gen = app.add_subcommand(
      "generate", "Sample from a checkpoint with the reference sampler, or on a running engine (--engine); writes JSONL");
  auto go = std::make_shared<GenerateOptions>();
  gen->add_option("--model", go->model, "HF model directory (config.json + safetensors), or a hub id (Org/Name[@rev]): from the HF cache, or downloaded")->required();
  gen->add_option("--prompts", go->prompts, "JSONL file, one prompt per line")->required();
  gen->add_option("--out", go->out, "Write JSONL here (default: stdout)");
  gen->add_option("--tokenizer", go->tokenizer, "Tokenizer directory (default: --model)");
  gen->add_option("--input-key", go->input_key, "Field holding the prompt (a string or a list of messages)");
  gen->add_option("--chat-template", go->chat_template, "none, auto (the model's own Jinja template, else ChatML/Llama-3 by its tokens), model, chatml, llama3 or a .jinja file");
  gen->add_option("--chat-template-kwargs", go->chat_template_kwargs,
                  "Extra variables for a Jinja chat template, a JSON object: '{\"enable_thinking\": false}'");
  gen->add_option("--input-template", go->input_template, "Template with one {} for the prompt, e.g. 'Q: {}\\nA:'");
  gen->add_flag("--greedy", go->sampling.greedy, "Greedy decoding");
  gen->add_option("--temperature", go->sampling.temperature, "Sampling temperature (> 0)");
  gen->add_option("--top-p", go->sampling.top_p, "Nucleus sampling mass (0, 1]");
  gen->add_option("--top-k", go->sampling.top_k, "Keep the k most likely tokens (0: off)");
  gen->add_option("--min-p", go->sampling.min_p, "Drop tokens below min_p x the top probability");
  gen->add_option("--seed", go->sampling.seed, "Prompt i samples with seed + i");
  gen->add_option("--max-new-tokens", go->sampling.max_new_tokens, "Tokens to generate at most")->required();
  gen->add_option("--stop-token-ids", go->stop_ids, "Extra stop tokens")->delimiter(',');
  gen->add_flag("--ignore-eos", go->ignore_eos, "Do not stop at the model's eos tokens");
  gen->add_option("--batch-size", go->batch_size, "Prompts per batch")->check(CLI::Range(1, 1 << 20));
  gen->add_option("--device", go->device, "cpu or cuda[:N] (not with --engine: the engine has its own)");
  gen->add_option("--dtype", go->dtype, "fp32, bf16 or fp16 (not with --engine)");
  gen->add_option("--engine", go->engine, "host:port of a running `tiller engine` to generate on");
  gen->add_option("--engine-token-file", go->engine_token_file,
                  "File with the engine's shared secret (default: $TILLER_ENGINE_TOKEN)");
  gen->add_option("--engine-tls-ca", go->engine_tls_ca,
                  "PEM roots to verify the engine's certificate with: dial it over TLS (for a self-signed engine "
                  "certificate, the certificate itself)");
  gen->add_option("--engine-tls-server-name", go->engine_tls_server_name,
                  "The name the engine's certificate must carry (default: the host of --engine)");
  gen->add_option("--engine-timeout", go->engine_timeout_s, "Seconds the engine may take for all prompts");
  gen->add_option("--lora", go->lora,
                  "A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) to apply, "
                  "unmerged and in fp32, as PEFT runs it (not with --engine)");
  gen->callback([&run, go] { run = [go] { return run_generate(*go); }; });

  auto* ml = app.add_subcommand("merge-lora", "Merge a PEFT LoRA adapter into its base: a full HF checkpoint");
  auto mo = std::make_shared<MergeLoraOptions>();
  ml->add_option("--model", mo->model, "The base: an HF model directory, or a hub id (Org/Name[@rev])")->required();
  ml->add_option("--lora", mo->lora, "The PEFT adapter directory")->required();
  ml->add_option("--to", mo->to, "Output directory (the base's config and tokenizer files are copied)")->required();
  ml->add_option("--dtype", mo->dtype, "bf16, fp16 or fp32 (default: each weight's dtype in the base)");
  ml->callback([&run, mo] { run = [mo] { return run_merge_lora(*mo); }; });

  auto* init = app.add_subcommand("init-model", "Write a randomly initialised HF checkpoint of a preset shape");
  auto io = std::make_shared<InitOptions>();
  init->add_option("--preset", io->preset, fmt::format("{}", fmt::join(model::preset_names(), ", ")))->required();
  init->add_option("--out", io->out, "Output directory")->required();
  init->add_option("--dtype", io->dtype, "bf16, fp16 or fp32");
  init->add_option("--seed", io->seed, "Random seed");
  init->add_option("--device", io->device,
                   "Where to draw the weights: cpu (default) or cuda[:N] (in parallel, for large presets; other "
                   "values for the same seed)");
  init->add_flag("--value-head", io->value_head, "A value model (score head) instead of a causal LM");
  init->add_flag("--config-only", io->config_only, "Write config.json alone (a shape for tiller plan), no weights");
  init->add_option("--tokenizer-from", io->tokenizer_from, "Copy tokenizer files from this directory");
  init->add_option("--rope-yarn", io->rope_yarn,
                   "YaRN RoPE scaling by this factor over the preset's context (rope_scaling in config.json; 4 takes "
                   "the Qwen2.5 shapes from 32k to 128k, as Qwen documents)")
      ->check(CLI::Range(1.0, 64.0));
  init->callback([&run, io] { run = [io] { return run_init(*io); }; });
}

}  // namespace tiller::cli
