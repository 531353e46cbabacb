// The supervisor behind `tiller launch`: runs a job's launch line (mpirun or srun), and when the
// job fails for a reason a restart can cure (a rank died, a deadline expired, an engine vanished)
// runs it again, resuming from the newest complete checkpoint, after a backoff, up to a number of
// restarts. Config and usage errors (exit code 2, a launcher that cannot place the ranks) are
// never retried. Private to src/job; docs/cluster.md has the user's view.
//
// Between runs it removes the incomplete step_* directories a crash left. Each run gets
// TILLER_RESTARTS in its environment (the controller reports it as supervisor/restarts).
// SIGINT/SIGTERM to the supervisor go to the job (which saves a checkpoint and stops), and end
// the supervision: a job stopped on purpose is not restarted.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace tiller::job {

// How one run ended: its exit code (or the signal that killed the launcher) and the last lines of
// its output, where a failing rank printed "tiller: error: ...".
struct RunOutcome {
  int exit_code = 0;
  int signal = 0;
  std::vector<std::string> tail;
};

enum class Verdict { kDone, kStopped, kRestart, kGiveUp };
struct Diagnosis {
  Verdict verdict = Verdict::kDone;
  std::string cause;  // one line: why the run ended
};
// kDone for exit 0; kGiveUp for a config or usage error; kRestart for the rest. (kStopped is the
// supervisor's own: a signal it forwarded.)
Diagnosis diagnose(const RunOutcome& run);

// Seconds to wait before restart n (1-based): first, doubling, at most cap.
double backoff_seconds(int restart, double first, double cap);

struct SupervisorOptions {
  std::vector<std::string> command;  // argv of the launch line (the first word is looked up in PATH)
  std::string checkpoint_dir;        // checkpoint.dir ("": restarts start over)
  int max_restarts = 3;
  double backoff_first_s = 10, backoff_cap_s = 300;
  size_t tail_lines = 200;           // output lines kept for the diagnosis
  // The supervisor's own lines ("tiller launch: ..."); default: stderr.
  std::function<void(const std::string&)> log;
};

// Runs the job until it succeeds, is stopped, fails for good, or has used its restarts. The job's
// output passes through to stdout. Returns the exit code to leave with: 0, or the last run's.
int supervise(const SupervisorOptions& options);

}  // namespace tiller::job
