// Communicator: collectives over a group of ranks, on tensors, with deadlines.
//
// Backends: MPI for CPU tensors (the backend of the CPU tests and CPU runs) and NCCL for CUDA
// tensors (GPU build). Both are created from an MpiEnv (mpi_env.h).
//
// Order contract: every rank of the group calls the same collectives in the same order, with
// the same sizes and dtypes (the sizes of all_gather/reduce_scatter are per-rank equal). send and
// recv pair up in order per (sender, receiver). A rank that breaks the contract cannot be
// detected in general, but it cannot hang the others: every operation has a deadline, and a
// missed deadline aborts the communicator and raises TimeoutError naming the op, the group, the
// rank and the op's sequence number. An aborted communicator throws CommError from every later
// call; the process should exit non-zero so mpirun tears the job down.
//
// Asynchrony: every operation returns a Work at once; NCCL ops run on the communicator's own
// stream after the work already queued on the caller's current stream. Work::wait() blocks the
// calling host thread until the operation is complete, or its deadline passes;
// Work::wait_on_stream() only orders the caller's stream after it, so compute can overlap. The
// tensors passed in must stay untouched until the op completes; they may be dropped at once (the
// op keeps them alive until it is queued; NCCL then has the caching allocator hold their memory
// back until the communicator's stream has passed the op).
// NCCL send/recv: a send may not complete until the peer's recv runs, so two ranks that exchange
// data must order their send and recv oppositely. Dropping a Work without waiting is allowed (the NCCL watchdog still enforces its
// deadline); its errors then surface at the next call.
//
// Threading: one thread at a time per communicator (the caller's); the NCCL backend's watchdog
// thread is internal.
//
// Example (every rank of the actor group):
//   auto work = comm.all_gather(shard, full);   // full.numel() == comm.size() * shard.numel()
//   ... compute ...
//   work->wait();                               // or wait(Deadline::after_seconds(5))
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "tiller/core/deadline.h"

namespace at {
class Tensor;
}

namespace tiller::dist {

enum class ReduceOp { kSum, kMax, kMin };

class Work {
 public:
  virtual ~Work() = default;
  // Blocks until complete or `deadline`; rethrows the operation's error (TimeoutError, CommError).
  virtual void wait(Deadline deadline) = 0;
  // Blocks until complete or the deadline the operation was issued with.
  virtual void wait() = 0;
  // Non-blocking: true once complete (throws if it failed).
  virtual bool is_completed() = 0;
  // NCCL: makes the caller's current CUDA stream wait for the op without blocking the host (the
  // c10d semantics; the watchdog still enforces the deadline). Other backends: wait().
  virtual void wait_on_stream() = 0;
};
using WorkPtr = std::shared_ptr<Work>;

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The group's name in errors and logs ("world", "actor", "engine0.tp").
  virtual const std::string& name() const = 0;
  virtual const char* backend() const = 0;  // "mpi" or "nccl"
  // Deadline given to each operation issued from now on.
  virtual void set_timeout(double seconds) = 0;
  virtual double timeout() const = 0;

  // output (contiguous, numel == size() * input.numel()) = concatenation of every rank's input.
  virtual WorkPtr all_gather(const at::Tensor& input, const at::Tensor& output) = 0;
  // output (numel == input.numel() / size()) = reduction over ranks of this rank's chunk of input.
  virtual WorkPtr reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp op = ReduceOp::kSum) = 0;
  // input and output (contiguous, same numel, a multiple of size()) are size() equal chunks:
  // chunk j of input goes to rank j, chunk i of output comes from rank i. Its own inverse (the
  // sequence-parallel attention's exchange of tokens for heads).
  virtual WorkPtr all_to_all(const at::Tensor& input, const at::Tensor& output) = 0;
  // In place: tensor = reduction of every rank's tensor.
  virtual WorkPtr all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum) = 0;
  // In place: tensor = root's tensor.
  virtual WorkPtr broadcast(const at::Tensor& tensor, int root) = 0;
  virtual WorkPtr send(const at::Tensor& tensor, int peer) = 0;
  virtual WorkPtr recv(const at::Tensor& tensor, int peer) = 0;

  // Collective over this group: ranks with the same color form a new communicator, ordered by
  // (key, rank). color < 0 takes no part and gets nullptr. Bounded by the current timeout.
  virtual std::unique_ptr<Communicator> split(int color, int key, const std::string& name) = 0;

  // True once a deadline was missed or an error aborted this communicator.
  virtual bool aborted() const = 0;
};

}  // namespace tiller::dist
