// The records of a data file (private to src/): a JSONL file (one JSON object a line, blank lines
// allowed) or a parquet file (one object a row, read through the embedded Python's pyarrow), with
// the checks every reader makes of the path. The prompt dataset and the SFT, reward-model and DPO
// readers all read through here, so a bad record is named the same way: "file:line" (JSONL) or
// "file: row N" (parquet).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tiller/text/chat_template.h"

namespace tiller::data {

// Calls `fn(where, number, record)` for each record in file order (`number` is the 1-based line or
// row) until it returns false. `what` names the file in errors ("the prompt file"), `key` the
// config key that gave the path ("data.prompts"). ConfigError for a path that is missing, a
// directory or not a regular file, for a record that is not a JSON object (naming where); IoError
// for a read error. Returns the records read.
int64_t for_each_record(const std::string& path, const std::string& what, const std::string& key,
                        const std::function<bool(const std::string& where, int64_t number,
                                                 const nlohmann::ordered_json& record)>& fn);

// The value under `key`: the key itself, or else a dotted path into nested objects
// ("reward_model.ground_truth"). nullptr when there is none.
const nlohmann::ordered_json* lookup(const nlohmann::ordered_json& j, const std::string& key);

// The chat messages of `list` (found under `key`): objects with string "role" and "content"; their
// other keys (tool_calls, tool_call_id, name, ...) are kept, in their order, for Jinja chat
// templates. ConfigError naming `where` and `key` for an empty list or a malformed message.
std::vector<text::ChatMessage> chat_messages(const std::string& where, const nlohmann::ordered_json& list,
                                              const std::string& key);

}  // namespace tiller::data
