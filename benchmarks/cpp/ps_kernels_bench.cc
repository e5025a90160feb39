// One shard's hot kernels against the memory bandwidth of the core they run on (no MPI).
//
//   pull          Shard::gather of a request's unique rows (what a server does for a pull)
//   pull+dedup    deduplicate() of the raw ids, then the gather (a one-shard pull end to end)
//   push <rule>   a push end to end, as one rank's push reaches one shard: "client", the
//                 pushing rank's deduplicate_and_sum() (ids deduplicated and the gradients of
//                 duplicate ids scatter-added in one pass, one row per distinct id); then the
//                 shard's RowAggregator::step in its two halves, "sum" (the sources' rows summed per row; with --statistics
//                 also the squared norms the adaptive batch size's noise scale reads, which a
//                 shard computes only when asked) and "apply" (the rule -- sgd / adagrad / adam --
//                 on each distinct row); each half also timed alone
//   dyn lookup    IdMap::find_many on a dynamic shard's raw ids (the hash path alone)
//   dyn pull      DynamicStore::read: the lookup, then the rows copied out
//
// next to a STREAM-style copy (a[i] = b[i]) and triad (a[i] = b[i] + s * c[i]) over arrays far
// larger than the last-level cache, timed in the same run on the same core (the process is
// pinned with sched_setaffinity before anything is allocated).
//
// Bandwidth is counted in bytes of table rows touched: a kernel that touches u distinct rows of
// d floats in t seconds does u * 4d / t ("row GB/s"); pushes also count their optimizer slots
// ("row+slot GB/s": u * 4d * (1 + slots) / t). Each row is counted once, though it is read and
// (pushes) written. STREAM counts its arrays as STREAM does (copy 2 x 8 B per element, triad 3 x 8).
// "all GB/s" adds the other row-sized buffers a kernel streams through, each once: the pull's
// output rows; a push's raw gradient rows (one per id, not per distinct id: the pushing rank reads
// --batch of them) and its summed rows; the apply's summed gradient rows.
// Every figure is the median over --repeats passes of --rounds requests of --batch ids; every pass
// of every kernel draws ids of its own (rows a pass touched are not found warm by the next).
//
//   cmake --build <build dir> --target hybridsync_ps_kernels_bench
//   <build dir>/hybridsync_ps_kernels_bench --json out.json          # full size
//   <build dir>/hybridsync_ps_kernels_bench --quick                  # small tables: a smoke run
//
// benchmarks/kernels.py builds and runs it and writes benchmarks/results/kernels.{md,json,png}.
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "ps/dedup.h"
#include "ps/dynamic_store.h"
#include "ps/seeded.h"
#include "ps/shard.h"
#include "ps/update_rule.h"

using namespace hybridsync;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  int cpu = -1;                       // -1: the first CPU this process may run on
  std::vector<std::pair<int64_t, int64_t>> tables{{2'000'000, 32}, {500'000, 128}};
  int64_t batch = 16384;              // ids per request
  int64_t rounds = 64;                // requests per timed pass
  int repeats = 7;
  int drawn_passes = 0;               // passes of requests drawn (0: --repeats); cachegrind runs draw alike
  double zipf = 1.2;
  std::vector<std::string> dists{"zipf", "uniform"};
  std::vector<std::string> rules{"sgd", "adagrad", "adam"};
  bool dynamic = true;
  bool statistics = false;            // pushes also compute the noise scale's squared norms
  int64_t stream_bytes = 0;           // per array; 0: 4 x the last-level cache, at least 64 MiB
  std::string only;                   // one kernel (pull, pull+dedup, push, dyn) and no STREAM: for cachegrind
  std::string json;
  bool wants(const std::string& kernel) const { return only.empty() || only == kernel; }
};

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "ps_kernels_bench: %s\n"
               "options: --cpu N  --tables ROWSxDIM[,ROWSxDIM...]  --batch N  --rounds N  --repeats N\n"
               "         --dists zipf,uniform  --rules sgd,adagrad,adam  --zipf A  --no-dynamic\n"
               "         --stream-mib N  --json PATH  --quick  --statistics\n"
               "         --only pull|pull+dedup|push|dyn   (that kernel alone, no STREAM: for cachegrind)\n"
               "         --draw-passes N   (draw requests for N passes whatever --repeats: runs that differ\n"
               "                           only in --repeats then do the same setup)\n",
               why.c_str());
  std::exit(2);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, sep);) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

