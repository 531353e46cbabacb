// tiller bench tokenize: encoding throughput of a tokenizer on a text file (JSON). The peer,
// Hugging Face `tokenizers`, is measured beside it by scripts/bench_tokenize.py, which also checks
// that the ids are the same.
#include <chrono>
#include <fstream>
#include <memory>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "tiller/core/error.h"
#include "tiller/core/files.h"
#include "tiller/text/tokenizer.h"

namespace tiller::cli {
namespace {

struct TokenizeBenchOptions {
  std::string tokenizer, file, ids_out, out;
  int repeats = 1;
};

int run_tokenize_bench(const TokenizeBenchOptions& o) {
  const auto tok = text::load_tokenizer(o.tokenizer);
  const std::optional<std::string> text = read_file(o.file);
  if (!text) throw IoError(fmt::format("{}: cannot read the text to tokenize", o.file));
  std::vector<int64_t> ids;
  std::vector<double> seconds;
  for (int r = 0; r < o.repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    ids = tok->encode(*text, /*add_special_tokens=*/false);
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  if (!o.ids_out.empty()) {
    std::string line;
    for (size_t i = 0; i < ids.size(); ++i) line += (i ? " " : "") + std::to_string(ids[i]);
    write_file_atomic(o.ids_out, line + "\n");
  }
  const double s = median(seconds);
  const nlohmann::json j{{"bench", "tokenize"},
                         {"tokenizer", o.tokenizer},
                         {"bytes", text->size()},
                         {"tokens", ids.size()},
                         {"seconds", s},
                         {"mb_per_s", static_cast<double>(text->size()) / 1e6 / s}};
  emit_json(j.dump(), o.out);
  return 0;
}

}  // namespace

void add_bench_tokenize(CLI::App* bench, Runner& run) {
  auto* t = bench->add_subcommand("tokenize", "Encoding throughput of a tokenizer on a text file (JSON)");
  auto o = std::make_shared<TokenizeBenchOptions>();
  t->add_option("--tokenizer", o->tokenizer, "Directory with tokenizer.json or tokenizer.model")->required();
  t->add_option("--file", o->file, "Text to encode (one string, newlines included)")->required();
  t->add_option("--repeats", o->repeats, "Encodings timed (the median is reported)")->check(CLI::Range(1, 100));
  t->add_option("--ids-out", o->ids_out, "Write the ids here, space-separated");
  t->add_option("--out", o->out, "Also write the JSON here");
  t->callback([&run, o] { run = [o] { return run_tokenize_bench(*o); }; });
}

}  // namespace tiller::cli
