// Lazy Adam, as torch.optim.SparseAdam: only rows with a gradient this step move, and the
// bias correction uses the table's step count.
//   m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g^2
//   row -= lr * sqrt(1-b2^t) / (1-b1^t) * m / (sqrt(v) + eps)
#include <cmath>

#include "hparams.h"
#include "registry.h"
#include "row_loop.h"

namespace hybridsync {
namespace {

// One row's update: apply() and apply_rows() both run it, so they give the same floats.
inline void adam_row(float* __restrict row, float* __restrict m, float* __restrict v, const float* __restrict grad,
                     int64_t dim, float step_size, float b1, float b2, float eps) {
  for (int64_t j = 0; j < dim; ++j) {
    m[j] += (grad[j] - m[j]) * (1.0f - b1);
    v[j] += (grad[j] * grad[j] - v[j]) * (1.0f - b2);
    row[j] -= step_size * (m[j] / (std::sqrt(v[j]) + eps));
  }
}

HYBRIDSYNC_CLONED void adam_rows(const RowBatch& batch, float step_size, float b1, float b2, float eps) {
  float* const m = batch.slots[0];
  float* const v = batch.slots[1];
  for_each_row(batch, [&](float* row, int64_t at, const float* grad, int64_t dim) __attribute__((always_inline)) {
    adam_row(row, m + at, v + at, grad, dim, step_size, b1, b2, eps);
  });
}

class AdamRule : public UpdateRule {
 public:
  explicit AdamRule(const std::map<std::string, double>& given)
      : UpdateRule(resolve_hparams("adam", given, {{"lr", 0.001}, {"beta1", 0.9}, {"beta2", 0.999}, {"eps", 1e-8}})) {
    validate();
  }
  std::string name() const override { return "adam"; }
  std::vector<std::string> slot_names() const override { return {"exp_avg", "exp_avg_sq"}; }
  void validate() const override {
    require_positive("adam", "lr", hp_.at("lr"), /*allow_zero=*/true);
    require_positive("adam", "eps", hp_.at("eps"), /*allow_zero=*/true);
    for (const char* beta : {"beta1", "beta2"}) {
      if (!(hp_.at(beta) >= 0.0 && hp_.at(beta) < 1.0)) {
        throw PSError(std::string("server optimizer 'adam': ") + beta + " must be in [0, 1), got " +
                      std::to_string(hp_.at(beta)));
      }
    }
  }
  void begin_step() override {
    UpdateRule::begin_step();
    const double b1 = hp_.at("beta1"), b2 = hp_.at("beta2"), t = static_cast<double>(step_);
    step_size_ = static_cast<float>(hp_.at("lr") * std::sqrt(1.0 - std::pow(b2, t)) / (1.0 - std::pow(b1, t)));
    b1_ = static_cast<float>(b1);
    b2_ = static_cast<float>(b2);
    eps_ = static_cast<float>(hp_.at("eps"));
  }
  void apply(float* row, float* const* slots, const float* grad, int64_t dim) const override {
    adam_row(row, slots[0], slots[1], grad, dim, step_size_, b1_, b2_, eps_);
  }
  void apply_rows(const RowBatch& batch) const override { adam_rows(batch, step_size_, b1_, b2_, eps_); }

 private:
  float step_size_ = 0.0f, b1_ = 0.0f, b2_ = 0.0f, eps_ = 0.0f;
};

// Registered by name, so the Client and the bindings find it without a list to edit.
const UpdateRuleRegistrar kRegistered("adam", [](const std::map<std::string, double>& hparams) {
  return std::unique_ptr<UpdateRule>(std::make_unique<AdamRule>(hparams));
});

}  // namespace
}  // namespace hybridsync
