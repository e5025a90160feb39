// Encoding of PS messages: a flat byte buffer of int64 / float arrays. Reads are bounds-checked
// so a malformed message becomes an exception, never an out-of-bounds access.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "hybridsync/ps.h"

namespace hybridsync {

// Kinds of request a worker sends a server.
enum class RequestKind : int64_t { kPull = 1, kPush = 2, kError = 3 };

class Writer {
 public:
  void i64(int64_t v) { raw(&v, sizeof v); }
  void i64s(const int64_t* p, size_t n) { raw(p, n * sizeof(int64_t)); }
  void f32s(const float* p, size_t n) { raw(p, n * sizeof(float)); }
  void text(const std::string& s) {
    i64(static_cast<int64_t>(s.size()));
    raw(s.data(), s.size());
  }
  // Reserves n floats and returns where to write them (valid until the next append).
  float* f32_slot(size_t n) {
    const size_t at = buf_.size();
    buf_.resize(at + n * sizeof(float));
    return reinterpret_cast<float*>(buf_.data() + at);
  }
  void reserve(size_t bytes) { buf_.reserve(bytes); }
  std::vector<char> take() { return std::move(buf_); }

 private:
  void raw(const void* p, size_t bytes) {
    const size_t at = buf_.size();
    buf_.resize(at + bytes);
    if (bytes) std::memcpy(buf_.data() + at, p, bytes);
  }
  std::vector<char> buf_;
};

class Reader {
 public:
  explicit Reader(const std::vector<char>& buf) : buf_(buf) {}
  int64_t i64() {
    int64_t v;
    std::memcpy(&v, take(sizeof v), sizeof v);
    return v;
  }
  // Copies n int64 values out (they may sit at any 4-byte boundary).
  std::vector<int64_t> i64s(size_t n) {
    std::vector<int64_t> out(n);
    if (n) std::memcpy(out.data(), take(n * sizeof(int64_t)), n * sizeof(int64_t));
    return out;
  }
  // Reads n int64 values in place; requests put every int64 field first, so they are aligned.
  const int64_t* i64_view(size_t n) {
    const char* p = take(n * sizeof(int64_t));
    if (reinterpret_cast<uintptr_t>(p) % alignof(int64_t) != 0) fail();
    return reinterpret_cast<const int64_t*>(p);
  }
  // Float arrays are read in place: every field is a multiple of 4 bytes and buffers come
  // from the heap, so they are always 4-byte aligned.
  const float* f32s(size_t n) { return reinterpret_cast<const float*>(take(n * sizeof(float))); }
  std::string text() {
    const int64_t n = i64();
    if (n < 0) fail();
    const char* p = take(static_cast<size_t>(n));
    return std::string(p, static_cast<size_t>(n));
  }
  bool done() const { return pos_ == buf_.size(); }

 private:
  const char* take(size_t bytes) {
    if (bytes > buf_.size() - pos_) fail();
    const char* p = buf_.data() + pos_;
    pos_ += bytes;
    return p;
  }
  [[noreturn]] void fail() { throw PSTransportError("hybridsync: malformed PS message"); }
  const std::vector<char>& buf_;
  size_t pos_ = 0;
};

}  // namespace hybridsync
