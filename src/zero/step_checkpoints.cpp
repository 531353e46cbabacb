#include "zero/step_checkpoints.h"

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/core/file_system.h"
#include "tiller/core/files.h"

namespace tiller::zero {
namespace {

namespace fs = std::filesystem;

constexpr size_t kMaxStepDigits = 15;

}  // namespace

StepCheckpoints::StepCheckpoints(std::string root, int64_t keep_last)
    : root_(std::move(root)), keep_last_(std::max<int64_t>(1, keep_last)) {}

std::string StepCheckpoints::dir(int64_t step) const { return fmt::format("{}/step_{:06d}", root_, step); }

std::vector<StepCheckpoints::Entry> StepCheckpoints::list() const {
  std::vector<Entry> out;
  std::error_code ec;
  if (!enabled() || !fs::is_directory(root_, ec)) return out;
  for (const auto& e : fs::directory_iterator(root_, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) != 0 || name.find('.') != std::string::npos) continue;
    const std::string digits = name.substr(5);
    if (digits.empty() || digits.size() > kMaxStepDigits ||
        !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
      throw ConfigError(fmt::format("checkpoint.dir = {}: '{}' is not a checkpoint name (step_ and a step number); "
                                    "move it out of the checkpoint directory",
                                    root_, name));
    if (!fs::exists(e.path() / kMarker, ec)) continue;
    out.push_back({std::stoll(digits), e.path().string()});
  }
  std::sort(out.begin(), out.end(), [](const Entry& a, const Entry& b) { return a.step < b.step; });
  return out;
}

std::string StepCheckpoints::begin(int64_t step) const {
  const std::string d = dir(step);
  FileSystem& fsys = FileSystem::current();
  fsys.remove_file(d + "/" + std::string(kMarker));  // incomplete until commit
  fsys.make_dirs(d);
  return d;
}

void StepCheckpoints::commit(int64_t step, const std::string& marker_text) const {
  write_file_atomic(dir(step) + "/" + kMarker, marker_text);
  auto all = list();
  while (static_cast<int64_t>(all.size()) > keep_last_) {
    remove_tree(all.front().dir);
    all.erase(all.begin());
  }
}

std::vector<std::string> StepCheckpoints::remove_incomplete() const {
  std::vector<std::string> removed;
  std::error_code ec;
  if (!enabled() || !fs::is_directory(root_, ec)) return removed;
  list();  // refuses a stray step_* name before anything is removed
  std::vector<fs::path> doomed;
  for (const auto& e : fs::directory_iterator(root_, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) != 0 || name.find('.') != std::string::npos || !e.is_directory(ec)) continue;
    if (!fs::exists(e.path() / kMarker, ec)) doomed.push_back(e.path());
  }
  std::sort(doomed.begin(), doomed.end());
  for (const auto& p : doomed) {
    remove_tree(p.string());
    removed.push_back(p.filename().string());
  }
  if (!removed.empty()) fsync_dir(root_);
  return removed;
}

std::optional<StepCheckpoints::Latest> StepCheckpoints::latest() const {
  const auto all = list();
  if (all.empty()) return std::nullopt;
  Latest l;
  l.entry = all.back();
  l.marker_path = l.entry.dir + "/" + kMarker;
  const auto text = read_file(l.marker_path);
  if (!text) throw IoError(fmt::format("{}: cannot be read", l.marker_path));
  l.marker_text = *text;
  return l;
}

}  // namespace tiller::zero
