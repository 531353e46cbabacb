// Parquet files of prompts, read through the embedded interpreter's pyarrow (interpreter.h): each
// row as one JSON object, so that parquet and JSONL prompts share one parser (prompt_dataset.cpp)
// and the same keys. Nested columns become nested objects and lists (verl's `prompt` messages,
// `reward_model.ground_truth`); values JSON cannot hold are written as text (bytes as UTF-8,
// dates in ISO form) and NaN or infinite floats as null.
//
// Memory: one record batch (kParquetBatchRows rows) in Python at a time, besides what `row` keeps.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace tiller::python {

inline constexpr int64_t kParquetBatchRows = 1024;

// Calls row(number, json) for each row in file order (numbers from 1) until it returns false.
// ConfigError naming the file when pyarrow is missing or cannot read it; an exception that `row`
// throws propagates after the interpreter's state is released.
void for_each_parquet_row(const std::string& path, const std::function<bool(int64_t, const std::string&)>& row);

}  // namespace tiller::python
