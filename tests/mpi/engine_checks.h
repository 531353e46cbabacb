// What the weight-sync tests check on an engine rank (private to tests/mpi).
#pragma once

#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tiller/engine/engine.h"
#include "tiller/engine/engine_weights.h"
#include "tiller/model/weights.h"

namespace tiller::test {

// Engine `e` (world rank `me`) holds `full` (the actor's parameters, already in the wire dtype)
// sliced for its TP rank, bit for bit.
inline void expect_engine_slices(const model::ModelConfig& cfg, const engine::Engine& e,
                                 const model::NamedTensors& full, int me, const std::string& what) {
  const auto want = model::named_weights(
      cfg, engine::slice_for_tp(cfg, model::bind_weights(cfg, full, model::Head::kLm, "actor"), e.tp_rank(), e.tp_size()),
      model::Head::kLm);
  const auto got = e.parameters();
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [n, t] : want)
    EXPECT_TRUE(at::equal(got.at(n).cpu(), t)) << what << ": " << n << " differs on world rank " << me;
}

}  // namespace tiller::test
