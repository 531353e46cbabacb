// Hub downloads (hub_download.h): a few lines of Python call snapshot_download.
#if TILLER_HAVE_PYTHON
#include "python/py_ref.h"
#endif

#include "python/hub_download.h"

#include <fmt/format.h>

#include "python/interpreter.h"
#include "tiller/core/error.h"

namespace tiller::python {

#if TILLER_HAVE_PYTHON
namespace {

constexpr const char* kHubSource = R"PY(
ALLOW = ['*.json', '*.safetensors', '*.jinja', '*.txt', '*.model', '*.tiktoken']
IGNORE = ['original/*']


def download(repo, revision, cache_dir):
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ImportError('the embedded Python has no huggingface_hub (pip install huggingface_hub)') from e
    return snapshot_download(repo_id=repo, revision=revision, cache_dir=cache_dir, allow_patterns=ALLOW,
                             ignore_patterns=IGNORE)
)PY";

Ref g_module;  // under the GIL
std::string g_module_error;

// huggingface_hub's messages run over several lines: one line, at most 600 characters.
std::string one_line(const std::string& s) {
  std::string out;
  for (char ch : s) {
    const bool space = ch == '\n' || ch == '\r' || ch == '\t' || ch == ' ';
    if (space && (out.empty() || out.back() == ' ')) continue;
    out += space ? ' ' : ch;
  }
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out.size() > 600 ? out.substr(0, 600) + " ..." : out;
}

}  // namespace

std::string download_hub_snapshot(const std::string& key, const std::string& repo, const std::string& revision,
                                  const std::string& cache_dir) {
  start();
  Gil gil;
  if (!g_module && g_module_error.empty()) {
    g_module = module_from_source("tiller_hub", kHubSource, g_module_error);
    if (!g_module && g_module_error.empty()) g_module_error = "the module did not load";
  }
  const std::string by_hand =
      fmt::format("or download it first: huggingface-cli download {} --revision {}", repo, revision);
  if (!g_module) throw ConfigError(fmt::format("{} = '{}': cannot download: {}; {}", key, repo, g_module_error, by_hand));
  Ref fn(PyObject_GetAttrString(g_module.get(), "download"));
  Ref r(PyUnicode_FromStringAndSize(repo.data(), static_cast<Py_ssize_t>(repo.size())));
  Ref v(PyUnicode_FromStringAndSize(revision.data(), static_cast<Py_ssize_t>(revision.size())));
  Ref c(PyUnicode_FromStringAndSize(cache_dir.data(), static_cast<Py_ssize_t>(cache_dir.size())));
  if (!fn || !r || !v || !c) throw ConfigError(fmt::format("{} = '{}': cannot download: {}", key, repo, take_error()));
  Ref out(PyObject_CallFunctionObjArgs(fn.get(), r.get(), v.get(), c.get(), nullptr));
  if (!out)
    throw ConfigError(fmt::format("{} = '{}': the download from the Hugging Face hub (revision {}) failed: {}; check "
                                  "the id, HF_TOKEN for a gated model and the network (HF_ENDPOINT), {}",
                                  key, repo, revision, one_line(take_error()), by_hand));
  if (!PyUnicode_Check(out.get()))
    throw ConfigError(fmt::format("{} = '{}': snapshot_download returned no folder", key, repo));
  return utf8(out.get());
}

#else  // built without Python's development files

std::string download_hub_snapshot(const std::string&, const std::string&, const std::string&, const std::string&) {
  start();  // throws: this build has no embedded Python
  return "";
}

#endif

}  // namespace tiller::python
