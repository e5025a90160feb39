#include "heartbeat.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <spawn.h>
#include <unistd.h>  // environ

#include <algorithm>
#include <atomic>
#include <cstddef>
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

// Set from Python (set_lost_host_last_words): what to say and start before a watchdog abort over a
// peer on another host. Its own lock: stop_heartbeat() holds g_lock while the thread finishes.
// The backstop's argv was made when the heartbeat started, possibly hours earlier: it names the
// launcher by pid and start time and leaves alone a process that reused the pid since
// (hybridsync/lost_hosts.py backstop_command).
struct LastWords {
  std::string advice;
  std::string advice_claim;
  std::vector<std::string> backstop;
  std::string backstop_note;
};
std::mutex g_last_words_lock;
LastWords g_last_words;

// Starts argv (an absolute path first) in a session of its own, stdio on /dev/null and nothing
// else inherited (the rank's pipes to its launcher and its MPI sockets stay with the rank).
bool spawn_detached(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&actions);
  posix_spawnattr_init(&attr);
  for (int fd = 0; fd < 3; ++fd) posix_spawn_file_actions_addopen(&actions, fd, "/dev/null", fd ? O_WRONLY : O_RDONLY, 0);
  posix_spawn_file_actions_addclosefrom_np(&actions, 3);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSID);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, args[0], &actions, &attr, args.data(), environ);
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&actions);
  return rc == 0;
}

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

  double departed_for(int peer) const {
    if (peer < 0 || peer >= size_ || peer == rank_) return -1.0;
    const int64_t when = departed_[peer].load();
    return when ? static_cast<double>(now_us() - when) / 1e6 : -1.0;
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
        if (hosts_[p] != hosts_[rank_]) say_lost_host_last_words();  // on this host, its daemon ends the frozen peer
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
  std::unique_ptr<std::atomic<int64_t>[]> departed_;  // when the goodbye came (0: still here)
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

void set_lost_host_last_words(const std::string& advice, const std::string& advice_claim,
                              const std::vector<std::string>& backstop, const std::string& backstop_note) {
  std::lock_guard<std::mutex> lock(g_last_words_lock);
  g_last_words = LastWords{advice, advice_claim, backstop, backstop_note};
}

bool first_on_this_host(const std::string& name) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return true;  // cannot tell: better said twice than not at all
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof(addr.sun_path) - 1);
  std::memcpy(addr.sun_path + 1, name.data(), n);  // sun_path[0] == 0: the abstract namespace
  if (bind(fd, reinterpret_cast<const sockaddr*>(&addr), static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n)) == 0)
    return true;  // the socket stays open: the claim lasts as long as this process
  close(fd);
  return false;
}

void say_lost_host_last_words() {
  std::lock_guard<std::mutex> lock(g_last_words_lock);
  const LastWords& words = g_last_words;
  const bool advised = !words.advice.empty() && (words.advice_claim.empty() || first_on_this_host(words.advice_claim));
  if (advised) std::fprintf(stderr, "%s\n", words.advice.c_str());
  if (!words.backstop.empty() && spawn_detached(words.backstop) && advised && !words.backstop_note.empty())
    std::fprintf(stderr, "%s\n", words.backstop_note.c_str());
  std::fflush(stderr);
  g_last_words = LastWords{};  // once: a second call (a second silent peer) must not arm a second backstop
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

double silent_for(int peer) {
  std::lock_guard<std::mutex> lock(g_lock);
  return g_heartbeat ? g_heartbeat->silent_for(peer) : 0.0;
}

std::string host_of(int peer) {
  std::lock_guard<std::mutex> lock(g_lock);
  return g_heartbeat ? g_heartbeat->host_of(peer) : "?";
}

double departed_for(int peer) {
  std::lock_guard<std::mutex> lock(g_lock);
  return g_heartbeat ? g_heartbeat->departed_for(peer) : -1.0;
}

int heartbeat_size() {
  std::lock_guard<std::mutex> lock(g_lock);
  return g_heartbeat ? g_heartbeat->size() : 0;
}

}  // namespace hybridsync
