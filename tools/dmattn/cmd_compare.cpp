#include <cstdio>

#include "commands.hpp"
#include "dmattn/error.hpp"
#include "dmattn/metrics.hpp"
#include "dmattn/npy.hpp"

namespace dmattn::cli {

void add_compare(CLI::App& app) {
  auto files = std::make_shared<std::vector<std::string>>();
  CLI::App* cmd = app.add_subcommand("compare", "compare A.npy against reference B.npy (rel. L2, max abs, cosine, NaN/Inf counts)");
  cmd->add_option("files", *files, "A.npy B.npy")->required()->expected(2);
  cmd->callback([files] {
    const NpyArray a = read_npy((*files)[0]), b = read_npy((*files)[1]);
    if (a.shape != b.shape) throw Error("shapes differ: " + (*files)[0] + " vs " + (*files)[1]);
    const Comparison c = compare(npy_to_floats(a), npy_to_floats(b));
    std::printf("rel_l2   %.6e\nmax_abs  %.6e\ncosine   %.9f\nnonfinite %lld (A) %lld (reference)\n", c.rel_l2,
                c.max_abs, c.cosine, static_cast<long long>(c.nan_count), static_cast<long long>(c.ref_nonfinite));
  });
}

}  // namespace dmattn::cli