int64_t positive(const std::string& flag, const std::string& value) {
  char* end = nullptr;
  const long long v = std::strtoll(value.c_str(), &end, 10);
  if (end == value.c_str() || *end != '\0' || v <= 0) usage(flag + " wants a positive integer, got '" + value + "'");
  return v;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(flag + " needs a value");
      return argv[++i];
    };
    if (flag == "--cpu") {
      o.cpu = static_cast<int>(std::strtol(value().c_str(), nullptr, 10));
    } else if (flag == "--tables") {
      o.tables.clear();
      for (const std::string& t : split(value(), ',')) {
        const auto x = t.find('x');
        if (x == std::string::npos) usage("--tables: '" + t + "' is not ROWSxDIM");
        o.tables.emplace_back(positive("--tables", t.substr(0, x)), positive("--tables", t.substr(x + 1)));
      }
    } else if (flag == "--batch") {
      o.batch = positive(flag, value());
    } else if (flag == "--rounds") {
      o.rounds = positive(flag, value());
    } else if (flag == "--repeats") {
      o.repeats = static_cast<int>(positive(flag, value()));
    } else if (flag == "--draw-passes") {
      o.drawn_passes = static_cast<int>(positive(flag, value()));
    } else if (flag == "--zipf") {
      o.zipf = std::strtod(value().c_str(), nullptr);
      if (!(o.zipf > 1.0)) usage("--zipf: the exponent must be > 1");
    } else if (flag == "--dists") {
      o.dists = split(value(), ',');
      for (const auto& d : o.dists) {
        if (d != "zipf" && d != "uniform") usage("--dists: '" + d + "' is neither zipf nor uniform");
      }
    } else if (flag == "--rules") {
      o.rules = split(value(), ',');
    } else if (flag == "--no-dynamic") {
      o.dynamic = false;
    } else if (flag == "--statistics") {
      o.statistics = true;
    } else if (flag == "--stream-mib") {
      o.stream_bytes = positive(flag, value()) << 20;
    } else if (flag == "--only") {
      o.only = value();
      if (o.only != "pull" && o.only != "pull+dedup" && o.only != "push" && o.only != "dyn") {
        usage("--only: '" + o.only + "' is none of pull, pull+dedup, push, dyn");
      }
      o.dynamic = o.only == "dyn";
    } else if (flag == "--json") {
      o.json = value();
    } else if (flag == "--quick") {
      o.tables = {{200'000, 32}, {50'000, 128}};
      o.rounds = 8;
      o.repeats = 3;
      o.batch = 4096;
      o.stream_bytes = 16 << 20;
    } else {
      usage("unknown option " + flag);
    }
  }
  return o;
}

int pin(int cpu) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) usage("sched_getaffinity failed");
  if (cpu < 0) {
    for (cpu = 0; cpu < CPU_SETSIZE && !CPU_ISSET(cpu, &allowed); ++cpu) {
    }
  }
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  if (sched_setaffinity(0, sizeof(one), &one) != 0) usage("--cpu " + std::to_string(cpu) + ": cannot run there");
  return cpu;
}

std::string read_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// The largest cache sysfs lists for CPU 0 ("32768K"); sysconf's answer is wrong on some VMs
// (ten times the real L3 here), so it is only the fallback.
int64_t last_level_cache_bytes() {
  int64_t largest = 0;
  for (int index = 0; index < 8; ++index) {
    const std::string size = read_line("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size");
    if (size.empty()) continue;
    int64_t bytes = std::strtoll(size.c_str(), nullptr, 10);
    if (size.back() == 'K') bytes <<= 10;
    if (size.back() == 'M') bytes <<= 20;
    largest = std::max(largest, bytes);
  }
  if (largest > 0) return largest;
  const long bytes = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return bytes > 0 ? bytes : 32 << 20;
}

// Zipf(a) over 1, 2, ... by rejection (Devroye, "Non-Uniform Random Variate Generation", X.6.1),
// the distribution numpy's zipf() draws, so ids mod rows match the Python benchmarks' workload.
class Zipf {
 public:
  explicit Zipf(double a) : am1_(a - 1.0), b_(std::pow(2.0, a - 1.0)) {}
  template <class Rng>
  uint64_t operator()(Rng& rng) {
    std::uniform_real_distribution<double> u01(0.0, 1.0);
    while (true) {
      const double u = 1.0 - u01(rng), v = u01(rng);
      const double x = std::floor(std::pow(u, -1.0 / am1_));
      if (!(x >= 1.0 && x < 9.2e18)) continue;
      const double t = std::pow(1.0 + 1.0 / x, am1_);
      if (v * x * (t - 1.0) / (b_ - 1.0) <= t / b_) return static_cast<uint64_t>(x);
    }
  }

