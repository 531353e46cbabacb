#include "tiller/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tiller/core/error.h"
#include "tiller/core/file_system.h"
#include "tiller/core/files.h"

namespace tiller::model {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // the format's own limit

struct DtypeName {
  const char* name;
  at::ScalarType type;
};
constexpr DtypeName kDtypes[] = {
    {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf}, {"BF16", at::kBFloat16},
    {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
    {"U8", at::kByte},    {"BOOL", at::kBool}, {"F8_E4M3", at::kFloat8_e4m3fn}, {"F8_E5M2", at::kFloat8_e5m2},
};

std::string errno_text() { return std::strerror(errno); }

// A read-only (copy-on-write) mapping of a whole file.
struct Mapping {
  void* data = nullptr;
  size_t size = 0;
  ~Mapping() {
    if (data && size) munmap(data, size);
  }
};

}  // namespace

at::ScalarType dtype_from_safetensors(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.type;
  throw IoError(fmt::format("unknown safetensors dtype '{}'", name));
}

const char* dtype_to_safetensors(at::ScalarType t) {
  for (const auto& d : kDtypes)
    if (t == d.type) return d.name;
  throw IoError(fmt::format("dtype {} cannot be stored in safetensors", c10::toString(t)));
}

struct SafetensorsFile::Impl {
  std::string path;
  std::shared_ptr<Mapping> map;
  const uint8_t* data_area = nullptr;
  uint64_t data_size = 0;
  std::vector<TensorEntry> entries;
  std::map<std::string, size_t> index;
  std::map<std::string, std::string> metadata;

  [[noreturn]] void fail(const std::string& what) const {
    throw IoError(fmt::format("{}: {}; the file is corrupt or truncated (re-download or re-save it)", path, what));
  }

