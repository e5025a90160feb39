// Messages longer than a transport's limit travel as fragments: every fragment but the last is
// exactly `limit` bytes and the last one is shorter (possibly empty), so a receiver knows a
// message goes on while its fragments are full-sized -- no header, no copy for short messages.
// The limit must be the same on every rank (hybridsync/ps.py agrees on it when it starts).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace hybridsync {

// `payload` as the messages to send, in order.
inline std::vector<std::vector<char>> split_message(std::vector<char> payload, int64_t limit) {
  std::vector<std::vector<char>> out;
  const size_t step = static_cast<size_t>(limit);
  if (payload.size() < step) {
    out.push_back(std::move(payload));
    return out;
  }
  for (size_t at = 0;; at += step) {
    const size_t n = std::min(step, payload.size() - at);
    out.emplace_back(payload.begin() + static_cast<std::ptrdiff_t>(at),
                     payload.begin() + static_cast<std::ptrdiff_t>(at + n));
    if (n < step) break;
  }
  return out;
}

// Whether a received fragment of `bytes` is followed by another one of the same message.
inline bool message_continues(size_t bytes, int64_t limit) { return bytes == static_cast<size_t>(limit); }

}  // namespace hybridsync
