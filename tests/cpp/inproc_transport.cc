#include "inproc_transport.h"

#include <algorithm>
#include <thread>

#include "transport/fragments.h"

namespace hybridsync {
namespace {

class InprocTransport : public Transport {
 public:
  InprocTransport(InprocHub& hub, int rank, WaitPolicy policy) : hub_(hub), rank_(rank), policy_(policy) {}
  int rank() const override { return rank_; }
  int size() const override { return hub_.size; }
  void send(int dest, int tag, std::vector<char> payload) override {
    if (dest < 0 || dest >= hub_.size) throw PSTransportError("inproc: no rank " + std::to_string(dest));
    const int64_t limit = max_message_bytes();
    std::lock_guard<std::mutex> lock(hub_.mu);  // all fragments at once: they stay together
    auto& box = hub_.boxes[{dest, tag}];
    for (auto& fragment : split_message(std::move(payload), limit)) {
      bytes_ += static_cast<int64_t>(fragment.size());
      largest_ = std::max(largest_, static_cast<int64_t>(fragment.size()));
      ++messages_;
      box.emplace_back(rank_, std::move(fragment));
    }
  }
  bool try_recv(int source, int tag, Message* out) override {
    std::lock_guard<std::mutex> lock(hub_.mu);
    auto& box = hub_.boxes[{rank_, tag}];
    auto it = std::find_if(box.begin(), box.end(), [&](const auto& m) { return source == kAnySource || m.first == source; });
    if (it == box.end()) return false;
    out->source = it->first;
    out->data = std::move(it->second);
    size_t last = out->data.size();
    it = box.erase(it);
    while (message_continues(last, max_message_bytes())) {  // the rest follows from the same source
      it = std::find_if(it, box.end(), [&](const auto& m) { return m.first == out->source; });
      if (it == box.end()) throw PSTransportError("inproc: a fragmented message lost its tail");
      last = it->second.size();
      out->data.insert(out->data.end(), it->second.begin(), it->second.end());
      it = box.erase(it);
    }
    return true;
  }
  bool sends_done() override { return true; }
  int64_t max_message_bytes() const override { return hub_.limit > 0 ? hub_.limit : int64_t{1} << 40; }
  WaitPolicy wait_policy() const override { return policy_; }
  int64_t bytes_sent() const override { return bytes_; }
  int64_t bytes_received() const override { return 0; }
  int64_t messages_sent() const override { return messages_; }
  int64_t largest_message_sent() const override { return largest_; }
  void reset_counters() override { bytes_ = messages_ = largest_ = 0; }

 private:
  InprocHub& hub_;
  int rank_;
  WaitPolicy policy_;
  int64_t bytes_ = 0, messages_ = 0, largest_ = 0;
};

const TransportRegistrar kInproc("inproc", [](const TransportConfig& config) -> std::unique_ptr<Transport> {
  if (!config.native) throw PSError("the inproc transport needs an InprocEndpoint");
  const auto* at = static_cast<const InprocEndpoint*>(config.native);
  return std::make_unique<InprocTransport>(*at->hub, at->rank, config.wait);
});

}  // namespace

std::unique_ptr<Client> inproc_client(InprocHub& hub, int rank, bool serve_in_background, WaitPolicy policy) {
  InprocEndpoint at{&hub, rank};
  return make_client("inproc", &at, policy, hub.limit, serve_in_background);
}

std::vector<std::exception_ptr> run_ranks(int size, const std::function<void(int, Client&)>& body, int64_t limit,
                                          bool serve_in_background) {
  InprocHub hub(size, limit);
  std::vector<std::unique_ptr<Client>> clients;
  for (int r = 0; r < size; ++r) clients.push_back(inproc_client(hub, r, serve_in_background));
  std::vector<std::exception_ptr> errors(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r, *clients[r]);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace hybridsync