  void open() {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw IoError(fmt::format("{}: cannot open: {}", path, errno_text()));
    struct stat st {};
    if (fstat(fd, &st) != 0) {
      const std::string e = errno_text();
      ::close(fd);
      throw IoError(fmt::format("{}: cannot stat: {}", path, e));
    }
    map = std::make_shared<Mapping>();
    map->size = static_cast<size_t>(st.st_size);
    if (map->size > 0) {
      map->data = mmap(nullptr, map->size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
      if (map->data == MAP_FAILED) {
        map->data = nullptr;
        const std::string e = errno_text();
        ::close(fd);
        throw IoError(fmt::format("{}: cannot mmap: {}", path, e));
      }
    }
    ::close(fd);
    parse();
  }

  void parse() {
    const uint64_t size = map->size;
    if (size < 8) fail(fmt::format("{} bytes is shorter than the 8-byte header length", size));
    const auto* bytes = static_cast<const uint8_t*>(map->data);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
    if (n > kMaxHeaderBytes) fail(fmt::format("header length {} exceeds the 100 MiB limit", n));
    if (n > size - 8) fail(fmt::format("header length {} runs past the end of the {}-byte file", n, size));
    if (n < 2 || bytes[8] != '{') fail("the header does not start with a JSON object");
    json h;
    try {
      h = json::parse(bytes + 8, bytes + 8 + n);
    } catch (const json::exception& e) {
      fail(fmt::format("the header is not valid JSON ({})", e.what()));
    }
    if (!h.is_object()) fail("the header is not a JSON object");
    data_area = bytes + 8 + n;
    data_size = size - 8 - n;
    for (auto it = h.begin(); it != h.end(); ++it) {
      if (it.key() == "__metadata__") {
        if (!it.value().is_object()) fail("__metadata__ is not an object");
        for (auto m = it.value().begin(); m != it.value().end(); ++m) {
          if (!m.value().is_string()) fail(fmt::format("__metadata__.{} is not a string", m.key()));
          metadata[m.key()] = m.value().get<std::string>();
        }
        continue;
      }
      entries.push_back(parse_entry(it.key(), it.value()));
    }
    std::vector<const TensorEntry*> by_offset;
    for (const auto& e : entries) by_offset.push_back(&e);
    std::sort(by_offset.begin(), by_offset.end(),
              [](const TensorEntry* a, const TensorEntry* b) { return a->begin < b->begin; });
    const TensorEntry* reach = nullptr;  // the entry that ends last so far
    for (const TensorEntry* e : by_offset) {
      if (e->end == e->begin) continue;
      if (reach && e->begin < reach->end) fail(fmt::format("tensors '{}' and '{}' overlap", reach->name, e->name));
      if (!reach || e->end > reach->end) reach = e;
    }
    std::sort(entries.begin(), entries.end(), [](const TensorEntry& a, const TensorEntry& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.name < b.name;
    });
    for (size_t i = 0; i < entries.size(); ++i) index[entries[i].name] = i;
  }

  TensorEntry parse_entry(const std::string& name, const json& v) const {
    auto bad = [&](const std::string& what) { fail(fmt::format("tensor '{}': {}", name, what)); };
    if (!v.is_object()) bad("entry is not an object");
    TensorEntry e;
    e.name = name;
    if (!v.contains("dtype") || !v["dtype"].is_string()) bad("missing dtype");
    try {
      e.dtype = dtype_from_safetensors(v["dtype"].get<std::string>());
    } catch (const IoError&) {
      bad(fmt::format("unknown dtype '{}'", v["dtype"].get<std::string>()));
    }
    if (!v.contains("shape") || !v["shape"].is_array()) bad("missing shape");
    uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) bad(fmt::format("bad dimension {} in shape", d.dump()));
      const auto dim = d.get<uint64_t>();
      if (dim != 0 && numel > std::numeric_limits<uint64_t>::max() / dim) bad("shape overflows");
      numel *= dim;
      e.shape.push_back(static_cast<int64_t>(dim));
    }
    const auto& off = v.contains("data_offsets") ? v["data_offsets"] : json();
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      bad("data_offsets must be two non-negative integers");
    e.begin = off[0].get<uint64_t>();
    e.end = off[1].get<uint64_t>();
    if (e.end < e.begin) bad(fmt::format("data_offsets [{}, {}] end before they begin", e.begin, e.end));
    const uint64_t elem = c10::elementSize(e.dtype);
    if (numel > std::numeric_limits<uint64_t>::max() / elem || numel * elem != e.end - e.begin)
      bad(fmt::format("data_offsets [{}, {}] hold {} bytes but shape {} of {} needs {}", e.begin, e.end, e.end - e.begin,
                      v["shape"].dump(), v["dtype"].get<std::string>(), numel * elem));
    if (e.end > data_size)
      bad(fmt::format("data ends at byte {} but the data area has only {} bytes", e.end, data_size));
    return e;
  }
};

SafetensorsFile::SafetensorsFile(const std::string& path) : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  impl_->open();
}
SafetensorsFile::~SafetensorsFile() = default;
SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;

const std::string& SafetensorsFile::path() const { return impl_->path; }
const std::vector<TensorEntry>& SafetensorsFile::entries() const { return impl_->entries; }
const std::map<std::string, std::string>& SafetensorsFile::metadata() const { return impl_->metadata; }
bool SafetensorsFile::contains(const std::string& name) const { return impl_->index.count(name) > 0; }

at::Tensor SafetensorsFile::tensor(const std::string& name) const {
  auto it = impl_->index.find(name);
  if (it == impl_->index.end()) throw IoError(fmt::format("{}: no tensor named '{}'", impl_->path, name));
  const TensorEntry& e = impl_->entries[it->second];
  auto* ptr = const_cast<uint8_t*>(impl_->data_area + e.begin);
  auto keep = impl_->map;
  at::Tensor t = at::from_blob(ptr, e.shape, [keep](void*) {}, at::TensorOptions().dtype(e.dtype));
  if (reinterpret_cast<uintptr_t>(ptr) % c10::elementSize(e.dtype) != 0) t = t.clone();
  return t;
}