 private:
  double am1_, b_;
};

// The requests of `sets` kernels x --repeats passes x --rounds, drawn before any timing: every pass
// of every kernel has ids of its own, so no pass finds the rows that the pass before it touched
// still in the caches (Zipf's hot rows recur, as from step to step of a training; its tail does not).
struct Requests {
  std::vector<std::vector<int64_t>> raw;     // a request's ids (rows of the table)
  std::vector<std::vector<int64_t>> unique;  // its distinct ids, first-seen order (what a shard is sent)
  double mean_unique = 0;                    // distinct ids per request
  int64_t rounds = 0;
  int repeats = 0;  // passes drawn per kernel
  // [first, last) of kernel `set`'s pass `pass`.
  std::pair<size_t, size_t> pass(int set, int pass) const {
    const size_t first = static_cast<size_t>((set * repeats + pass) * rounds);
    return {first, first + static_cast<size_t>(rounds)};
  }
};

Requests draw_requests(const Options& o, const std::string& dist, int64_t rows, uint64_t seed, int sets) {
  std::mt19937_64 rng(seed);
  Zipf zipf(o.zipf);
  std::uniform_int_distribution<int64_t> uniform(0, rows - 1);
  Requests out;
  out.rounds = o.rounds;
  out.repeats = std::max(o.repeats, o.drawn_passes);
  out.raw.resize(static_cast<size_t>(sets * out.repeats * o.rounds));
  double total = 0;
  for (auto& ids : out.raw) {
    ids.resize(static_cast<size_t>(o.batch));
    for (auto& id : ids) id = dist == "zipf" ? static_cast<int64_t>(zipf(rng) % static_cast<uint64_t>(rows)) : uniform(rng);
    out.unique.push_back(deduplicate("bench", ids.data(), static_cast<int64_t>(ids.size()), rows).unique);
    total += static_cast<double>(out.unique.back().size());
  }
  out.mean_unique = total / static_cast<double>(out.raw.size());
  return out;
}

struct Result {
  std::string kernel, dist, rule;
  int64_t rows = 0, dim = 0, slots = 0;
  double unique_per_request = 0;  // distinct rows per request (mean)
  double seconds_per_request = 0;  // median pass / rounds
  double row_gbps = 0, row_slot_gbps = 0, all_gbps = 0, ns_per_row = 0;
};

std::vector<Result> results;

void record(const std::string& kernel, const std::string& dist, const std::string& rule, int64_t rows, int64_t dim,
            int64_t slots, double unique_per_request, const std::vector<double>& pass_seconds, int64_t rounds,
            double other_bytes = 0) {
  Result r{kernel, dist, rule, rows, dim, slots, unique_per_request};
  const double t = median(pass_seconds) / static_cast<double>(rounds);
  const double row_bytes = unique_per_request * static_cast<double>(dim) * sizeof(float);
  r.seconds_per_request = t;
  r.row_gbps = row_bytes / t / 1e9;
  r.row_slot_gbps = row_bytes * static_cast<double>(1 + slots) / t / 1e9;
  r.all_gbps = (row_bytes * static_cast<double>(1 + slots) + other_bytes) / t / 1e9;
  r.ns_per_row = t * 1e9 / unique_per_request;
  results.push_back(r);
  std::printf("  %-15s %-8s %-8s %9lld x %-4lld %10.0f %10.2f %9.2f %9.2f %9.2f %9.1f\n", kernel.c_str(),
              dist.c_str(), rule.empty() ? "-" : rule.c_str(), static_cast<long long>(rows),
              static_cast<long long>(dim), unique_per_request, t * 1e6, r.row_gbps, r.row_slot_gbps, r.all_gbps,
              r.ns_per_row);
  std::fflush(stdout);
}

