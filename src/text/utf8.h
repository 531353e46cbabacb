// UTF-8 helpers for the tokenizers (private to src/model).
#pragma once

#include <cstdint>
#include <string>

namespace tiller::text::utf8 {

inline std::string encode(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    s.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    s.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return s;
}

// Decodes the character at s[i]. Returns its length in bytes, or 0 when the bytes there are not
// valid UTF-8; *valid_prefix (if given) receives how many bytes form the longest valid-looking
// prefix (at least 1), the unit a lossy decoder replaces with U+FFFD.
inline size_t decode(const std::string& s, size_t i, uint32_t* cp, size_t* valid_prefix = nullptr) {
  auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  size_t n;
  uint32_t v;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c < 0x80) {
    *cp = c;
    return 1;
  } else if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
    v = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    v = c & 0x0F;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    v = c & 0x07;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    if (valid_prefix) *valid_prefix = 1;
    return 0;
  }
  for (size_t k = 1; k < n; ++k) {
    const bool ok = i + k < s.size() && b(k) >= (k == 1 ? lo : 0x80) && b(k) <= (k == 1 ? hi : 0xBF);
    if (!ok) {
      if (valid_prefix) *valid_prefix = k;
      return 0;
    }
    v = (v << 6) | (b(k) & 0x3F);
  }
  *cp = v;
  return n;
}

// Length of the character at s[i] (1 for an invalid byte).
inline size_t char_len(const std::string& s, size_t i) {
  uint32_t cp;
  const size_t n = decode(s, i, &cp);
  return n == 0 ? 1 : n;
}

// Valid UTF-8 with each maximal invalid subsequence replaced by U+FFFD (Rust's from_utf8_lossy).
inline std::string lossy(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    size_t bad = 1;
    const size_t n = decode(s, i, &cp, &bad);
    if (n > 0) {
      out.append(s, i, n);
      i += n;
    } else {
      out += "\xEF\xBF\xBD";
      i += bad;
    }
  }
  return out;
}

}  // namespace tiller::text::utf8
