// Standalone engines' addresses and announcements (src/controller/standalone_engines.h), and the
// config rules of a job that uses them.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <string>

#include "controller/standalone_engines.h"
#include "tiller/core/config.h"
#include "tiller/core/error.h"

namespace tiller::controller {
namespace {

namespace fs = std::filesystem;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(EngineRendezvous, AddressesAreHostPortListsAndBadOnesAreNamed) {
  EXPECT_EQ(parse_engine_addresses(" node3:50051, 10.0.0.2:41233 ,", "engines.addresses"),
            (std::vector<std::string>{"node3:50051", "10.0.0.2:41233"}));
  EXPECT_TRUE(parse_engine_addresses("", "engines.addresses").empty());
  EXPECT_NE(error_of([] { parse_engine_addresses("node3", "engines.addresses"); })
                .find("engines.addresses: 'node3' is not host:port"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_engine_addresses("node3:99999", "engines.addresses"); }).find("not 1-65535"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_engine_addresses("a:1,a:1", "engines.addresses"); }).find("listed twice"),
            std::string::npos);
}

TEST(EngineRendezvous, EachAnnouncedEngineIsReturnedOnceAndStrayFilesAreSkipped) {
  const fs::path dir = fs::temp_directory_path() / ("tiller_rdv_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  EngineRendezvous r(dir.string());
  EXPECT_TRUE(r.poll().empty());  // no folder yet: no engine
  const std::string a = announce_engine(dir.string(), "node7:41233", 42);
  EXPECT_TRUE(fs::exists(a));
  { std::ofstream(dir / "notes.json") << "{\"hello\": 1}"; }
  { std::ofstream(dir / "broken.json") << "{"; }
  r.know("node3:50051");  // an engine of engines.addresses
  announce_engine(dir.string(), "node3:50051", 43);
  EXPECT_EQ(r.poll(), std::vector<std::string>{"node7:41233"});
  EXPECT_TRUE(r.poll().empty());  // once
  announce_engine(dir.string(), "node8:50051", 44);
  EXPECT_EQ(r.poll(), std::vector<std::string>{"node8:50051"});
  EXPECT_NE(error_of([&] { announce_engine(dir.string(), "no-port", 1); }).find("not host:port"), std::string::npos);
  fs::remove_all(dir);
}

TEST(EngineRendezvous, AJobOfStandaloneEnginesHasNoEngineRanksAndNoHybrid) {
  JobConfig c;
  c.engines.addresses = "node3:50051";
  EXPECT_NE(error_of([&] { c.validate(); }).find("engines.count = 1 asks for engine ranks too"), std::string::npos);
  c.engines.count = 0;
  c.cluster.hybrid = true;
  EXPECT_NE(error_of([&] { c.validate(); }).find("need cluster.hybrid=false"), std::string::npos);
  c.cluster.hybrid = false;
  c.roles.actor.lora.rank = 8;
  EXPECT_NE(error_of([&] { c.validate(); }).find("roles.actor.lora with standalone engines"), std::string::npos);
}

}  // namespace
}  // namespace tiller::controller
