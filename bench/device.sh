#!/usr/bin/env bash
# The one GPU-machine script: build for sm_90a, run every test (GPU ones included), compute-sanitizer
# on the GPU tests, and print a short table last. Full logs go to $OUT (or ./device-out).
# Run here first: bash scripts/device_deps.sh   (then carry .deps to the device); to skip the device's
# build: bash bench/prebuild.sh build-prebuilt, carry it too, and run PREBUILT=build-prebuilt QUICK=1.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
# Full logs go to a scratch folder packed into $OUT/logs.tgz on exit (the device tool returns at most
# 8 files). QUICK=1 PART=decode|prefill limits the quick mode to one kernel's tests and benchmarks.
RESULT_DIR=$OUT
OUT=$(mktemp -d)
trap 'tar -czf "$RESULT_DIR/logs.tgz" -C "$OUT" .' EXIT
PART=${PART:-all}
export DMATTN_SOURCE_DIR=$PWD  # carried test binaries (PREBUILT, AB) read tests/data from this checkout
if ls .deps/wheels/*.whl >/dev/null 2>&1; then  # carried Python wheels (the SageAttention baseline)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dmattn-site .deps/wheels/*.whl \
    && export PYTHONPATH=/tmp/dmattn-site${PYTHONPATH:+:$PYTHONPATH}
fi
# PREBUILT=dir: binaries built here for sm_90a and carried (dir/dmattn, dir/bench/*, dir/tests/dmattn_gpu_tests),
# which saves the device the ~100 s build; QUICK mode only, and without the Python module's tests.
B=${PREBUILT:-build-sm90}
declare -A row
# The tables of docs/PERFORMANCE.md measured again (PERF_SECTIONS, default all: bench/performance.py) and
# the page rendered; both come back in $RESULT_DIR/perf.tgz (PERF_PYTHON: the module's folder, default $B/python).
measure_performance() {
  # shellcheck disable=SC2086  # PERF_SECTIONS: section names
  PYTHONUNBUFFERED=1 python3 bench/performance.py measure ${PERF_SECTIONS:-} --build $B --python "${PERF_PYTHON:-$B/python}" \
    >"$OUT/performance.log" 2>&1
  echo "performance.py measure ${PERF_SECTIONS:-(all)}: rc=$? $(grep -c 'not kept' "$OUT/performance.log") not kept"
  tar -czf "$RESULT_DIR/perf.tgz" bench/perf docs/PERFORMANCE.md
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

# AB="dirA dirB" (each laid out as PREBUILT): a variant against a baseline in one run. The GPU tests
# matching AB_TESTS of the last dir (or of each dir in AB_TEST_DIRS), then bench_prefill_cuda alternating between the dirs,
# four rounds per N in AB_N, the order reversed every other round (AB_N= none), policy AB_POLICY; medians per dir last. AB_QUANT=1 adds the quantize
# bench, AB_DECODE="pv:B:ctx ..." (e.g. mxfp4:16:32768) bench_decode_cuda the same way, AB_STEP="pv:B:ctx ..." a
# generation's step over the KV cache (bench_decode_cuda step) the same way, AB_FILL="pv:B:ctx ..." the KV
# cache's fill of a B x ctx prompt (bench_decode_cuda fill) the same way, AB_RACE=1 racecheck on
# the last dir (with the grid capped at 2 CTAs where a persistent prefill honours DMATTN_PREFILL_CTAS); AB_TIMEOUT (s) limits the tests.
if [ -n "${AB:-}" ]; then
  # The dirs in round rep's order: as given in odd rounds, reversed in even ones (ABBA), so a drift over the
  # run (clocks, heat) weighs on each dir alike.
  ab_order() { if (($1 % 2)); then echo "$AB"; else echo "$AB" | tr ' ' '\n' | tac | tr '\n' ' '; fi; }
  last=${AB##* }
  trc=0
  for dir in ${AB_TEST_DIRS:-$last}; do
    # A time limit on each step: a variant that hangs (a deadlock) must not spend the whole device call.
    log="$OUT/ab_tests_$(basename "$dir").log"
    timeout "${AB_TIMEOUT:-240}" $dir/tests/dmattn_gpu_tests --gtest_filter="${AB_TESTS:-GpuPrefill*}" >"$log" 2>&1
    rc=$?
    echo "tests ($dir, ${AB_TESTS:-GpuPrefill*}): rc=$rc $(grep -cE '^\[       OK' "$log") passed; $(grep -E '^\[  FAILED' "$log" | head -3)"
    [ $rc -eq 124 ] && { echo "the tests timed out: no timings"; exit $rc; }
    [ $rc -ne 0 ] && trc=$rc
  done
  if [ "${AB_RACE:-0}" = 1 ]; then  # racecheck on a small prefill case, the grid capped so each CTA walks several items
    DMATTN_PREFILL_CTAS=2 timeout "${AB_TIMEOUT:-240}" compute-sanitizer --tool racecheck --error-exitcode 9 $last/tests/dmattn_gpu_tests \
      --gtest_filter=GpuPrefill.MatchesCpuOracleWhereScalesDoNotFold >"$OUT/ab_racecheck.log" 2>&1
    echo "racecheck ($last, 2 CTAs): rc=$? $(grep -m1 SUMMARY "$OUT/ab_racecheck.log")"
  fi
  if [ "${AB_QUANT:-0}" = 1 ]; then  # the quantize pass too: each dir's bench_quantize_cuda, alternating
    for rep in 1 2 3 4; do for dir in $(ab_order $rep); do echo "== $dir"; timeout 60 $dir/bench/bench_quantize_cuda | tail -5; done; done \
      | tee "$OUT/ab_quantize.txt"
  fi
  for spec in ${AB_DECODE:-}; do  # decode: "dir dmattn-pv B ctx us us_sync GB/s bytes" lines
    IFS=: read -r pv b ctx <<<"$spec"
    for rep in 1 2 3 4; do
      for dir in $(ab_order $rep); do echo "$dir $(timeout 120 $dir/bench/bench_decode_cuda "$pv" "$b" "$ctx" | grep '^dmattn-')"; done
    done
  done | tee "$OUT/ab_decode.txt"
  python3 bench/ab_medians.py "$OUT/ab_decode.txt" 4 us 1 2 3  # per (pv, B, ctx) and dir
  for spec in ${AB_STEP:-}; do  # a generation's step: "dir step-pv B ctx append_us decode_us step_us" lines
    IFS=: read -r pv b ctx <<<"$spec"
    for rep in 1 2 3 4; do
      for dir in $(ab_order $rep); do echo "$dir $(timeout 120 $dir/bench/bench_decode_cuda step "$pv" "$b" "$ctx" | grep '^step-')"; done
    done
  done | tee "$OUT/ab_step.txt"
  for c in 4 5 6; do python3 bench/ab_medians.py "$OUT/ab_step.txt" $c us 1 2 3; done  # append, decode, step
  for spec in ${AB_FILL:-}; do  # the fill: "dir fill-pv B ctx ms copy_ms ratio" lines
    IFS=: read -r pv b ctx <<<"$spec"
    for rep in 1 2 3 4; do
      for dir in $(ab_order $rep); do timeout 120 $dir/bench/bench_decode_cuda fill "$pv" "$b" "$ctx" | grep '^fill-' | sed "s|^|$dir |"; done
    done
  done | tee "$OUT/ab_fill.txt"
  python3 bench/ab_medians.py "$OUT/ab_fill.txt" 4 ms 1 2 3
  for n in ${AB_N-4096 16384}; do
    it=$( ((n >= 65536)) && echo 2 || { ((n >= 16384)) && echo 5 || echo 20; })
    for rep in 1 2 3 4; do
      for dir in $(ab_order $rep); do echo "$dir $(timeout 120 $dir/bench/bench_prefill_cuda "$n" 128 "$it" "${AB_POLICY:-DMA-default}")"; done
    done
  done | tee "$OUT/ab.txt"
  python3 bench/ab_medians.py "$OUT/ab.txt" 5 ms 3  # per N and dir
  cp "$OUT/ab.txt" "$OUT/ab_decode.txt" "$OUT/ab_step.txt" "$OUT/ab_fill.txt" "$RESULT_DIR/"
  exit $trc  # the tests' status, so a following run can depend on it
fi

if [ -n "${PREBUILT:-}" ]; then
  row[build]="prebuilt ($B)"
  SKIP_PYTHON=1
else
  cmake -S . -B $B -G Ninja -DDMATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DDMATTN_DEPS="$PWD/.deps" -DPython_EXECUTABLE="$(command -v python3)" \
    >"$OUT/configure.log" 2>&1 && cmake --build $B -j16 >"$OUT/build.log" 2>&1
  row[build]=$([ $? -eq 0 ] && echo ok || echo FAILED)
  grep -A2 "Function properties for .*prefill_kernel" "$OUT/build.log" | grep -E "spill|Used" | sort | uniq -c
  cuobjdump -sass $B/CMakeFiles/dmattn.dir/src/cuda/prefill/kernel.cu.o 2>/dev/null | grep -oE "(HGMMA|QGMMA)\.[A-Za-z0-9.]*" | sort | uniq -c \
    | tee "$OUT/sass_gmma.txt"
fi

[ -n "${PREBUILT:-}" ] && [ "${QUICK:-0}" != 1 ] && { echo "PREBUILT needs QUICK=1"; exit 2; }
if [ "${QUICK:-0}" = 1 ]; then  # correctness of the GPU tests + the main benchmark row, sanitizers on small cases
  filter=$([ "$PART" = decode ] && echo '*Decode*:*Quantize*' || echo '*')
  # One process per test: a crash (or a sticky CUDA error) in one leaves the others' results intact.
  : >"$OUT/gpu_tests.log"
  for t in $($B/tests/dmattn_gpu_tests --gtest_filter="$filter" --gtest_list_tests | awk '/^[^ ]/ {s=$1} /^  / {print s $1}'); do
    $B/tests/dmattn_gpu_tests --gtest_filter="$t" >>"$OUT/gpu_tests.log" 2>&1 || echo "FAILED (rc $?): $t" | tee -a "$OUT/gpu_tests.log"
  done
  grep -E "rel_l2|SKIP" "$OUT/gpu_tests.log" | sort -t: -k2 | tail -8  # the largest deviations
  echo "gpu tests: $(grep -c '^\[       OK \]' "$OUT/gpu_tests.log") passed, $(grep -c '^FAILED (rc' "$OUT/gpu_tests.log") failed"
  if [ "${SKIP_PYTHON:-0}" != 1 ]; then  # SKIP_PYTHON=1 saves ~45 s of device time
    ctest --test-dir $B -R python --output-on-failure >"$OUT/ctest_python.log" 2>&1
    grep -E "tests passed|Test +#|passed|failed" "$OUT/ctest_python.log" | tail -6
  fi
  # Small cases: prefill with both S paths (folded and per block); decode with rows, holes, both pv modes.
  small=$([ "$PART" = decode ] && echo 'GpuDecode.RowChunksAndReusedPages' || echo 'GpuPrefill.MatchesCpuOracleWhereScalesDoNotFold')
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --error-exitcode 9 $B/tests/dmattn_gpu_tests --gtest_filter="$small" \
      >"$OUT/sanitizer_$tool.log" 2>&1
    echo "sanitizer $tool ($small) rc=$? $(grep -m1 SUMMARY "$OUT/sanitizer_$tool.log")"
  done
  if [ "$PART" != decode ]; then
    $B/bench/bench_quantize_cuda 2>&1 | tee "$OUT/bench_quantize.txt" | tail -5
    # The tensor cores' rate per clock for the prefill's wgmma shapes (the kernel's ceiling in cycles).
    [ -x $B/bench/bench_wgmma_cuda ] && $B/bench/bench_wgmma_cuda 2>&1 | tee "$OUT/bench_wgmma.txt" | grep "wgs 2 len  [48]"
    # A model of the consumer loop with no overhead (cycles a 128x128 tile pair; the kernel's floor by structure).
    [ -x $B/bench/bench_chains_cuda ] && $B/bench/bench_chains_cuda 2>&1 | tee "$OUT/bench_chains.txt"
    # shellcheck disable=SC2086  # SDPA_N: the lengths, e.g. "4096 16384"
    [ "${SDPA:-1}" = 1 ] && PYTHONUNBUFFERED=1 python3 bench/compare_sdpa.py $B "$OUT" ${SDPA_N:-16384} 2>&1 \
      | tee "$OUT/compare_sdpa.txt" | tail -24  # SDPA=0 skips it
  fi
  if [ "$PART" != prefill ]; then
    PYTHONUNBUFFERED=1 python3 bench/compare_decode.py $B "$OUT" 2>&1 | tee "$OUT/compare_decode.txt" | tail -30
    if [ "${COLD:-1}" = 1 ]; then  # the same table with L2 evicted before every step (COLD=0 skips it)
      mkdir -p "$OUT/cold"
      DMATTN_BENCH_COLD=1 PYTHONUNBUFFERED=1 python3 bench/compare_decode.py $B "$OUT/cold" 2>&1 \
        | tee "$OUT/compare_decode_cold.txt" | tail -30
    fi
    # Instructions and time of one decode launch (B=16, 32k), per V format.
    for pv in mxfp8 mxfp4; do
      ncu --kernel-name regex:decode_kernel --launch-skip 3 --launch-count 1 \
        --metrics smsp__inst_executed.sum,gpu__time_duration.sum $B/bench/bench_decode_cuda $pv 16 32768 >"$OUT/ncu_inst_${pv}.txt" 2>&1
      echo "decode $pv: $(grep -E 'inst_executed|duration' "$OUT/ncu_inst_${pv}.txt" | awk '{print $1, $(NF-1), $NF}' | tr '\n' ' ')"
    done
  fi
  cp "$OUT"/compare_*.txt "$RESULT_DIR"/ 2>/dev/null
  [ -n "${PERF_SECTIONS:-}" ] && measure_performance  # only the tables asked for
  if [ "${PROFILE:-0}" = 1 ] && [ "$PART" != prefill ]; then  # where the decode kernel's time goes (B=16, 32k)
    ncu --kernel-name regex:decode_kernel --launch-skip 3 --launch-count 1 --section SpeedOfLight --section WarpStateStats \
      --section SchedulerStats --section Occupancy $B/bench/bench_decode_cuda bf16 16 32768 >"$OUT/ncu_decode.txt" 2>&1
    grep -E "Throughput|Duration|Occupancy|Registers|Issued|Eligible|No Eligible|cycles being stalled" "$OUT/ncu_decode.txt" | head -30
    # A small step (B=1, 8k): each kernel's duration, to see fixed costs against the bytes.
    ncu --metrics gpu__time_duration.sum --launch-skip 20 --launch-count 4 $B/bench/bench_decode_cuda bf16 1 8192 \
      >"$OUT/ncu_decode_small.txt" 2>&1
    grep -E "^  [a-z_:<>0-9, ]+\(|gpu__time_duration" "$OUT/ncu_decode_small.txt" | sed -E 's/\(.*//' | paste - - | head -4
  fi
  if [ "${PROFILE:-0}" = 1 ] && [ "$PART" != decode ]; then  # where the prefill kernel's time goes (one launch, N=8192)
    ncu --clock-control none --kernel-name regex:prefill_kernel --launch-skip 1 --launch-count 1 --section SpeedOfLight --section WarpStateStats \
      --section SchedulerStats --section Occupancy $B/bench/bench_prefill_cuda 8192 128 1 ${PROFILE_POLICY:-DMA-default} >"$OUT/ncu_prefill.txt" 2>&1
    grep -E "Throughput|Duration|Occupancy|Registers|Stall|Issued|Eligible|No Eligible|cycles being stalled" "$OUT/ncu_prefill.txt" | head -40
    # Stall reasons per issued instruction and the tensor / MUFU pipes' activity (a separate call: metric names vary).
    ncu --clock-control none --kernel-name regex:prefill_kernel --launch-skip 1 --launch-count 1 --metrics \
      'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum' \
      $B/bench/bench_prefill_cuda 8192 128 1 ${PROFILE_POLICY:-DMA-default} >"$OUT/ncu_prefill_stalls.txt" 2>&1
    grep -E "gmma|pipe_xu|stalled|inst_executed" "$OUT/ncu_prefill_stalls.txt" | awk '$NF+0 > 0.05 || /pipe/' | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | head -24
  fi
  if [ "${BREAKDOWN:-0}" = 1 ]; then  # one N=4096 call kernel by kernel (ncu), and event timings against BASE=dir's binaries
    ncu --metrics gpu__time_duration.sum --launch-skip 6 --launch-count 6 $B/bench/bench_prefill_cuda 4096 128 1 \
      >"$OUT/ncu_breakdown_4096.txt" 2>&1
    grep -E "Context [0-9]|gpu__time_duration" "$OUT/ncu_breakdown_4096.txt" | sed -E 's/ \([0-9]+, [0-9]+, [0-9]+\)x.*//' \
      | paste - - | awk '{print substr($0, 1, 60), $(NF-1), $NF}'
    python3 -c "import numpy as np; r=np.random.default_rng(1)
