#include "tiller/controller/metrics.h"

#include <unistd.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tiller/core/error.h"

namespace tiller::controller {
namespace {

// Protobuf wire encoding, just what an Event with one scalar summary needs.
void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void tag(std::string& out, int field, int wire) { varint(out, static_cast<uint64_t>(field) << 3 | wire); }
void bytes_field(std::string& out, int field, const std::string& b) {
  tag(out, field, 2);
  varint(out, b.size());
  out += b;
}
template <typename T>
void fixed_field(std::string& out, int field, T v) {
  tag(out, field, sizeof(T) == 8 ? 1 : 5);
  char buf[sizeof(T)];
  std::memcpy(buf, &v, sizeof(T));
  out.append(buf, sizeof(T));
}

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Event { double wall_time = 1; int64 step = 2; oneof { string file_version = 3; Summary summary = 5; } }
std::string event(int64_t step, const std::string* file_version, const Metrics* values) {
  std::string e;
  fixed_field<double>(e, 1, wall_seconds());
  tag(e, 2, 0);
  varint(e, static_cast<uint64_t>(step));
  if (file_version) bytes_field(e, 3, *file_version);
  if (values) {
    // Summary { repeated Value value = 1; }  Value { string tag = 1; float simple_value = 2; }
    std::string summary;
    for (const auto& [name, v] : *values) {
      if (!std::isfinite(v)) continue;
      std::string value;
      bytes_field(value, 1, name);
      fixed_field<float>(value, 2, static_cast<float>(v));
      bytes_field(summary, 1, value);
    }
    bytes_field(e, 5, summary);
  }
  return e;
}

// Event.summary with one text value: Value { tag = 1; TensorProto tensor = 8 { dtype = 1 (DT_STRING
// = 7); tensor_shape = 2 (a scalar); string_val = 8 }; SummaryMetadata metadata = 9 { PluginData
// plugin_data = 1 { plugin_name = 1: "text" } } }.
std::string text_event(int64_t step, const std::string& name, const std::string& text) {
  std::string tensor;
  tag(tensor, 1, 0);
  varint(tensor, 7);
  bytes_field(tensor, 2, "");
  bytes_field(tensor, 8, text);
  std::string plugin, metadata;
  bytes_field(plugin, 1, "text");
  bytes_field(metadata, 1, plugin);
  std::string value;
  bytes_field(value, 1, name);
  bytes_field(value, 8, tensor);
  bytes_field(value, 9, metadata);
  std::string summary;
  bytes_field(summary, 1, value);
  std::string e;
  fixed_field<double>(e, 1, wall_seconds());
  tag(e, 2, 0);
  varint(e, static_cast<uint64_t>(step));
  bytes_field(e, 5, summary);
  return e;
}

uint32_t masked(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

std::FILE* open_append(const std::string& path) {
  std::error_code ec;
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  std::FILE* f = std::fopen(path.c_str(), "ab");
  if (!f) throw IoError(fmt::format("{}: cannot open for writing: {}", path, std::strerror(errno)));
  return f;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  static const auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? 0x82f63b78u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t c = 0xffffffffu;
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  char host[256] = "localhost";
  gethostname(host, sizeof(host) - 1);
  path_ = fmt::format("{}/events.out.tfevents.{}.{}", dir, static_cast<int64_t>(wall_seconds()), host);
  file_ = open_append(path_);
  const std::string version = "brain.Event:2";
  record(event(0, &version, nullptr));
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::record(const std::string& data) {
  const uint64_t len = data.size();
  char head[12];
  std::memcpy(head, &len, 8);
  const uint32_t len_crc = masked(crc32c(head, 8));
  std::memcpy(head + 8, &len_crc, 4);
  const uint32_t data_crc = masked(crc32c(data.data(), data.size()));
  if (std::fwrite(head, 1, 12, file_) != 12 || std::fwrite(data.data(), 1, data.size(), file_) != data.size() ||
      std::fwrite(&data_crc, 1, 4, file_) != 4 || std::fflush(file_) != 0)
    throw IoError(fmt::format("{}: cannot write: {}", path_, std::strerror(errno)));
}

void TensorBoardWriter::scalars(int64_t step, const Metrics& values) { record(event(step, nullptr, &values)); }

void TensorBoardWriter::text(int64_t step, const std::string& name, const std::string& markdown) {
  record(text_event(step, name, markdown));
}

JsonlWriter::JsonlWriter(const std::string& path) : path_(path), file_(open_append(path)) {}

JsonlWriter::~JsonlWriter() {
  if (file_) std::fclose(file_);
}

void JsonlWriter::write(int64_t step, const Metrics& values) {
  nlohmann::ordered_json j;
  j["step"] = step;
  for (const auto& [k, v] : values) {
    if (std::isfinite(v)) j[k] = v;
    else j[k] = nullptr;
  }
  append(j.dump());
}

void JsonlWriter::append(const std::string& text) {
  const std::string line = text + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0)
    throw IoError(fmt::format("{}: cannot write: {}", path_, std::strerror(errno)));
}

}  // namespace tiller::controller
