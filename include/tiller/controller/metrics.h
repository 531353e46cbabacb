// Per-step metrics of `tiller train`: one JSON object per line (JSONL) and TensorBoard event files.
//
// TensorBoardWriter writes the TFRecord event format itself (no TensorFlow): each record is
// length, masked CRC-32C of the length, an Event protobuf (wall time, step, one scalar summary),
// masked CRC-32C of the data. `tensorboard --logdir DIR` reads the file, and so does
// tensorboard's EventAccumulator (tests/rollout/check_metrics.py).
//
// Threading: one thread. Files are flushed after every step, so a killed job keeps its curves.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace tiller::controller {

using Metrics = std::vector<std::pair<std::string, double>>;

class TensorBoardWriter {
 public:
  // Creates DIR and DIR/events.out.tfevents.<seconds>.<host>. IoError names the path on failure.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  void scalars(int64_t step, const Metrics& values);
  // A text summary (TensorBoard's text tab renders it as Markdown) under `tag`.
  void text(int64_t step, const std::string& tag, const std::string& markdown);
  const std::string& path() const { return path_; }

 private:
  void record(const std::string& event);
  std::string path_;
  std::FILE* file_ = nullptr;
};

// CRC-32C (Castagnoli), as TFRecord uses it (exposed for the unit test).
uint32_t crc32c(const void* data, size_t n);

// Appends {"step": N, key: value, ...} to a JSONL file (created with its directory).
class JsonlWriter {
 public:
  explicit JsonlWriter(const std::string& path);
  ~JsonlWriter();
  JsonlWriter(const JsonlWriter&) = delete;
  JsonlWriter& operator=(const JsonlWriter&) = delete;
  void write(int64_t step, const Metrics& values);
  // Appends one line as it is (a JSON object without its newline), flushed.
  void append(const std::string& line);

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace tiller::controller