for n,h in (('q',32),('k',8),('v',8)): np.save('/tmp/bd_'+n+'.npy', r.standard_normal((1,h,4096,128)).astype(np.float16))"
    for bin in ${BASE:-} $B; do
      for n in 4096 16384; do echo "$bin in-process N=$n: $($bin/bench/bench_prefill_cuda $n 128 10 | head -1)"; done
      echo "$bin CLI N=4096: $($bin/dmattn run --q /tmp/bd_q.npy --k /tmp/bd_k.npy --v /tmp/bd_v.npy --out /tmp/bd_o.npy \
        --causal --backend cuda --repeat 10 2>&1 | grep -oE 'in [0-9.]+ s')"
    done
  fi
  if [ "${SOURCE:-0}" = 1 ]; then  # per-SASS-instruction stall samples (CSV in logs.tgz) + the quantize pass's memory view
    src_csv() {  # name, kernel regex, skip, command...
      local name=$1 kern=$2 skip=$3; shift 3
      ncu --kernel-name regex:$kern --launch-skip $skip --launch-count 1 --section WarpStateStats --section SourceCounters \
        -o "$OUT/$name" "$@" >"$OUT/$name.log" 2>&1
      ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass >"$OUT/$name.csv" 2>&1
      ncu -i "$OUT/$name.ncu-rep" --page details >"$OUT/$name.txt" 2>&1; rm -f "$OUT/$name.ncu-rep"
      echo "$name: $(wc -l <"$OUT/$name.csv") SASS rows"
    }
    [ "$PART" != prefill ] && src_csv src_decode_mxfp4 decode_kernel 3 $B/bench/bench_decode_cuda mxfp4 16 32768
    src_csv src_prefill prefill_kernel 1 $B/bench/bench_prefill_cuda 8192 128 1 ${PROFILE_POLICY:-DMA-default}
    ncu --kernel-name regex:quantize_rows --launch-skip 1 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section Occupancy $B/bench/bench_quantize_cuda >"$OUT/ncu_quantize.txt" 2>&1
    grep -E "Throughput|Duration|Occupancy|Registers|Stall|Issued|cycles being stalled" "$OUT/ncu_quantize.txt" | head -20
  fi
  exit 0