// --- checkpoint directories -------------------------------------------------------------------

struct CheckpointReader::Impl {
  std::string dir;
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, std::pair<const SafetensorsFile*, size_t>> where;  // name -> file, entry
};

CheckpointReader::CheckpointReader(const std::string& dir) : impl_(std::make_unique<Impl>()) {
  impl_->dir = dir;
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single = fs::path(dir) / "model.safetensors";
  auto add_file = [&](const fs::path& p) -> SafetensorsFile& {
    impl_->files.push_back(std::make_unique<SafetensorsFile>(p.string()));
    return *impl_->files.back();
  };
  if (fs::exists(index_path)) {
    std::ifstream in(index_path);
    json idx;
    try {
      idx = json::parse(in);
    } catch (const json::exception& e) {
      throw IoError(fmt::format("{}: not valid JSON ({})", index_path.string(), e.what()));
    }
    if (!idx.contains("weight_map") || !idx["weight_map"].is_object())
      throw IoError(fmt::format("{}: no weight_map object", index_path.string()));
    std::map<std::string, SafetensorsFile*> by_file;
    for (auto it = idx["weight_map"].begin(); it != idx["weight_map"].end(); ++it) {
      if (!it.value().is_string()) throw IoError(fmt::format("{}: weight_map.{} is not a file name", index_path.string(), it.key()));
      const std::string file = it.value().get<std::string>();
      if (file.find('/') != std::string::npos || file.find("..") != std::string::npos)
        throw IoError(fmt::format("{}: weight_map.{} names '{}', which is not a file in this directory", index_path.string(), it.key(), file));
      if (!by_file.count(file)) {
        if (!fs::exists(fs::path(dir) / file))
          throw IoError(fmt::format("{}: shard '{}' (for tensor '{}') is missing", index_path.string(), file, it.key()));
        by_file[file] = &add_file(fs::path(dir) / file);
      }
      if (!by_file[file]->contains(it.key()))
        throw IoError(fmt::format("{}: the index puts '{}' in '{}', which does not hold it", index_path.string(), it.key(), file));
    }
  } else if (fs::exists(single)) {
    add_file(single);
  } else {
    throw IoError(fmt::format("{}: no model.safetensors or model.safetensors.index.json (tiller reads safetensors checkpoints only)", dir));
  }
  for (const auto& f : impl_->files) {
    for (size_t i = 0; i < f->entries().size(); ++i) {
      const auto& name = f->entries()[i].name;
      if (impl_->where.count(name) && impl_->where[name].first != f.get())
        throw IoError(fmt::format("{}: tensor '{}' is stored twice ({} and {})", dir, name, impl_->where[name].first->path(), f->path()));
      impl_->where[name] = {f.get(), i};
    }
  }
}

CheckpointReader::~CheckpointReader() = default;

std::vector<std::string> CheckpointReader::names() const {
  std::vector<std::string> out;
  for (const auto& [n, _] : impl_->where) out.push_back(n);
  return out;
}
bool CheckpointReader::contains(const std::string& name) const { return impl_->where.count(name) > 0; }
const TensorEntry& CheckpointReader::entry(const std::string& name) const {
  auto it = impl_->where.find(name);
  if (it == impl_->where.end()) throw IoError(fmt::format("{}: checkpoint has no tensor '{}'", impl_->dir, name));
  return it->second.first->entries()[it->second.second];
}
at::Tensor CheckpointReader::tensor(const std::string& name) const {
  auto it = impl_->where.find(name);
  if (it == impl_->where.end()) throw IoError(fmt::format("{}: checkpoint has no tensor '{}'", impl_->dir, name));
  return it->second.first->tensor(name);
}
NamedTensors CheckpointReader::all() const {
  NamedTensors out;
  for (const auto& [n, w] : impl_->where) out[n] = w.first->tensor(n);
  return out;
}

// --- writing ----------------------------------------------------------------------------------

