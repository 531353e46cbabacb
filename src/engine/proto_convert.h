// Engine types <-> the wire messages of proto/tiller/engine.proto (server and client share it).
#pragma once

#include <cstdint>

#include "tiller/engine.pb.h"
#include "tiller/engine/engine.h"
#include "tiller/engine/server.h"

namespace tiller::engine {

// Proto defaults mean: temperature 0 -> greedy, top_p 0 -> 1, n 0 -> 1, no seed -> `fallback_seed`.
// Values are carried over unchecked otherwise: Engine::add validates them.
Request from_proto(const v1::GenerateRequest& g, uint64_t fallback_seed);
void to_proto(const Request& r, uint64_t min_weight_version, v1::GenerateRequest& g);

void to_proto(const SampleOutput& o, uint64_t weight_version, v1::SampleResult& s);
SampleOutput from_proto(const v1::SampleResult& s);
// One message of a Generate stream as its reader sees it: a sample, or a refused request.
ClientResult from_proto(const v1::GenerateStreamResponse& r);

// The answer of Stats: the engine's counters, the cache's usage, the recent throughput and the
// weight version it serves.
void to_proto(const EngineStats& s, double tokens_per_second, uint64_t weight_version, v1::StatsResponse& r);
ServerStats from_proto(const v1::StatsResponse& r);

// The answer of Sleep and Wake: the leader rank's engine memory and its process's device memory.
void to_proto(const EngineMemory& m, v1::MemoryResponse& r);
ServerMemory from_proto(const v1::MemoryResponse& r);

// A pushed chunk of a delta sync (the payload is moved, not copied: it is most of the message).
void to_proto(const WeightChunk& c, v1::WeightChunk& m);
WeightChunk from_proto(v1::WeightChunk&& m);

}  // namespace tiller::engine