fi

ctest --test-dir $B --output-on-failure -j8 >"$OUT/ctest.log" 2>&1
row[ctest_all]=$(grep -E "tests passed" "$OUT/ctest.log" || echo FAILED)
ctest --test-dir $B -L gpu --output-on-failure >"$OUT/ctest_gpu.log" 2>&1
row[ctest_gpu]=$(grep -E "tests passed" "$OUT/ctest_gpu.log" || echo FAILED)
grep -q "Skipped" "$OUT/ctest_gpu.log" && row[ctest_gpu]="${row[ctest_gpu]} (SOME SKIPPED)"

for tool in memcheck racecheck; do
  compute-sanitizer --tool $tool --error-exitcode 9 $B/tests/dmattn_gpu_tests >"$OUT/sanitizer_$tool.log" 2>&1
  rc=$?
  row[sanitizer_$tool]=$([ $rc -eq 0 ] && grep -m1 "SUMMARY" "$OUT/sanitizer_$tool.log" || echo "rc=$rc, see log")
done

$B/bench/bench_quantize_cuda >"$OUT/bench_quantize.txt" 2>&1
$B/bench/bench_wgmma_cuda >"$OUT/bench_wgmma.txt" 2>&1
$B/bench/bench_chains_cuda >"$OUT/bench_chains.txt" 2>&1
row[loop_model]=$(grep -m1 "2 warpgroups, 128-key tiles, turns" "$OUT/bench_chains.txt" || echo FAILED)
row[wgmma_fp8]=$(grep -m1 "SS e4m3 m64n128k32 (S) *wgs 2" "$OUT/bench_wgmma.txt" || echo FAILED)
row[quantize_bw]=$(grep "mxfp8-e4m3 + mxfp4" "$OUT/bench_quantize.txt" || echo FAILED)
row[quantize_prepass]=$(grep "pre-pass K" "$OUT/bench_quantize.txt" || echo FAILED)
row[copy_bw]=$(grep "device copy" "$OUT/bench_quantize.txt" || echo FAILED)

