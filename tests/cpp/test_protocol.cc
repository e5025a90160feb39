// Wire decoding (csrc/ps/protocol.h and the request readers): counts taken from a message are
// checked by division, never by multiplying them first. A count near 2^61 made `n * 8` wrap to
// a few bytes, pass the bounds check, and hand back a pointer to 2^61 "values" in a 16-byte
// message. Every such message must be rejected with PSTransportError instead.
#include <cstdint>
#include <functional>
#include <vector>

#include "check.h"
#include "hybridsync/ps.h"
#include "ps/client_impl.h"
#include "ps/protocol.h"

using namespace hybridsync;

namespace {

constexpr int64_t kNear2To61 = (int64_t{1} << 61) + 1;  // * 8 wraps to 8
constexpr int64_t kNear2To62 = (int64_t{1} << 62) + 1;  // * 4 wraps to 4

std::vector<char> message(const std::vector<int64_t>& fields) {
  Writer w;
  for (int64_t v : fields) w.i64(v);
  return w.take();
}

}  // namespace

TEST(reader_rejects_element_counts_whose_byte_size_wraps) {
  const std::vector<char> buf = message({1, 2});  // 16 bytes
  {
    Reader r(buf);
    CHECK_THROWS(r.i64_view(static_cast<size_t>(kNear2To61)), PSTransportError, "malformed");
  }
  {
    Reader r(buf);
    CHECK_THROWS(r.f32s(static_cast<size_t>(kNear2To62)), PSTransportError, "malformed");
  }
  {
    Reader r(buf);  // (copying out: rejected before anything is allocated)
    CHECK_THROWS(r.i64s(static_cast<size_t>(kNear2To61)), PSTransportError, "malformed");
  }
  {
    Reader r(buf);  // rows * dim * 4 wraps to 0
    CHECK_THROWS(r.f32s(int64_t{1} << 40, int64_t{1} << 22), PSTransportError, "malformed");
  }
  {
    Reader r(buf);
    CHECK_THROWS(r.f32s(int64_t{-1}, int64_t{4}), PSTransportError, "malformed");
  }
  {
    Reader r(buf);
    CHECK_THROWS(r.count(kNear2To61, sizeof(int64_t)), PSTransportError, "malformed");
  }
  {
    Reader r(buf);
    CHECK_THROWS(r.count(-3, 1), PSTransportError, "malformed");
  }
  // What fits is read as before.
  Reader r(buf);
  const int64_t* both = r.i64_view(2);
  CHECK(both[0] == 1 && both[1] == 2 && r.done());
}

TEST(request_entries_with_a_huge_row_count_are_rejected) {
  const std::function<int64_t(int)> dim_of = [](int) { return int64_t{4}; };
  float scale = 1.0f;
  {
    // A pull: one entry (table 0) claiming 2^61 + 1 row ids, followed by one.
    const std::vector<char> buf = message({1, 0, kNear2To61, 7});
    Reader r(buf);
    CHECK_THROWS(read_entries(r, false, &scale, dim_of), PSTransportError, "malformed");
  }
  {
    // An entry count that could not fit the message: rejected before entries are allocated.
    const std::vector<char> buf = message({kNear2To61, 0, 1});
    Reader r(buf);
    CHECK_THROWS(read_entries(r, false, &scale, dim_of), PSTransportError, "malformed");
  }
  {
    // A push whose row count times the table's width wraps.
    Writer w;
    w.i64(1);
    w.f64(1.0);
    w.i64(0);
    w.i64(int64_t{1} << 60);
    w.f64(0.1);
    w.i64(5);
    const std::vector<char> buf = w.take();
    Reader r(buf);
    CHECK_THROWS(read_entries(r, true, &scale, dim_of), PSTransportError, "malformed");
  }
  {
    // A well-formed pull of two rows still reads.
    const std::vector<char> buf = message({1, 3, 2, 10, 11});
    Reader r(buf);
    const std::vector<Entry> entries = read_entries(r, false, &scale, dim_of);
    CHECK(entries.size() == 1 && entries[0].table == 3 && entries[0].rows.n == 2);
    CHECK(entries[0].rows.rows[0] == 10 && entries[0].rows.rows[1] == 11);
  }
}