// A shard whose rows (and slots) are resident: a fresh shard reads as shared zero pages, which
// would make every gather a cache hit.
std::unique_ptr<Shard> resident_shard(int64_t rows, int64_t dim, const std::string& rule) {
  auto shard = std::make_unique<Shard>("bench", rows, dim, make_update_rule(rule, {{"lr", 0.01}}));
  for (int64_t l = 0; l < rows; ++l) {  // small values, cheap to make (cachegrind runs this too)
    float* row = shard->row(l);
    for (int64_t j = 0; j < dim; ++j) row[j] = static_cast<float>(static_cast<int64_t>(mix64(l * dim + j) % 2001) - 1000) * 1e-5f;
  }
  for (int k = 0; k < shard->num_slots(); ++k) {
    float* slot = shard->slot(k);
    std::fill(slot, slot + rows * dim, 0.0f);  // written, so resident
  }
  return shard;
}

struct Stream {
  double copy_gbps = 0, triad_gbps = 0, copy_best = 0, triad_best = 0;
  int64_t array_bytes = 0;
};

Stream stream(const Options& o) {
  const int64_t bytes = o.stream_bytes ? o.stream_bytes : std::max<int64_t>(4 * last_level_cache_bytes(), 64 << 20);
  const int64_t n = bytes / static_cast<int64_t>(sizeof(double));
  std::vector<double> a(n, 1.0), b(n, 2.0), c(n, 0.5);
  const double s = 3.0;
  std::vector<double> copy, triad;
  for (int r = 0; r < std::max(o.repeats, 5); ++r) {
    auto t0 = Clock::now();
    for (int64_t i = 0; i < n; ++i) a[i] = b[i];
    copy.push_back(2.0 * static_cast<double>(bytes) / seconds_since(t0) / 1e9);
    t0 = Clock::now();
    for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
    triad.push_back(3.0 * static_cast<double>(bytes) / seconds_since(t0) / 1e9);
  }
  double check = 0;
  for (int64_t i = 0; i < n; i += 4096) check += a[i];
  if (check == 12345.678) std::puts("");  // keeps the loops
  Stream out;
  out.array_bytes = bytes;
  out.copy_gbps = median(copy);
  out.triad_gbps = median(triad);
  out.copy_best = *std::max_element(copy.begin(), copy.end());
  out.triad_best = *std::max_element(triad.begin(), triad.end());
  return out;
}

void bench_fixed(const Options& o, int64_t rows, int64_t dim, const std::string& dist) {
  // Set 0: pull; 1: pull+dedup; 2 + k: push with rule k.
  const Requests requests = draw_requests(o, dist, rows, 1000 + static_cast<uint64_t>(rows) + static_cast<uint64_t>(dim),
                                          2 + static_cast<int>(o.rules.size()));
  const double unique = requests.mean_unique;
  const double row_size = static_cast<double>(dim) * sizeof(float);
  const double distinct_rows_bytes = unique * row_size, raw_rows_bytes = static_cast<double>(o.batch) * row_size;
  std::vector<float> out(static_cast<size_t>(o.batch * dim));
  if (o.wants("pull") || o.wants("pull+dedup")) {
    auto shard = resident_shard(rows, dim, "sgd");
    std::vector<double> gather, dedup_gather;
    for (int r = 0; r < o.repeats; ++r) {
      auto t0 = Clock::now();
      if (o.wants("pull")) {
        for (auto [q, end] = requests.pass(0, r); q < end; ++q) {
          const auto& u = requests.unique[q];
          shard->gather(u.data(), static_cast<int64_t>(u.size()), out.data());
        }
      }
      gather.push_back(seconds_since(t0));
      t0 = Clock::now();
      if (o.wants("pull+dedup")) {
        for (auto [q, end] = requests.pass(1, r); q < end; ++q) {
          const auto& ids = requests.raw[q];
          const Dedup d = deduplicate("bench", ids.data(), static_cast<int64_t>(ids.size()), rows);
          shard->gather(d.unique.data(), static_cast<int64_t>(d.unique.size()), out.data());
        }
      }
      dedup_gather.push_back(seconds_since(t0));
    }
    if (o.wants("pull")) record("pull", dist, "", rows, dim, 0, unique, gather, o.rounds, distinct_rows_bytes);
    if (o.wants("pull+dedup")) {
      record("pull+dedup", dist, "", rows, dim, 0, unique, dedup_gather, o.rounds, distinct_rows_bytes);
    }
  }
  if (!o.wants("push")) return;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-1e-3f, 1e-3f);
  std::vector<float> grads(static_cast<size_t>(o.batch * dim));
  for (auto& g : grads) g = u(rng);  // one gradient block for every request: its reads stay cached
  for (size_t k = 0; k < o.rules.size(); ++k) {
    const std::string& rule = o.rules[k];
    auto shard = resident_shard(rows, dim, rule);
    const int64_t slots = shard->num_slots();
    RowAggregator aggregator;
    GradientBuffer sums;  // the pushing rank's summed rows, reused request after request
    std::vector<int64_t> distinct;  // its distinct ids, likewise
    aggregator.set_statistics(o.statistics);
    std::vector<double> step, client, server_sum, apply;
    for (int r = 0; r < o.repeats; ++r) {
      double deduplicating = 0, summing = 0, applying = 0;
      const auto t0 = Clock::now();
      for (auto [q, end] = requests.pass(2 + static_cast<int>(k), r); q < end; ++q) {
        const auto& ids = requests.raw[q];
        // The pushing rank: its batch's duplicate ids' gradients summed, one row per distinct id.
        const auto c0 = Clock::now();
        const float* summed = deduplicate_and_sum("bench", ids.data(), static_cast<int64_t>(ids.size()), rows,
                                                  grads.data(), dim, &distinct, &sums);
        // The shard: its sources' rows summed (one source here), then the rule on each row.
        const auto s0 = Clock::now();
        aggregator.sum(dim, {{distinct.data(), static_cast<int64_t>(distinct.size()), summed}}, 1.0f);
        const auto s1 = Clock::now();
        shard->rule().begin_step();
        shard->apply(aggregator.rows(), aggregator.size(), aggregator.sums());
        applying += seconds_since(s1);
        summing += std::chrono::duration<double>(s1 - s0).count();
        deduplicating += std::chrono::duration<double>(s0 - c0).count();
      }
      step.push_back(seconds_since(t0));
      client.push_back(deduplicating);
      server_sum.push_back(summing);
      apply.push_back(applying);
    }
    // Beyond the table's rows: the raw gradients (push, client) and the summed rows (push, apply).
    record("push", dist, rule, rows, dim, slots, unique, step, o.rounds, raw_rows_bytes + distinct_rows_bytes);
    record("  push: client", dist, rule, rows, dim, 0, unique, client, o.rounds, raw_rows_bytes);
    record("  push: sum", dist, rule, rows, dim, 0, unique, server_sum, o.rounds);
    record("  push: apply", dist, rule, rows, dim, slots, unique, apply, o.rounds, distinct_rows_bytes);
  }
}

