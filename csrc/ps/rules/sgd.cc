// Plain SGD: row -= lr * grad.
#include "hparams.h"
#include "registry.h"
#include "row_loop.h"

namespace hybridsync {
namespace {

// One row's update: apply() and apply_rows() both run it, so they give the same floats.
inline void sgd_row(float* __restrict row, const float* __restrict grad, int64_t dim, float lr) {
  for (int64_t j = 0; j < dim; ++j) row[j] -= lr * grad[j];
}

HYBRIDSYNC_CLONED void sgd_rows(const RowBatch& batch, float lr) {
  for_each_row(batch, [&](float* row, int64_t, const float* grad, int64_t dim) __attribute__((always_inline)) {
    sgd_row(row, grad, dim, lr);
  });
}

class SGDRule : public UpdateRule {
 public:
  explicit SGDRule(const std::map<std::string, double>& given)
      : UpdateRule(resolve_hparams("sgd", given, {{"lr", 0.01}})) {
    validate();
  }
  std::string name() const override { return "sgd"; }
  std::vector<std::string> slot_names() const override { return {}; }
  void validate() const override { require_positive("sgd", "lr", hp_.at("lr"), /*allow_zero=*/true); }
  void begin_step() override {
    UpdateRule::begin_step();
    lr_ = static_cast<float>(hp_.at("lr"));
  }
  void apply(float* row, float* const*, const float* grad, int64_t dim) const override {
    sgd_row(row, grad, dim, lr_);
  }
  void apply_rows(const RowBatch& batch) const override { sgd_rows(batch, lr_); }

 private:
  float lr_ = 0.0f;
};

// Registered by name, so the Client and the bindings find it without a list to edit.
const UpdateRuleRegistrar kRegistered("sgd", [](const std::map<std::string, double>& hparams) {
  return std::unique_ptr<UpdateRule>(std::make_unique<SGDRule>(hparams));
});

}  // namespace
}  // namespace hybridsync
