#include "heartbeat.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

namespace hybridsync {
namespace {

constexpr int kTagHeartbeat = 105;
constexpr int kTagGoodbye = 106;  // a peer leaving normally: never report it silent

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class Heartbeat {
 public:
  Heartbeat(MPI_Comm comm, double interval_s, double abort_after_s)
      : interval_us_(static_cast<int64_t>(interval_s * 1e6)), abort_after_us_(static_cast<int64_t>(abort_after_s * 1e6)) {
    MPI_Comm_dup(comm, &comm_);
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);  // a dead peer must not abort this rank
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    char name[MPI_MAX_PROCESSOR_NAME] = {0};
    int len = 0;
    MPI_Get_processor_name(name, &len);
    std::vector<char> all(static_cast<size_t>(size_) * MPI_MAX_PROCESSOR_NAME);
    MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR, comm_);
    for (int r = 0; r < size_; ++r) hosts_.emplace_back(all.data() + static_cast<size_t>(r) * MPI_MAX_PROCESSOR_NAME);
    last_seen_ = std::make_unique<std::atomic<int64_t>[]>(static_cast<size_t>(size_));
    const int64_t start = now_us();
    departed_ = std::make_unique<std::atomic<int64_t>[]>(static_cast<size_t>(size_));
    for (int r = 0; r < size_; ++r) {
      last_seen_[r] = start;
      departed_[r] = 0;
    }
    sends_.assign(static_cast<size_t>(size_), MPI_REQUEST_NULL);
    thread_ = std::thread([this] { run(); });
  }

  ~Heartbeat() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
    for (MPI_Request& r : sends_) {
      if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);  // small eager sends: gone already or never matched
    }
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }

  double silent_for(int peer) const {
    if (peer < 0 || peer >= size_ || peer == rank_ || departed_[peer].load()) return 0.0;
    return static_cast<double>(now_us() - last_seen_[peer].load()) / 1e6;
  }

  // Seconds since `peer` said goodbye (shut down), or 0 while it has not.
  double gone_for(int peer) const {
    if (peer < 0 || peer >= size_ || peer == rank_) return 0.0;
    const int64_t at = departed_[peer].load();
    return at == 0 ? 0.0 : static_cast<double>(now_us() - at) / 1e6;
  }

  std::string host_of(int peer) const { return peer >= 0 && peer < size_ ? hosts_[peer] : "?"; }
  int size() const { return size_; }
  int rank() const { return rank_; }

 private:
  void run() {
    char byte = 1, sink = 0;
    int64_t last_round = now_us();
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_) {
      lock.unlock();
      const int64_t round = now_us();
      if (round - last_round > 2 * interval_us_ + 1000000) {
        // This process itself was stopped (SIGSTOP, a debugger): its peers were not silent,
        // it was not listening. Start counting afresh.
        for (int r = 0; r < size_; ++r) last_seen_[r] = round;
      }
      last_round = round;
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        int done = 1;
        if (sends_[p] != MPI_REQUEST_NULL) MPI_Test(&sends_[p], &done, MPI_STATUS_IGNORE);
        if (done) MPI_Isend(&byte, 1, MPI_CHAR, p, kTagHeartbeat, comm_, &sends_[p]);  // one in flight per peer
      }
      while (true) {  // everything that arrived since the last round
        int flag = 0;
        MPI_Status status;
        if (MPI_Iprobe(MPI_ANY_SOURCE, kTagHeartbeat, comm_, &flag, &status) != MPI_SUCCESS || !flag) break;
        MPI_Recv(&sink, 1, MPI_CHAR, status.MPI_SOURCE, kTagHeartbeat, comm_, MPI_STATUS_IGNORE);
        last_seen_[status.MPI_SOURCE] = now_us();
      }
      while (true) {
        int flag = 0;
        MPI_Status status;
        if (MPI_Iprobe(MPI_ANY_SOURCE, kTagGoodbye, comm_, &flag, &status) != MPI_SUCCESS || !flag) break;
        MPI_Recv(&sink, 1, MPI_CHAR, status.MPI_SOURCE, kTagGoodbye, comm_, MPI_STATUS_IGNORE);
        departed_[status.MPI_SOURCE] = now_us();
      }
      if (abort_after_us_ > 0) watchdog();
      lock.lock();
      wake_.wait_for(lock, std::chrono::microseconds(interval_us_), [this] { return stopping_; });
    }
    lock.unlock();
    for (int p = 0; p < size_; ++p) {  // small eager sends: they leave even if never matched
      if (p == rank_) continue;
      MPI_Request goodbye;
      if (MPI_Isend(&byte, 1, MPI_CHAR, p, kTagGoodbye, comm_, &goodbye) == MPI_SUCCESS) MPI_Request_free(&goodbye);
    }
  }

  // Whatever the rank is blocked in, a peer silent past the limit ends the job. The waits that
  // check the heartbeat raise a Python error naming the peer well before this (the limit is the
  // peer timeout plus a grace period); this catches the waits that cannot (Horovod's own).
  void watchdog() {
    for (int p = 0; p < size_; ++p) {
      if (p == rank_ || departed_[p].load()) continue;
      const int64_t silent = now_us() - last_seen_[p].load();
      if (silent > abort_after_us_) {
        std::fprintf(stderr,
                     "hybridsync: rank %d on host %s has not been heard from for %.0f s (frozen, dead or "
                     "unreachable); rank %d is blocked where no error can be raised: aborting the job\n",
                     p, hosts_[p].c_str(), static_cast<double>(silent) / 1e6, rank_);
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  int64_t interval_us_;
  int64_t abort_after_us_;
  std::vector<std::string> hosts_;
  std::unique_ptr<std::atomic<int64_t>[]> last_seen_;
  std::unique_ptr<std::atomic<int64_t>[]> departed_;  // when each peer said goodbye (0: not yet)
  std::vector<MPI_Request> sends_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;
};

std::mutex g_lock;
std::unique_ptr<Heartbeat> g_heartbeat;

}  // namespace

void start_heartbeat(MPI_Comm comm, double interval_s, double abort_after_s) {
  std::lock_guard<std::mutex> lock(g_lock);
  if (!g_heartbeat) g_heartbeat = std::make_unique<Heartbeat>(comm, interval_s, abort_after_s);
}

void stop_heartbeat() {
  std::lock_guard<std::mutex> lock(g_lock);
  g_heartbeat.reset();
}

std::vector<SilentPeer> silent_peers(double timeout_s) {
  std::lock_guard<std::mutex> lock(g_lock);
  std::vector<SilentPeer> out;
  if (!g_heartbeat) return out;
  for (int p = 0; p < g_heartbeat->size(); ++p) {
    const double s = g_heartbeat->silent_for(p);
    if (s > timeout_s) out.push_back({p, g_heartbeat->host_of(p), s});
  }
  return out;
}

std::vector<SilentPeer> departed_peers(double min_s) {
  std::lock_guard<std::mutex> lock(g_lock);
  std::vector<SilentPeer> out;
  if (!g_heartbeat) return out;
  for (int p = 0; p < g_heartbeat->size(); ++p) {
    const double s = g_heartbeat->gone_for(p);
    if (s > min_s) out.push_back({p, g_heartbeat->host_of(p), s});
  }
  return out;
}

double silent_for(int peer) {
  std::lock_guard<std::mutex> lock(g_lock);
  return g_heartbeat ? g_heartbeat->silent_for(peer) : 0.0;
}

std::string host_of(int peer) {
  std::lock_guard<std::mutex> lock(g_lock);
  return g_heartbeat ? g_heartbeat->host_of(peer) : "?";
}

}  // namespace hybridsync
