#include "controller/standalone_engines.h"

#include "controller/collector.h"
#include "controller/engine_set.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tiller/core/config.h"
#include "tiller/core/deadline.h"
#include "tiller/core/error.h"
#include "tiller/core/logging.h"
#include "tiller/engine/server.h"
#include "tiller/sync/weight_push.h"

namespace tiller::controller {
namespace {

namespace fs = std::filesystem;

constexpr size_t kMaxEngines = 4096;
constexpr std::uintmax_t kMaxAnnouncementBytes = 4096;

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

// Empty when `a` is host:port with a port in 1-65535, else why not.
std::string address_problem(const std::string& a) {
  const auto colon = a.rfind(':');
  if (colon == std::string::npos || colon == 0) return "not host:port";
  const std::string port = a.substr(colon + 1);
  if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return "its port is not a number";
  const int p = std::stoi(port);
  if (p < 1 || p > 65535) return "its port is not 1-65535";
  return "";
}

}  // namespace

std::vector<std::string> parse_engine_addresses(const std::string& list, const std::string& key) {
  std::vector<std::string> out;
  std::stringstream in(list);
  std::string item;
  while (std::getline(in, item, ',')) {
    item = trim(item);
    if (item.empty()) continue;
    if (const std::string why = address_problem(item); !why.empty())
      throw ConfigError(fmt::format("{}: '{}' is {}; write host:port, comma-separated", key, item, why));
    if (std::find(out.begin(), out.end(), item) != out.end())
      throw ConfigError(fmt::format("{}: '{}' is listed twice", key, item));
    out.push_back(item);
    if (out.size() > kMaxEngines) throw ConfigError(fmt::format("{}: more than {} engines", key, kMaxEngines));
  }
  return out;
}

std::string announce_engine(const std::string& dir, const std::string& address, long pid) {
  if (const std::string why = address_problem(address); !why.empty())
    throw ConfigError(fmt::format("engine announcement: '{}' is {}", address, why));
  std::error_code ec;
  fs::create_directories(dir, ec);
  std::string name = address;
  std::replace(name.begin(), name.end(), ':', '-');
  std::replace(name.begin(), name.end(), '/', '_');
  const fs::path path = fs::path(dir) / (name + ".json");
  const fs::path tmp = fs::path(dir) / ("." + name + ".json.tmp");
  {
    std::ofstream out(tmp);
    out << nlohmann::json{{"address", address}, {"pid", pid}}.dump() << "\n";
    if (!out.flush())
      throw IoError(fmt::format("engine announcement: cannot write {} (is {} writable?)", tmp.string(), dir));
  }
  fs::rename(tmp, path, ec);
  if (ec) throw IoError(fmt::format("engine announcement: cannot rename {} to {}: {}", tmp.string(), path.string(), ec.message()));
  return path.string();
}

std::vector<std::string> EngineRendezvous::poll() {
  std::vector<std::string> out;
  std::error_code ec;
  if (!fs::is_directory(dir_, ec)) return out;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir_, ec))
    if (e.path().extension() == ".json" && e.path().filename().string().front() != '.') files.push_back(e.path());
  std::sort(files.begin(), files.end());
  for (const auto& f : files) {
    const std::string key = f.string();
    if (skipped_.count(key)) continue;
    auto skip = [&](const std::string& why) {
      skipped_.insert(key);
      log::warn("engines.rendezvous_dir: {} is no engine announcement ({}); skipped", key, why);
    };
    if (fs::file_size(f, ec) > kMaxAnnouncementBytes || ec) {
      skip("unreadable or over 4 KiB");
      continue;
    }
    std::ifstream in(f);
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("address") || !j["address"].is_string()) {
      skip("no \"address\" string");
      continue;
    }
    const std::string address = j["address"].get<std::string>();
    if (const std::string why = address_problem(address); !why.empty()) {
      skip(fmt::format("its address '{}' is {}", address, why));
      continue;
    }
    if (seen_.insert(address).second) out.push_back(address);
    if (seen_.size() > kMaxEngines) throw ConfigError(fmt::format("{}: more than {} engines joined", dir_, kMaxEngines));
  }
  return out;
}

StandaloneEngines::StandaloneEngines(const JobConfig& cfg) {
  std::vector<std::string>& out = addresses_;
  std::unique_ptr<EngineRendezvous>& rendezvous = rendezvous_;
  out = parse_engine_addresses(cfg.engines.addresses, "engines.addresses");
  if (!cfg.engines.rendezvous_dir.empty()) {
    rendezvous = std::make_unique<EngineRendezvous>(cfg.engines.rendezvous_dir);
    for (const auto& a : out) rendezvous->know(a);
  }
  const auto want = static_cast<size_t>(cfg.engines.min_count);
  const Deadline deadline = Deadline::after_seconds(cfg.timeouts.startup_s);
  bool told = false;
  // An announcement a killed engine left behind names nothing that answers: skipped.
  auto answers = [&](const std::string& a) {
    engine::ClientOptions o = sync::standalone_engine_client(cfg, a);
    o.timeout_seconds = std::min(o.timeout_seconds, 10.0);
    try {
      engine::EngineClient(o).health();
      return true;
    } catch (const std::exception& e) {
      log::warn("engines.rendezvous_dir: the engine announced at {} does not answer ({}); skipped", a, e.what());
      return false;
    }
  };
  for (;;) {
    if (rendezvous)
      for (const auto& a : rendezvous->poll())
        if (answers(a)) out.push_back(a);
    if (out.size() >= want) break;
    if (!rendezvous)
      throw ConfigError(fmt::format("engines.min_count = {}, and engines.addresses names {}; list more, or give "
                                    "engines.rendezvous_dir for engines that announce themselves",
                                    want, out.size()));
    if (deadline.expired())
      throw TimeoutError(fmt::format("{} standalone engine(s) of engines.min_count = {} within timeouts.startup_s = {} "
                                     "s (announced in {}: tiller engine --join {})",
                                     out.size(), want, cfg.timeouts.startup_s, rendezvous->dir(), rendezvous->dir()));
    if (!told) {
      log::info("waiting for {} more standalone engine(s) to announce themselves in {}", want - out.size(),
                rendezvous->dir());
      told = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  for (const auto& a : out) log::info("standalone engine at {}", a);
}

void StandaloneEngines::admit(EngineSet& engines, RolloutCollector& collector, uint64_t version) {
  if (!rendezvous_) return;
  for (const std::string& a : rendezvous_->poll()) {
    try {
      const size_t i = engines.add_engine(a);
      addresses_.push_back(a);
      collector.engines_changed();
      log::info("{} joined: it takes version {} in full at this sync, then prompts", engines.name(i), version);
    } catch (const std::exception& e) {
      log::warn("engine {} (announced in {}) could not join: {}", a, rendezvous_->dir(), e.what());
    }
  }
}

std::vector<std::string> StandaloneEngines::targets(const EngineSet& engines) const {
  std::vector<std::string> out;
  for (size_t i = 0; i < addresses_.size(); ++i)
    if (!engines.retired(i)) out.push_back(addresses_[i]);
  return out;
}

void StandaloneEngines::retire_failed(EngineSet& engines, const std::vector<std::string>& failed,
                                      uint64_t version) const {
  for (size_t i = 0; i < addresses_.size(); ++i)
    if (std::find(failed.begin(), failed.end(), addresses_[i]) != failed.end())
      engines.retire(i, fmt::format("the push of version {} to it failed (the actor ranks' log says why)", version));
}

}  // namespace tiller::controller