DynamicSpec dynamic_spec(int64_t capacity) {
  DynamicSpec d;
  d.on = true;
  d.capacity = capacity;
  d.evict = "lru";
  d.seed = 1;
  d.init = "normal";
  d.init_a = 0.0;
  d.init_b = 0.01;
  return d;
}

// A dynamic shard holding `rows` raw ids (splitmix64 of 0 .. rows-1); requests look up the raw
// ids of the same Zipf / uniform row numbers, so every id is stored (no row is created).
void bench_dynamic(const Options& o, int64_t rows, int64_t dim, const std::string& dist) {
  DynamicStore store("bench", dynamic_spec(rows), rows, dim);
  auto arena = std::make_unique<Shard>("bench", store.arena_rows(), dim, make_update_rule("sgd", {{"lr", 0.01}}));
  std::vector<int64_t> fill;
  std::vector<float> zeros(static_cast<size_t>(100'000 * dim), 0.0f);
  for (int64_t i = 0; i < rows; ++i) {
    fill.push_back(static_cast<int64_t>(mix64(static_cast<uint64_t>(i))));
    if (static_cast<int64_t>(fill.size()) == 100'000 || i == rows - 1) {
      store.step(arena, fill.data(), static_cast<int64_t>(fill.size()), zeros.data());
      fill.clear();
    }
  }
  if (store.stored() != rows) {
    std::fprintf(stderr, "dynamic shard holds %lld rows, expected %lld\n", static_cast<long long>(store.stored()),
                 static_cast<long long>(rows));
    std::exit(1);
  }
  // Set 0: the lookup; 1: the pull. The ids are the raw ids of the drawn rows.
  Requests requests = draw_requests(o, dist, rows, 2000 + static_cast<uint64_t>(rows), 2);
  const double unique = requests.mean_unique;
  for (auto& u : requests.unique) {
    for (auto& id : u) id = static_cast<int64_t>(mix64(static_cast<uint64_t>(id)));
  }
  IdMap map;  // the same ids in a map of its own: find_many is the lookup read() does first
  map.reserve(rows);
  for (int64_t i = 0; i < rows; ++i) map.insert(static_cast<int64_t>(mix64(static_cast<uint64_t>(i))));
  std::vector<float> out(static_cast<size_t>(o.batch * dim));
  std::vector<int64_t> positions(static_cast<size_t>(o.batch));
  std::vector<double> lookup, read;
  for (int r = 0; r < o.repeats; ++r) {
    auto t0 = Clock::now();
    for (auto [q, end] = requests.pass(0, r); q < end; ++q) {
      const auto& u = requests.unique[q];
      map.find_many(u.data(), static_cast<int64_t>(u.size()), positions.data());
    }
    lookup.push_back(seconds_since(t0));
    t0 = Clock::now();
    for (auto [q, end] = requests.pass(1, r); q < end; ++q) {
      const auto& u = requests.unique[q];
      store.read(*arena, u.data(), static_cast<int64_t>(u.size()), out.data(), -1);
    }
    read.push_back(seconds_since(t0));
  }
  record("dyn lookup", dist, "", rows, dim, 0, unique, lookup, o.rounds);
  const double out_bytes = unique * static_cast<double>(dim) * sizeof(float);  // the rows read out
  record("dyn pull", dist, "", rows, dim, 0, unique, read, o.rounds, out_bytes);
}

void write_json(const Options& o, int cpu, const Stream& s) {
  std::ofstream out(o.json);
  if (!out) {
    std::fprintf(stderr, "cannot write %s\n", o.json.c_str());
    std::exit(1);
  }
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  out << "{\n  \"cpu\": " << cpu << ",\n  \"host\": \"" << host << "\",\n  \"thp\": \""
      << read_line("/sys/kernel/mm/transparent_hugepage/enabled") << "\",\n  \"llc_bytes\": " << last_level_cache_bytes()
      << ",\n  \"batch\": " << o.batch << ",\n  \"rounds\": " << o.rounds << ",\n  \"repeats\": " << o.repeats
      << ",\n  \"zipf\": " << o.zipf << ",\n  \"stream\": {\"array_bytes\": " << s.array_bytes
      << ", \"copy_gbps\": " << s.copy_gbps << ", \"triad_gbps\": " << s.triad_gbps
      << ", \"copy_best_gbps\": " << s.copy_best << ", \"triad_best_gbps\": " << s.triad_best << "},\n  \"kernels\": [";
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    out << (i ? ",\n" : "\n") << "    {\"kernel\": \"" << r.kernel.substr(r.kernel.find_first_not_of(' ')) << "\", \"dist\": \""
        << r.dist << "\", \"rule\": \"" << r.rule << "\", \"rows\": " << r.rows << ", \"dim\": " << r.dim
        << ", \"slots\": " << r.slots << ", \"unique_per_request\": " << r.unique_per_request
        << ", \"us_per_request\": " << r.seconds_per_request * 1e6 << ", \"row_gbps\": " << r.row_gbps
        << ", \"row_slot_gbps\": " << r.row_slot_gbps << ", \"all_gbps\": " << r.all_gbps
        << ", \"ns_per_row\": " << r.ns_per_row << "}";
  }
  out << "\n  ]\n}\n";
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const int cpu = pin(o.cpu);
  std::printf("pinned to CPU %d; last-level cache %lld KiB; THP: %s\n", cpu,
              static_cast<long long>(last_level_cache_bytes() >> 10),
              read_line("/sys/kernel/mm/transparent_hugepage/enabled").c_str());
  const Stream s = o.only.empty() ? stream(o) : Stream{};
  if (o.only.empty()) {
    std::printf("STREAM (%lld MiB arrays): copy %.2f GB/s (best %.2f), triad %.2f GB/s (best %.2f)\n",
                static_cast<long long>(s.array_bytes >> 20), s.copy_gbps, s.copy_best, s.triad_gbps, s.triad_best);
  }
  std::printf("requests of %lld ids, %lld per pass, median of %d passes\n", static_cast<long long>(o.batch),
              static_cast<long long>(o.rounds), o.repeats);
  std::printf("  %-15s %-8s %-8s %16s %10s %10s %9s %9s %9s %9s\n", "kernel", "ids", "rule", "table", "rows/req",
              "us/req", "row GB/s", "+slots", "all GB/s", "ns/row");
  for (const auto& [rows, dim] : o.tables) {
    for (const std::string& dist : o.dists) {
      if (o.only != "dyn") bench_fixed(o, rows, dim, dist);
      if (o.dynamic) bench_dynamic(o, rows, dim, dist);
    }
  }
  if (!o.json.empty()) write_json(o, cpu, s);
  return 0;
}
