// Lazy Adam, as torch.optim.SparseAdam: only rows with a gradient this step move, and the
// bias correction uses the table's step count.
//   m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g^2
//   row -= lr * sqrt(1-b2^t) / (1-b1^t) * m / (sqrt(v) + eps)
#include <cmath>

#include "hparams.h"
#include "rules.h"

namespace hybridsync {
namespace {

class AdamRule : public UpdateRule {
 public:
  explicit AdamRule(const std::map<std::string, double>& given)
      : hp_(resolve_hparams("adam", given,
                            {{"lr", 0.001}, {"beta1", 0.9}, {"beta2", 0.999}, {"eps", 1e-8}})) {
    require_positive("adam", "lr", hp_["lr"], /*allow_zero=*/true);
    require_positive("adam", "eps", hp_["eps"], /*allow_zero=*/true);
    for (const char* beta : {"beta1", "beta2"}) {
      if (!(hp_[beta] >= 0.0 && hp_[beta] < 1.0)) {
        throw PSError(std::string("server optimizer 'adam': ") + beta + " must be in [0, 1), got " +
                      std::to_string(hp_[beta]));
      }
    }
  }
  std::string name() const override { return "adam"; }
  std::vector<std::string> slot_names() const override { return {"exp_avg", "exp_avg_sq"}; }
  void apply(float* row, float* const* slots, const float* grad, int64_t dim) const override {
    const double b1 = hp_.at("beta1"), b2 = hp_.at("beta2");
    const double t = static_cast<double>(step_);
    const float step_size =
        static_cast<float>(hp_.at("lr") * std::sqrt(1.0 - std::pow(b2, t)) / (1.0 - std::pow(b1, t)));
    const float fb1 = static_cast<float>(b1), fb2 = static_cast<float>(b2);
    const float eps = static_cast<float>(hp_.at("eps"));
    float* m = slots[0];
    float* v = slots[1];
    for (int64_t j = 0; j < dim; ++j) {
      m[j] += (grad[j] - m[j]) * (1.0f - fb1);
      v[j] += (grad[j] * grad[j] - v[j]) * (1.0f - fb2);
      row[j] -= step_size * (m[j] / (std::sqrt(v[j]) + eps));
    }
  }
  std::map<std::string, double> hyperparameters() const override { return hp_; }

 private:
  std::map<std::string, double> hp_;
};

}  // namespace

std::unique_ptr<UpdateRule> make_adam(const std::map<std::string, double>& hparams) {
  return std::make_unique<AdamRule>(hparams);
}

}  // namespace hybridsync
