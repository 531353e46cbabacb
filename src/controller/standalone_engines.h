// Standalone engines of a job (private to src/controller; docs/cluster.md, "Standalone engines"):
// `tiller engine` processes that are no ranks of the job, named in engines.addresses or announced
// in engines.rendezvous_dir by `tiller engine --join DIR`. An announcement is a file
// <host>-<port>.json holding {"address": "host:port", "pid": N}, written whole (a temporary file
// renamed into place) once the engine serves, and removed when it stops.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace tiller {
struct JobConfig;
}

namespace tiller::controller {

class EngineSet;
class RolloutCollector;

// "host:port, host:port" as a list; ConfigError naming `key` for an entry that is not host:port
// (a port 1-65535) or a list of more than 4096.
std::vector<std::string> parse_engine_addresses(const std::string& list, const std::string& key);

// Writes the announcement of an engine serving at `address` into `dir` (made if missing); returns
// its path. IoError naming the folder when it cannot be written.
std::string announce_engine(const std::string& dir, const std::string& address, long pid);

class EngineRendezvous {
 public:
  explicit EngineRendezvous(std::string dir) : dir_(std::move(dir)) {}
  // The addresses announced since the last call, each once, in file-name order; a file that is
  // not an announcement is skipped with a warning (once). A folder that does not exist yet holds none.
  std::vector<std::string> poll();
  // Marks `address` as known (an engine of engines.addresses), so that poll() does not return it.
  void know(const std::string& address) { seen_.insert(address); }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::set<std::string> seen_;     // addresses returned or known
  std::set<std::string> skipped_;  // files warned about
};

// At a weight sync: takes the engines announced since the last one into `engines` and the
// collector, and appends their addresses to `addresses` (the sync's targets). An engine that
// cannot join (unreachable, the plan does not fit it) is skipped with a warning naming it: the
// job goes on with the others. Returns how many joined.
// The standalone engines of a job as the controller tracks them from one weight sync to the next.
class StandaloneEngines {
 public:
  // engines.addresses, then the engines announced in engines.rendezvous_dir (one that does not
  // answer is skipped), waiting up to timeouts.startup_s until there are engines.min_count.
  // TimeoutError saying how many came and where they were looked for.
  explicit StandaloneEngines(const JobConfig& cfg);
  // Every engine's host:port, in the engine set's order (those that left included).
  const std::vector<std::string>& addresses() const { return addresses_; }
  // Before a sync: the engines announced since the last one join `engines` and the collector. One
  // that cannot join (unreachable, the plan does not fit it) is skipped with a warning naming it.
  void admit(EngineSet& engines, RolloutCollector& collector, uint64_t version);
  // The push's targets: the engines still in the job.
  std::vector<std::string> targets(const EngineSet& engines) const;
  // After the pushes, before End (which would wait for their buckets): the engines an actor rank
  // could not push to leave the job.
  void retire_failed(EngineSet& engines, const std::vector<std::string>& failed, uint64_t version) const;

 private:
  std::vector<std::string> addresses_;
  std::unique_ptr<EngineRendezvous> rendezvous_;
};

}  // namespace tiller::controller
