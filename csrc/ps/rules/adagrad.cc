// Adagrad as torch.optim.Adagrad applies it to a sparse gradient:
//   clr = lr / (1 + (step - 1) * lr_decay);  acc += g^2;  row -= clr * g / (sqrt(acc) + eps)
// With eps_in_sqrt = 1, Keras's form: row -= clr * g / sqrt(acc + eps).
#include <cmath>

#include "hparams.h"
#include "registry.h"
#include "row_loop.h"

namespace hybridsync {
namespace {

// One row's update: apply() and apply_rows() both run it, so they give the same floats.
inline void adagrad_row(float* __restrict row, float* __restrict acc, const float* __restrict grad, int64_t dim,
                        float clr, float eps, bool eps_in_sqrt) {
  if (eps_in_sqrt) {
    for (int64_t j = 0; j < dim; ++j) {
      acc[j] += grad[j] * grad[j];
      row[j] -= clr * grad[j] / std::sqrt(acc[j] + eps);
    }
    return;
  }
  for (int64_t j = 0; j < dim; ++j) {
    acc[j] += grad[j] * grad[j];
    row[j] -= clr * (grad[j] / (std::sqrt(acc[j]) + eps));
  }
}

HYBRIDSYNC_CLONED void adagrad_rows(const RowBatch& batch, float clr, float eps, bool eps_in_sqrt) {
  float* const acc = batch.slots[0];
  if (eps_in_sqrt) {  // (decided once per batch: each loop inlines one form)
    for_each_row(batch, [&](float* row, int64_t at, const float* grad, int64_t dim) __attribute__((always_inline)) {
      adagrad_row(row, acc + at, grad, dim, clr, eps, true);
    });
  } else {
    for_each_row(batch, [&](float* row, int64_t at, const float* grad, int64_t dim) __attribute__((always_inline)) {
      adagrad_row(row, acc + at, grad, dim, clr, eps, false);
    });
  }
}

class AdagradRule : public UpdateRule {
 public:
  explicit AdagradRule(const std::map<std::string, double>& given)
      : UpdateRule(resolve_hparams("adagrad", given,
                                   {{"lr", 0.01}, {"lr_decay", 0.0}, {"initial_accumulator_value", 0.0}, {"eps", 1e-10},
                                    {"eps_in_sqrt", 0.0}})) {
    validate();
  }
  std::string name() const override { return "adagrad"; }
  std::vector<std::string> slot_names() const override { return {"sum"}; }
  float slot_init(int) const override { return static_cast<float>(hp_.at("initial_accumulator_value")); }
  std::vector<int> accumulating_slots() const override { return {0}; }  // "sum": every squared gradient
  void validate() const override {
    for (const char* key : {"lr", "lr_decay", "initial_accumulator_value", "eps"}) {
      require_positive("adagrad", key, hp_.at(key), /*allow_zero=*/true);
    }
    if (hp_.at("eps_in_sqrt") != 0.0 && hp_.at("eps_in_sqrt") != 1.0) {
      throw PSError("server optimizer 'adagrad': eps_in_sqrt must be 0 (torch) or 1 (Keras), got " +
                    std::to_string(hp_.at("eps_in_sqrt")));
    }
  }
  void begin_step() override {
    UpdateRule::begin_step();
    clr_ = static_cast<float>(hp_.at("lr") / (1.0 + static_cast<double>(step_ - 1) * hp_.at("lr_decay")));
    eps_ = static_cast<float>(hp_.at("eps"));
    eps_in_sqrt_ = hp_.at("eps_in_sqrt") != 0.0;
  }
  void apply(float* row, float* const* slots, const float* grad, int64_t dim) const override {
    adagrad_row(row, slots[0], grad, dim, clr_, eps_, eps_in_sqrt_);
  }
  void apply_rows(const RowBatch& batch) const override { adagrad_rows(batch, clr_, eps_, eps_in_sqrt_); }

 private:
  float clr_ = 0.0f, eps_ = 0.0f;
  bool eps_in_sqrt_ = false;
};

// Registered by name, so the Client and the bindings find it without a list to edit.
const UpdateRuleRegistrar kRegistered("adagrad", [](const std::map<std::string, double>& hparams) {
  return std::unique_ptr<UpdateRule>(std::make_unique<AdagradRule>(hparams));
});

}  // namespace
}  // namespace hybridsync
