#include <filesystem>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "fixtures.h"
#include "tiller/core/error.h"
#include "tiller/model/safetensors.h"

namespace tiller::model {
namespace {

namespace fs = std::filesystem;
using test::read_text;
using test::write_text;

std::string dir_for(const std::string& name) {
  const std::string d = test::scratch_dir() + "/safetensors/" + name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

NamedTensors sample_tensors() {
  return {{"a.f32", at::arange(12, at::kFloat).view({3, 4})},
          {"b.bf16", at::randn({5}, at::kFloat).to(at::kBFloat16)},
          {"c.i64", at::tensor({7, -1, 3}, at::kLong)},
          {"d.empty", at::zeros({0, 4}, at::kHalf)},
          {"e.scalar", at::scalar_tensor(2.5, at::kDouble)},
          {"f.strided", at::arange(20, at::kFloat).view({4, 5}).t()}};
}

// The message of the IoError that opening `path` throws.
std::string open_error(const std::string& path) {
  try {
    SafetensorsFile f(path);
  } catch (const IoError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Safetensors, RoundTripsEveryDtypeAndShape) {
  const std::string path = dir_for("roundtrip") + "/t.safetensors";
  const NamedTensors in = sample_tensors();
  write_safetensors(path, in, {{"step", "3"}});
  SafetensorsFile f(path);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("step"), "3");
  ASSERT_EQ(f.entries().size(), in.size());
  for (const auto& [name, t] : in) {
    at::Tensor r = f.tensor(name);
    EXPECT_EQ(r.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(r.sizes(), t.sizes()) << name;
    EXPECT_TRUE(at::equal(r, t)) << name;
  }
  for (const auto& e : fs::directory_iterator(fs::path(path).parent_path()))
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << e.path();
}

TEST(Safetensors, TensorsOutliveTheReaderAndWritesStayPrivate) {
  const std::string path = dir_for("lifetime") + "/t.safetensors";
  write_safetensors(path, {{"x", at::ones({4}, at::kFloat)}});
  at::Tensor x;
  {
    SafetensorsFile f(path);
    x = f.tensor("x");
  }
  x.mul_(3);  // copy-on-write mapping: the file is unchanged
  EXPECT_TRUE(at::equal(x, at::full({4}, 3.0f)));
  EXPECT_TRUE(at::equal(SafetensorsFile(path).tensor("x"), at::ones({4}, at::kFloat)));
}

TEST(Safetensors, ShardedCheckpointWithIndex) {
  const std::string d = dir_for("sharded");
  NamedTensors in;
  for (int i = 0; i < 6; ++i) in["layer." + std::to_string(i)] = at::full({64}, float(i));
  write_checkpoint(d, in, /*max_shard_bytes=*/600);
  EXPECT_TRUE(fs::exists(d + "/model.safetensors.index.json"));
  EXPECT_TRUE(fs::exists(d + "/model-00003-of-00003.safetensors"));
  const auto index = test::read_json(d + "/model.safetensors.index.json");
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), 6 * 64 * 4);
  CheckpointReader r(d);
  ASSERT_EQ(r.names().size(), 6u);
  for (const auto& [name, t] : in) EXPECT_TRUE(at::equal(r.tensor(name), t)) << name;

  // Saving again in one file removes the shards and the index of the earlier save.
  write_checkpoint(d, in);
  EXPECT_TRUE(fs::exists(d + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(d + "/model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(d + "/model-00001-of-00003.safetensors"));
  EXPECT_EQ(CheckpointReader(d).names().size(), 6u);
}

TEST(Safetensors, TruncatedFileIsRejected) {
  const std::string d = dir_for("truncated");
  write_safetensors(d + "/t.safetensors", sample_tensors());
  const std::string bytes = read_text(d + "/t.safetensors");
  write_text(d + "/cut.safetensors", bytes.substr(0, bytes.size() - 10));
  EXPECT_NE(open_error(d + "/cut.safetensors").find("data ends at byte"), std::string::npos);
  write_text(d + "/short.safetensors", bytes.substr(0, 5));
  EXPECT_NE(open_error(d + "/short.safetensors").find("shorter than the 8-byte header length"), std::string::npos);
  write_text(d + "/header.safetensors", bytes.substr(0, 40));
  EXPECT_NE(open_error(d + "/header.safetensors").find("runs past the end"), std::string::npos);
}

// A file with a hand-written header, to corrupt one field at a time.
std::string handmade(const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out + header + std::string(data_bytes, '\0');
}

TEST(Safetensors, CorruptHeadersNameTheProblem) {
  const std::string d = dir_for("corrupt");
  struct Case {
    std::string header;
    size_t data;
    std::string expect;
  };
  const Case cases[] = {
      {R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})", 16, "(no error)"},
      {R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", 16, "needs 16"},
      {R"({"w":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", 8, "unknown dtype 'Q4'"},
      {R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, "bad dimension"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8, "data_offsets"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12, "overlap"},
      {R"({"w":{"dtype":"F32","shape":[2]}})", 8, "data_offsets must be"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 8, "not valid JSON"},
      {R"([1,2,3])", 0, "does not start with a JSON object"},
      {R"({"__metadata__":{"a":1}})", 0, "__metadata__.a is not a string"},
  };
  for (const auto& c : cases) {
    write_text(d + "/c.safetensors", handmade(c.header, c.data));
    const std::string err = open_error(d + "/c.safetensors");
    EXPECT_NE(err.find(c.expect), std::string::npos) << c.header << " -> " << err;
    if (c.expect != "(no error)") EXPECT_NE(err.find(d + "/c.safetensors"), std::string::npos) << err;
  }
}

TEST(Safetensors, BrokenIndexIsRejected) {
  const std::string d = dir_for("index");
  write_checkpoint(d, {{"a", at::ones({64})}, {"b", at::ones({64})}}, 300);
  auto index = test::read_json(d + "/model.safetensors.index.json");
  auto expect_error = [&](const nlohmann::json& idx, const std::string& what) {
    write_text(d + "/model.safetensors.index.json", idx.dump());
    try {
      CheckpointReader r(d);
      ADD_FAILURE() << "no error for " << what;
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  auto missing = index;
  missing["weight_map"]["a"] = "model-00009-of-00009.safetensors";
  expect_error(missing, "shard 'model-00009-of-00009.safetensors' (for tensor 'a') is missing");
  auto wrong = index;
  wrong["weight_map"]["a"] = index["weight_map"]["b"];
  expect_error(wrong, "does not hold it");
  auto escape = index;
  escape["weight_map"]["a"] = "../a.safetensors";
  expect_error(escape, "not a file in this directory");
  EXPECT_THROW(CheckpointReader(dir_for("empty")), IoError);
}

}  // namespace
}  // namespace tiller::model