namespace {

// The temporary name of `path` while it is written: unique per process, so two writers never
// share (and truncate) one file.
std::string tmp_name(const std::string& path) { return path + ".tmp." + std::to_string(::getpid()); }

// Writes to tmp_name(path) and fsyncs; the caller renames.
void write_file_tmp(const std::string& path, const NamedTensors& tensors, const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  json meta = json::object();
  meta["format"] = "pt";
  for (const auto& [k, v] : metadata) meta[k] = v;
  header["__metadata__"] = meta;
  uint64_t offset = 0;
  std::vector<at::Tensor> cpu;
  for (const auto& [name, t] : tensors) {
    TILLER_CHECK(t.defined(), "tensor '{}' is undefined", name);
    at::Tensor c = t.detach().to(at::kCPU).contiguous();
    const uint64_t bytes = c.numel() * c.element_size();
    header[name] = {{"dtype", dtype_to_safetensors(c.scalar_type())},
                    {"shape", c.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    cpu.push_back(std::move(c));
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');
  const std::string tmp = tmp_name(path);
  FileSystem& fsys = FileSystem::current();
  auto f = fsys.create(tmp);
  try {
    uint8_t len[8];
    uint64_t n = h.size();
    for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));
    f->append(len, 8);
    f->append(h.data(), h.size());
    for (const auto& c : cpu) f->append(c.data_ptr(), c.numel() * c.element_size());
    f->sync();
    f->close();
  } catch (...) {
    f.reset();
    try {
      fsys.remove_file(tmp);
    } catch (const IoError&) {  // the write's failure is the one to report
    }
    throw;
  }
}

void commit(const std::string& path) { FileSystem::current().rename(tmp_name(path), path); }

}  // namespace

void write_safetensors(const std::string& path, const NamedTensors& tensors, const std::map<std::string, std::string>& metadata) {
  write_file_tmp(path, tensors, metadata);
  commit(path);
  fsync_dir(parent_dir(path));
}

void write_checkpoint(const std::string& dir, const NamedTensors& tensors, uint64_t max_shard_bytes) {
  std::error_code ec;
  FileSystem::current().make_dirs(dir);
  std::vector<NamedTensors> shards(1);
  uint64_t in_shard = 0, total = 0;
  for (const auto& [name, t] : tensors) {
    const uint64_t bytes = t.numel() * t.element_size();
    if (in_shard > 0 && in_shard + bytes > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back()[name] = t;
    in_shard += bytes;
    total += bytes;
  }
  const size_t n = shards.size();
  std::vector<std::string> files;
  if (n == 1) files.push_back("model.safetensors");
  else
    for (size_t i = 0; i < n; ++i) files.push_back(fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, n));
  // Everything goes to temporary names first, so an interrupted save leaves the old files intact.
  for (size_t i = 0; i < n; ++i) write_file_tmp((fs::path(dir) / files[i]).string(), shards[i], {});
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (n > 1) {
    json idx;
    idx["metadata"] = {{"total_size", total}};
    json wm = json::object();
    for (size_t i = 0; i < n; ++i)
      for (const auto& [name, _] : shards[i]) wm[name] = files[i];
    idx["weight_map"] = wm;
    const std::string text = idx.dump(2) + "\n";
    auto f = FileSystem::current().create(tmp_name(index.string()));
    f->append(text.data(), text.size());
    f->sync();
    f->close();
  }
  for (size_t i = 0; i < n; ++i) commit((fs::path(dir) / files[i]).string());
  if (n > 1) commit(index.string());
  // Remove what an earlier save with another shard count left behind.
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string f = e.path().filename().string();
    const bool ours = f.rfind("model", 0) == 0 && f.size() > 12 && f.compare(f.size() - 12, 12, ".safetensors") == 0;
    if (ours && std::find(files.begin(), files.end(), f) == files.end()) fs::remove(e.path(), ec);
  }
  if (n == 1) fs::remove(index, ec);
  fsync_dir(dir);
}

}  // namespace tiller::model
