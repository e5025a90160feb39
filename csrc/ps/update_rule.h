// Server-side optimizers: an UpdateRule updates one shard's rows from their summed gradients.
// Each rule is one file in rules/ that registers itself by name (rules/registry.h).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "hybridsync/ps.h"

namespace hybridsync {

// A batch of one shard's rows to update: row i is rows + index[i] * row_stride (dim floats),
// its optimizer slot k's values are slots[k] + index[i] * dim, its summed gradient grads + i * dim.
// Rows are distinct.
struct RowBatch {
  const int64_t* index = nullptr;
  int64_t n = 0;
  float* rows = nullptr;
  int64_t row_stride = 0;
  float* const* slots = nullptr;
  int num_slots = 0;
  const float* grads = nullptr;
  int64_t dim = 0;
};

// Per-row state lives in the shard's slots, scalars here. begin_step() runs once per push
// round, so apply() and apply_rows(), the per-row loops, read constants.
class UpdateRule {
 public:
  explicit UpdateRule(std::map<std::string, double> hparams) : hp_(std::move(hparams)) {}
  virtual ~UpdateRule() = default;
  // The registered name (specs and errors show it).
  virtual std::string name() const = 0;
  // Per-row state slots (each `dim` floats), in storage order, and their initial value.
  virtual std::vector<std::string> slot_names() const = 0;
  virtual float slot_init(int) const { return 0.0f; }
  // Slots that sum a quantity over every step since the start (Adagrad's squared gradients), as
  // opposed to moving averages that forget (Adam's moments): the ones a change of batch size
  // rescales (Client::rescale_accumulators). None by default.
  virtual std::vector<int> accumulating_slots() const { return {}; }
  // Advances the step counter and refreshes per-step constants.
  virtual void begin_step() { ++step_; }
  // Updates one row in place from its summed gradient; slots[k] points at slot k's row.
  virtual void apply(float* row, float* const* slots, const float* grad, int64_t dim) const = 0;
  // Updates every row of a batch, each to the same floats apply() gives it. This default calls
  // apply() per row; the built-in rules run one loop of their own (no call per row, their
  // constants in registers), prefetching rows ahead as it goes.
  virtual void apply_rows(const RowBatch& batch) const;
  // Throws PSError naming the first out-of-range hyper-parameter.
  virtual void validate() const = 0;
  const std::map<std::string, double>& hyperparameters() const { return hp_; }
  // Changes one hyper-parameter (e.g. "lr" from a schedule); a bad name or value throws.
  void set_hyperparameter(const std::string& key, double value);
  // Steps taken (bias corrections and decays use it); settable for checkpoint restores.
  int64_t step() const { return step_; }
  void set_step(int64_t step) { step_ = step; }

 protected:
  std::map<std::string, double> hp_;
  int64_t step_ = 0;
};

// The rule registered as `name`; PSError lists the known names.
std::unique_ptr<UpdateRule> make_update_rule(const std::string& name, const std::map<std::string, double>& hparams);

}  // namespace hybridsync
