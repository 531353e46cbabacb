// The rank's watchdog: what every thread of this process waits in, a deadline over the waits that
// have one, and, when the job ends on an error, one line from every rank saying where it was
// (docs/cluster.md, "When a job hangs").
//
// Waits are declared where they happen (WaitScope, RAII): a communicator's op (display only: the
// op enforces its own deadline and names itself when it misses it), the controller's step
// (timeouts.step_s) and its calls to ranks, a trainer's wait for its next request, a TP follower's
// wait for its leader. A rank's phase ("score, step 3") is set by its main loop (set_phase).
//
// Once started, a thread of the watchdog checks every wait against its deadline (every 100 ms).
// When one passes, or when any thread of the rank ends the job on an error (end_job, which
// MpiEnv::fail_job calls), the rank prints its line, asks every other rank for theirs (a TCP
// connection to each rank's watchdog socket, whose "host:port" start() exchanged; not MPI, whose
// progress a probing thread would drive for every message of the process), gives them up to a
// grace period to print, then aborts the job (MPI_Abort). Lines read
//   tiller: watchdog: rank 1 (actor+ref), phase 'score request' (5.0 s): waiting 4.9 s in all_gather #0
//     on group 'actor' (mpi, rank 0 of 2) with world ranks 1,2
//   tiller: watchdog: rank 2 (actor+ref+engine0.tp1), phase 'phase request' (5.6 s): waiting 5.6 s in
//     the controller's next request (rank 0) [thread 2: 5.2 s in the hang injected at 'engine_step'
//     (TILLER_FAULT_HANG)]
// so the rank that is not where its peers are stands out, as c10d's watchdog shows.
//
// Threading: every function is thread-safe. The watchdog is process-wide: one per rank.
#pragma once

#include <functional>
#include <string>

#include "tiller/core/deadline.h"

namespace tiller::dist {

class Watchdog {
 public:
  // Collective over MPI_COMM_WORLD (every rank calls it once, after MPI is initialised): opens
  // this rank's watchdog socket, exchanges every rank's address (MPI_Allgather) and starts this
  // rank's watchdog, labelled `label` ("actor+ref"), answering other ranks' requests from now on. A later call changes only the label. `grace_s`: how long a failing rank waits for the
  // others' lines before it aborts the job.
  static void start(int rank, const std::string& label, double grace_s = 3.0);
  static bool running();
  // Stops the watchdog's thread and closes its socket (MpiEnv's destructor): no wait is checked
  // after it. Not collective.
  static void stop();
  // The rank's phase as its line shows it; "" clears it.
  static void set_phase(const std::string& phase);
  // Extra text for this rank's line, asked for when the line is printed (the controller's pending
  // calls); replaces the one before. Must stay callable until cleared with {} and must not block.
  static void set_status_source(std::function<std::string()> source);
  // This rank's line ("rank R (label), phase ...: ...").
  static std::string status_line();
  // Prints `why` as the rank's error and its own line, asks every other rank for theirs, waits up
  // to the grace period, and aborts the job with `code`. Without start(): prints and aborts.
  [[noreturn]] static void end_job(int code, const std::string& why);
};

// A wait of the calling thread, for the life of the scope: `what` is shown in the rank's line
// ("all_gather #57 on group 'actor' ..."). A deadline that passes while the scope lives ends the job
// (`key` names the config key that set it, "timeouts.step_s"); Deadline::never(): shown only.
// Scopes nest on a thread; its line shows the innermost and every deadline counts.
class WaitScope {
 public:
  WaitScope(std::string what, Deadline deadline = Deadline::never(), std::string key = {});
  ~WaitScope();
  WaitScope(const WaitScope&) = delete;
  WaitScope& operator=(const WaitScope&) = delete;

 private:
  long id_;
};

// Fault injection for the watchdog's tests: true when $TILLER_FAULT_HANG names this rank (the
// watchdog's, from start()) and `point` ("RANK:POINT", e.g. "2:score"; "RANK:POINT:N" from the Nth
// time on); the caller then hangs in hang_here().
bool fault_hang_requested(const char* point);
// Waits forever (a WaitScope says it is the injected hang): the test's stuck rank.
[[noreturn]] void hang_here(const char* point);

}  // namespace tiller::dist
