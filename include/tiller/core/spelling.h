// Suggestions for misspelled names (config keys, subcommands): the candidate nearest by edit
// distance.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace tiller {

// Levenshtein distance (insertions, deletions and substitutions of single bytes).
std::size_t edit_distance(std::string_view a, std::string_view b);

// The candidate nearest to `word`, the first one on ties; "" when there are none, or when even the
// nearest differs in more than half of its letters (no suggestion beats a nonsensical one).
std::string closest_word(std::string_view word, const std::vector<std::string>& candidates);

}  // namespace tiller