$B/dmattn demo --n 4096 >"$OUT/demo.txt" 2>&1
row[demo_cpu]=$(grep -m1 "DMA diag=1 sinks=0" "$OUT/demo.txt" || echo FAILED)

echo
echo "== dmattn device summary ($(cat "$OUT/gpu.txt")) =="
for k in build ctest_all ctest_gpu sanitizer_memcheck sanitizer_racecheck copy_bw quantize_bw quantize_prepass wgmma_fp8 loop_model demo_cpu; do
  printf "%-20s %s\n" "$k" "${row[$k]}"
done

if [ "${PROFILE:-0}" = 1 ]; then  # ncu speed-of-light for the two kernels (PROFILE=1 bash bench/device.sh)
  ncu --kernel-name regex:prefill_kernel --launch-skip 6 --launch-count 1 --section SpeedOfLight \
    --section Occupancy --section LaunchStats $B/tests/dmattn_gpu_tests --gtest_filter=GpuPrefill.MatchesCpuOracle \
    >"$OUT/ncu_prefill.txt" 2>&1
  ncu --kernel-name regex:quantize_rows --launch-skip 1 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    $B/bench/bench_quantize_cuda >"$OUT/ncu_quantize.txt" 2>&1
  grep -E "Throughput|Duration|Achieved Occupancy|Registers" "$OUT/ncu_prefill.txt" "$OUT/ncu_quantize.txt" | head -30
fi

echo
measure_performance  # every table, unless PERF_SECTIONS names some
grep -A12 "^| B x N" docs/PERFORMANCE.md | head -10
