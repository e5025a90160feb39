// "loopback": a one-rank transport whose messages stay in memory. The tests drive a real Client
// through it without MPI -- and it shows what a new transport takes: one file, one registration.
#include <deque>
#include <map>

#include "hybridsync/ps.h"
#include "transport/transport.h"

namespace hybridsync {
namespace {

class LoopbackTransport : public Transport {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void send(int dest, int tag, std::vector<char> payload) override {
    if (dest != 0) throw PSTransportError("loopback: no rank " + std::to_string(dest));
    bytes_ += static_cast<int64_t>(payload.size());
    ++messages_;
    queues_[tag].push_back(std::move(payload));
  }
  std::vector<char> recv(int source, int tag) override {
    auto& queue = queues_[tag];
    if (source != 0 || queue.empty()) throw PSTransportError("loopback: nothing to receive on tag " + std::to_string(tag));
    std::vector<char> out = std::move(queue.front());
    queue.pop_front();
    return out;
  }
  void wait_sends() override {}
  int64_t bytes_sent() const override { return bytes_; }
  int64_t bytes_received() const override { return bytes_; }
  int64_t messages_sent() const override { return messages_; }
  void reset_counters() override { bytes_ = messages_ = 0; }

 private:
  std::map<int, std::deque<std::vector<char>>> queues_;
  int64_t bytes_ = 0, messages_ = 0;
};

const TransportRegistrar kLoopback("loopback", [](const TransportConfig&) -> std::unique_ptr<Transport> {
  return std::make_unique<LoopbackTransport>();
});

}  // namespace
}  // namespace hybridsync
