// Plain SGD: row -= lr * grad.
#include "hparams.h"
#include "rules.h"

namespace hybridsync {
namespace {

class SGDRule : public UpdateRule {
 public:
  explicit SGDRule(const std::map<std::string, double>& given)
      : hp_(resolve_hparams("sgd", given, {{"lr", 0.01}})), lr_(static_cast<float>(hp_["lr"])) {
    require_positive("sgd", "lr", hp_["lr"], /*allow_zero=*/true);
  }
  std::string name() const override { return "sgd"; }
  std::vector<std::string> slot_names() const override { return {}; }
  void apply(float* row, float* const*, const float* grad, int64_t dim) const override {
    for (int64_t j = 0; j < dim; ++j) row[j] -= lr_ * grad[j];
  }
  std::map<std::string, double> hyperparameters() const override { return hp_; }

 private:
  std::map<std::string, double> hp_;
  float lr_;
};

}  // namespace

std::unique_ptr<UpdateRule> make_sgd(const std::map<std::string, double>& hparams) {
  return std::make_unique<SGDRule>(hparams);
}

}  // namespace hybridsync
