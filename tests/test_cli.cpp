// End-to-end runs of the `dmattn` binary, good input and bad.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "dmattn/metrics.hpp"
#include "dmattn/npy.hpp"
#include "dmattn/quantize.hpp"
#include "dmattn/synthetic.hpp"

using namespace dmattn;
namespace fs = std::filesystem;

namespace {

struct Proc {
  int code;
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

class Cli : public ::testing::Test {
 protected:
  fs::path dir;
  void SetUp() override {
    dir = fs::temp_directory_path() / ("dmattn_cli_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  std::string p(const std::string& name) const { return (dir / name).string(); }
  Proc run(const std::string& args) const {
    const std::string cmd = std::string(DMATTN_CLI_PATH) + " " + args + " >" + p("stdout") + " 2>" + p("stderr");
    const int status = std::system(cmd.c_str());
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(dir / "stdout"), slurp(dir / "stderr")};
  }
  void save(const HostTensor& t, const std::string& name) const {
    const Shape& s = t.shape();
    const std::vector<float> f = t.to_floats();
    write_npy(p(name), NpyType::f32, {s[0], s[1], s[2], s[3]}, f.data());
  }
  void save_qkv(const QKV& x) const {
    save(x.q, "q.npy");
    save(x.k, "k.npy");
    save(x.v, "v.npy");
  }
  // A failing run: non-zero exit and one clear line on stderr.
  void expect_error(const std::string& args, const std::string& needle) const {
    const Proc r = run(args);
    EXPECT_NE(r.code, 0) << args;
    EXPECT_NE(r.err.find(needle), std::string::npos) << args << "\nstderr: " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_EQ(r.err.find("internal error"), std::string::npos) << r.err;
  }
};

const char* kQKV = "run --q {d}/q.npy --k {d}/k.npy --v {d}/v.npy --out {d}/o.npy";

std::string fill(std::string s, const fs::path& dir) {
  for (size_t i; (i = s.find("{d}")) != std::string::npos;) s.replace(i, 3, dir.string());
  return s;
}

}  // namespace

TEST_F(Cli, HelpOnEverySubcommand) {
  for (const char* sub : {"", "run", "decode", "quantize", "dequantize", "compare", "demo", "eval", "capture"}) {
    const Proc r = run(std::string(sub) + " --help");
    EXPECT_EQ(r.code, 0) << sub;
    EXPECT_NE(r.out.find("--help"), std::string::npos) << sub;
  }
  EXPECT_NE(run("").code, 0);  // a subcommand is required
}

TEST_F(Cli, ExactRunReproducesFp64Reference) {
  const QKV x = random_qkv({1, 4, 2, 150, 300, 64}, 21);
  save_qkv(x);
  const Proc r = run(fill(kQKV, dir) + " --causal --exact --lse " + p("lse.npy"));
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<float> o = npy_to_floats(read_npy(p("o.npy")));
  // Our own fp64 reference, written here.
  const std::vector<float> q = x.q.to_floats(), k = x.k.to_floats(), v = x.v.to_floats();
  double e2 = 0, r2 = 0;
  for (int64_t h = 0; h < 4; ++h)
    for (int64_t row = 0; row < 150; ++row) {
      const int64_t end = row + 150 + 1, hk = h / 2;
      std::vector<double> s(static_cast<size_t>(end));
      double m = -1e300, l = 0;
      for (int64_t n = 0; n < end; ++n) {
        double dot = 0;
        for (int i = 0; i < 64; ++i) dot += double(q[size_t((h * 150 + row) * 64 + i)]) * k[size_t((hk * 300 + n) * 64 + i)];
        s[size_t(n)] = dot / 8.0;
        m = std::max(m, s[size_t(n)]);
      }
      for (double& e : s) l += (e = std::exp(e - m));
      for (int i = 0; i < 64; ++i) {
        double acc = 0;
        for (int64_t n = 0; n < end; ++n) acc += s[size_t(n)] * v[size_t((hk * 300 + n) * 64 + i)];
        const double ref = acc / l, got = o[size_t((h * 150 + row) * 64 + i)];
        e2 += (got - ref) * (got - ref);
        r2 += ref * ref;
      }
    }
  EXPECT_LE(std::sqrt(e2 / r2), 1e-6);
  EXPECT_EQ(read_npy(p("lse.npy")).shape, (std::vector<int64_t>{1, 4, 150}));
}

TEST_F(Cli, DmaRunAndCompare) {
  const QKV x = random_qkv({1, 2, 1, 256, 256, 128}, 22);
  save_qkv(x);
  ASSERT_EQ(run(fill(kQKV, dir) + " --causal --exact").code, 0);
  fs::rename(p("o.npy"), p("exact.npy"));
  const Proc r = run(fill(kQKV, dir) + " --causal --high mxfp8-e5m2 --low nvfp4 --diag-tiles 2 --sink-tiles 1 --pv mxfp8 --scale-rule ceil --backend cpu --threads 1");
  ASSERT_EQ(r.code, 0) << r.err;
  const Proc c = run("compare " + p("o.npy") + " " + p("exact.npy"));
  ASSERT_EQ(c.code, 0) << c.err;
  double rel = -1;
  ASSERT_EQ(std::sscanf(c.out.c_str(), "rel_l2 %lf", &rel), 1) << c.out;
  EXPECT_GT(rel, 1e-4);
  EXPECT_LT(rel, 0.2);
  EXPECT_NE(c.out.find("nonfinite 0 (A) 0 (reference)"), std::string::npos);
  // pv=fp8 through the CLI: the run's line names it, the result stays close to exact; decode refuses it.
  const Proc f = run(fill(kQKV, dir) + " --causal --pv fp8 --backend cpu");
  ASSERT_EQ(f.code, 0) << f.err;
  EXPECT_NE(f.err.find("pv=fp8"), std::string::npos) << f.err;
  const Proc cf = run("compare " + p("o.npy") + " " + p("exact.npy"));
  ASSERT_EQ(std::sscanf(cf.out.c_str(), "rel_l2 %lf", &rel), 1) << cf.out;
  EXPECT_LT(rel, 0.2);
  expect_error(fill(kQKV, dir).replace(0, 3, "decode") + " --pv fp8", "pv=fp8");
}

TEST_F(Cli, QuantizeDequantizeRoundTrip) {
  Rng rng(23);
  std::vector<float> x(6 * 64);
  for (float& f : x) f = float(rng.normal());
  write_npy(p("x.npy"), NpyType::f32, {2, 3, 64}, x.data());
  for (const char* fmt : {"mxfp4", "mxfp8-e4m3", "mxfp6-e2m3", "nvfp4"}) {
    const std::string files = " --codes " + p("c.npy") + " --scales " + p("s.npy") + " --tensor-scale " + p("t.npy");
    ASSERT_EQ(run(std::string("quantize --format ") + fmt + " --in " + p("x.npy") + files).code, 0) << fmt;
    const Proc r = run(std::string("dequantize --format ") + fmt + files + " --out " + p("y.npy"));
    ASSERT_EQ(r.code, 0) << r.err;
    const NpyArray y = read_npy(p("y.npy"));
    EXPECT_EQ(y.shape, (std::vector<int64_t>{2, 3, 64}));
    const Quantized q = quantize(x.data(), 6, 64, parse_format(fmt), ScaleRule::ocp);
    EXPECT_EQ(npy_to_floats(y), dequantize(q)) << fmt;
  }
  EXPECT_EQ(read_npy(p("c.npy")).shape, (std::vector<int64_t>{2, 3, 32}));  // nvfp4: packed E2M1
  EXPECT_EQ(read_npy(p("s.npy")).shape, (std::vector<int64_t>{2, 3, 4}));   // 16-blocks
}

TEST_F(Cli, BadInputGivesOneLineError) {
  const QKV x = random_qkv({1, 3, 2, 8, 8, 64}, 24);  // 3 query heads over 2 KV heads
  save_qkv(x);
  expect_error(fill(kQKV, dir), "not a multiple");
  expect_error(fill("run --q {d}/missing.npy --k {d}/k.npy --v {d}/v.npy --out {d}/o.npy", dir), "cannot open");
  std::ofstream(p("junk.npy")) << "definitely not numpy";
  expect_error(fill("run --q {d}/junk.npy --k {d}/k.npy --v {d}/v.npy --out {d}/o.npy", dir), "bad magic");
  const std::vector<uint8_t> u(64 * 8, 1);
  write_npy(p("u8.npy"), NpyType::u8, {1, 1, 8, 64}, u.data());
  expect_error(fill("run --q {d}/u8.npy --k {d}/k.npy --v {d}/v.npy --out {d}/o.npy", dir), "uint8");
  std::vector<float> f(8 * 64, 0.5f);
  write_npy(p("3d.npy"), NpyType::f32, {1, 8, 64}, f.data());
  expect_error(fill("run --q {d}/3d.npy --k {d}/k.npy --v {d}/v.npy --out {d}/o.npy", dir), "4 dimensions");
  const QKV d48 = random_qkv({1, 1, 1, 8, 8, 48}, 25);
  save_qkv(d48);
  expect_error(fill(kQKV, dir), "head dim 48");
  QKV good = random_qkv({1, 2, 1, 8, 8, 64}, 26);
  std::vector<float> q = good.q.to_floats();
  q[100] = std::nanf("");
  good.q = HostTensor::from_floats(q, good.q.shape());
  save_qkv(good);
  expect_error(fill(kQKV, dir), "non-finite");
  save_qkv(random_qkv({1, 2, 1, 8, 8, 64}, 27));
  expect_error(fill(kQKV, dir) + " --high mxfp3", "unknown format 'mxfp3'");
  expect_error(fill(kQKV, dir) + " --pv fp32", "unknown pv mode");
  expect_error(fill(kQKV, dir) + " --scale-rule floor", "unknown scale rule");
  expect_error(fill(kQKV, dir) + " --diag-tiles -2", "must be >= 0");
  ASSERT_EQ(run(fill(kQKV, dir)).code, 0);  // and the same files, unbroken, run
}

// `decode` through the KV cache computes what `run --causal` computes on the same files: bit for bit
// on the CPU with one split (two sequences, GQA, 3 new queries, a policy with sinks and pv = mxfp8).
TEST_F(Cli, DecodeEqualsCausalRun) {
  const QKV x = random_qkv({2, 4, 2, 3, 300, 64}, 28);
  save_qkv(x);
  const std::string pol = " --backend cpu --diag-tiles 1 --sink-tiles 1 --pv mxfp8";
  ASSERT_EQ(run(fill(std::string(kQKV) + " --causal --lse {d}/lse_run.npy", dir) + pol).code, 0);
  fs::rename(p("o.npy"), p("o_run.npy"));
  const Proc r = run(fill("decode --q {d}/q.npy --k {d}/k.npy --v {d}/v.npy --out {d}/o.npy --lse {d}/lse.npy", dir) + pol);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("MB a sequence"), std::string::npos) << r.err;
  const std::vector<float> a = npy_to_floats(read_npy(p("o.npy"))), b = npy_to_floats(read_npy(p("o_run.npy")));
  ASSERT_EQ(a.size(), size_t(2 * 4 * 3 * 64));
  EXPECT_EQ(a, b);
  EXPECT_EQ(npy_to_floats(read_npy(p("lse.npy"))), npy_to_floats(read_npy(p("lse_run.npy"))));
  // Split-KV merges by LSE: close, not equal (pv = mxfp8 quantizes each split's P against that
  // split's running maximum; with 300 keys in 2 splits that moves the output by ~2e-2 here).
  ASSERT_EQ(run(fill("decode --q {d}/q.npy --k {d}/k.npy --v {d}/v.npy --out {d}/o.npy --splits 2", dir) + pol).code, 0);
  const Comparison c = compare(npy_to_floats(read_npy(p("o.npy"))), b);
  EXPECT_GT(c.rel_l2, 0.0);
  EXPECT_LT(c.rel_l2, 5e-2);
  EXPECT_EQ(c.nan_count, 0);

  const QKV many = random_qkv({2, 4, 2, 17, 300, 64}, 29);  // 17 new queries: more than decode takes
  save(many.q, "q17.npy");
  expect_error(fill("decode --q {d}/q17.npy --k {d}/k.npy --v {d}/v.npy --out {d}/o.npy", dir), "1 to 16 new queries");
  expect_error(fill("decode --q {d}/q.npy --k {d}/k.npy --v {d}/q.npy --out {d}/o.npy", dir), "same shape");
  expect_error(fill("decode --q {d}/q.npy --k {d}/k.npy --v {d}/v.npy --out {d}/o.npy --pv fp8", dir), "pv=fp8");
  // The accuracy transforms through the cache: still the causal run's result, bit for bit.
  const std::string tf = " --backend cpu --diag-tiles 2 --rotate --smooth-k --sink-keys 2";
  ASSERT_EQ(run(fill(std::string(kQKV) + " --causal", dir) + tf).code, 0);
  const std::vector<float> want = npy_to_floats(read_npy(p("o.npy")));
  ASSERT_EQ(run(fill("decode --q {d}/q.npy --k {d}/k.npy --v {d}/v.npy --out {d}/o.npy", dir) + tf).code, 0);
  EXPECT_EQ(npy_to_floats(read_npy(p("o.npy"))), want);
  expect_error(fill("decode --q {d}/q.npy --k {d}/k.npy --v {d}/v.npy --out {d}/o.npy --low nvfp4", dir), "MX 32-block");
  // A sliding window: decode still equals the causal run with the same window, bit for bit, and the
  // window changes the result.
  ASSERT_EQ(run(fill(std::string(kQKV) + " --causal --window 100,-1", dir) + pol).code, 0);
  const std::vector<float> windowed = npy_to_floats(read_npy(p("o.npy")));
  EXPECT_NE(windowed, b);
  ASSERT_EQ(run(fill("decode --q {d}/q.npy --k {d}/k.npy --v {d}/v.npy --out {d}/o.npy --window 100,-1", dir) + pol).code, 0);
  EXPECT_EQ(npy_to_floats(read_npy(p("o.npy"))), windowed);
}

TEST_F(Cli, DemoPrintsTableWithDmaBetweenFormats) {
  const Proc r = run("demo --synthetic --n 1024 --heads 2 --kv-heads 1");
  ASSERT_EQ(r.code, 0) << r.err;
  auto err_of = [&](const std::string& name) {
    const size_t at = r.out.find("\n" + name + " ");
    EXPECT_NE(at, std::string::npos) << name;
    double e = -1;
    std::sscanf(r.out.c_str() + at + name.size() + 1, "%lf", &e);
    return e;
  };
  const double e8 = err_of("mxfp8"), e4 = err_of("mxfp4"), dma = err_of("diag1");
  EXPECT_GT(dma, e8);
  EXPECT_LT(dma, e4);
  EXPECT_LT(err_of("diag4-sink1"), e4);
  EXPECT_GE(err_of("default"), 0.0);
}

// One output path for two outputs, or an output that cannot be written, fails before any work:
// nothing is written and the exit code is 1.
TEST_F(Cli, OutputPathsAreCheckedFirst) {
  save_qkv(random_qkv({1, 2, 1, 8, 8, 64}, 30));
  const Proc same = run(fill(kQKV, dir) + fill(" --lse {d}/o.npy", dir));
  EXPECT_EQ(same.code, 1);
  EXPECT_NE(same.err.find("same file"), std::string::npos) << same.err;
  EXPECT_FALSE(fs::exists(p("o.npy")));
  const Proc bad = run(fill(kQKV, dir) + fill(" --lse {d}/no/such/dir/lse.npy", dir));
  EXPECT_EQ(bad.code, 1);
  EXPECT_NE(bad.err.find("no such directory"), std::string::npos) << bad.err;
  EXPECT_FALSE(fs::exists(p("o.npy")));  // --out is not written when --lse cannot be
  expect_error(fill("quantize --in {d}/q.npy --codes {d}/c.npy --scales {d}/c.npy", dir), "same file");
  expect_error(fill("decode --q {d}/q.npy --k {d}/k.npy --v {d}/v.npy --out {d}/x.npy --lse {d}/x.npy", dir), "same file");
  ASSERT_EQ(run(fill(kQKV, dir) + fill(" --lse {d}/lse.npy", dir)).code, 0);
}

TEST_F(Cli, CompareReportsNonFiniteAndZeroReferencesHonestly) {
  const std::vector<float> ref{1, 2, 3, 4}, nan_a{1, std::nanf(""), 3, 4}, zero{0, 0, 0, 0};
  write_npy(p("ref.npy"), NpyType::f32, {4}, ref.data());
  write_npy(p("nan.npy"), NpyType::f32, {4}, nan_a.data());
  write_npy(p("zero.npy"), NpyType::f32, {4}, zero.data());
  const Proc n = run(fill("compare {d}/nan.npy {d}/ref.npy", dir));
  ASSERT_EQ(n.code, 0) << n.err;
  EXPECT_NE(n.out.find("rel_l2   nan"), std::string::npos) << n.out;
  EXPECT_NE(n.out.find("max_abs  nan"), std::string::npos) << n.out;
  EXPECT_NE(n.out.find("cosine   nan"), std::string::npos) << n.out;
  EXPECT_NE(n.out.find("nonfinite 1 (A) 0 (reference)"), std::string::npos) << n.out;
  const Proc z = run(fill("compare {d}/ref.npy {d}/zero.npy", dir));
  EXPECT_NE(z.out.find("rel_l2   inf"), std::string::npos) << z.out;
  EXPECT_NE(z.out.find("cosine   nan"), std::string::npos) << z.out;
  const Proc zz = run(fill("compare {d}/zero.npy {d}/zero.npy", dir));
  EXPECT_NE(zz.out.find("rel_l2   0.0"), std::string::npos) << zz.out;
}

// The README's "Supported" table is `dmattn capabilities`' output, the table every backend's checks read.
TEST_F(Cli, ReadmeStatesTheCapabilitiesTable) {
  const Proc r = run("capabilities");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("| tile formats |"), std::string::npos) << r.out;
  std::ifstream f(fs::path(DMATTN_SOURCE_DIR) / "README.md");
  const std::string readme((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_NE(readme.find(r.out), std::string::npos) << "README.md's Supported table differs from `dmattn capabilities`:\n" << r.out;
}

TEST_F(Cli, BadCommandLinesExitOne) {
  for (const char* args : {"run --q x.npy", "demo --synthetic --d 0", "demo --synthetic --d -64", "demo --threads -1",
                           "demo --threads 100000", "eval --windows -5", "run --no-such-flag", "quantize --format",
                           "run --window -5,0", "decode --window 3"}) {
    const Proc r = run(args);
    EXPECT_EQ(r.code, 1) << args << "\n" << r.err;
    EXPECT_EQ(r.err.find("internal error"), std::string::npos) << r.err;
  }
  const Proc v = run("--version");
  EXPECT_EQ(v.code, 0);
  EXPECT_EQ(v.out.rfind("dmattn ", 0), 0u) << v.out;
  save_qkv(random_qkv({1, 2, 1, 8, 8, 64}, 31));
  expect_error(fill(kQKV, dir) + " --exact --diag-tiles 2", "no policy flags");
  expect_error("demo --model no-such-model.gguf", "no such file");
  expect_error("demo --synthetic --layer 3", "do not apply");
  expect_error("eval --only no-such-config", "no config named 'no-such-config'");
  expect_error(fill("eval --csv {d}/no/such/dir/e.csv", dir), "no such directory");
}

TEST_F(Cli, QuantizeSaysWhatItWrote) {
  const std::vector<float> x(2 * 64, 0.75f);
  write_npy(p("x.npy"), NpyType::f32, {2, 64}, x.data());
  const Proc r = run(fill("quantize --in {d}/x.npy --codes {d}/c.npy --scales {d}/s.npy --format mxfp8", dir));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("2 rows x 64 values in mxfp8-e4m3"), std::string::npos) << r.out;
  expect_error(fill("quantize --in {d}/x.npy --codes {d}/c.npy --scales {d}/s.npy --format bf16", dir), "no codes");
  const Proc h = run("quantize --help");
  EXPECT_EQ(h.out.find("bf16"), std::string::npos) << h.out;
}

// The default model is found from any working directory (it sits beside the build tree), so the
// demo runs on real activations there too, not silently on generated ones.
TEST_F(Cli, DemoFindsTheModelFromAnyDirectory) {
  if (!fs::exists(fs::path(DMATTN_SOURCE_DIR) / ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    GTEST_SKIP() << "the model is not fetched (scripts/fetch_model.sh)";
  const std::string cmd = "cd " + dir.string() + " && " + DMATTN_CLI_PATH + " demo --n 256 --layer 1 >" + p("stdout") +
                          " 2>" + p("stderr");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << slurp(dir / "stderr");
  EXPECT_NE(slurp(dir / "stdout").find("real activations"), std::string::npos) << slurp(dir / "stdout");
}
