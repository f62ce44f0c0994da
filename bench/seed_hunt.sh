#!/usr/bin/env bash
# Is a GPU test's rare failure data (its random seed) or a race? Runs the test (fresh seeds) for
# PLAIN seconds in 4 processes, then under racecheck for RACE seconds in 8, then replays up to 4
# failing seeds without a sanitizer (and the first racecheck one under it). Usage, on the device
# with the test binary built (or carried): bash bench/seed_hunt.sh GpuPrefill.SomeTest
# For example (bench/RESULTS.md): PLAIN=25 RACE=90 bash bench/seed_hunt.sh GpuPrefill.MatchesCpuOracleWhereScalesDoNotFold
T=${T:-build-sm90/tests/dmattn_gpu_tests}; F=--gtest_filter=${1:?gtest filter}
rm -rf /tmp/r; mkdir -p /tmp/r; nvidia-smi --query-gpu=name --format=csv,noheader
loop() {  # tag seconds [tool]
  local tag=$1 secs=$2 tool=$3 s=$(date +%s) n=0
  while [ $(( $(date +%s) - s )) -lt $secs ]; do n=$((n+1))
    if [ -n "$tool" ]; then compute-sanitizer --tool $tool $T $F >/tmp/r/$tag.$n 2>&1; else $T $F >/tmp/r/$tag.$n 2>&1; fi \
      && rm /tmp/r/$tag.$n
  done; echo $n >/tmp/r/count.$tag
}
for i in 1 2 3 4; do loop p$i ${PLAIN:-30} & done; wait
echo "plain: $(ls /tmp/r | grep -c '^p.*\.[0-9]') failed of $(cat /tmp/r/count.p* | awk "{s+=\$1} END {print s}")"
for i in 1 2 3 4 5 6 7 8; do loop r$i ${RACE:-100} racecheck & done; wait
echo "racecheck: $(ls /tmp/r | grep -c '^r.*\.[0-9]') failed of $(cat /tmp/r/count.r* | awk "{s+=\$1} END {print s}")"
for f in $(ls /tmp/r | grep '\.[0-9]' | head -4); do
  seed=$(grep -m1 -oE "^seed [0-9]+" /tmp/r/$f | cut -d' ' -f2)
  echo "== $f seed $seed"; grep -E "rel_l2 [0-9.e+-]+$" /tmp/r/$f | awk '$NF+0 > 2e-3'; grep -m3 worst /tmp/r/$f; grep -m2 -E "Failure|SUMMARY" /tmp/r/$f
  for k in 1 2; do DMATTN_TEST_SEED=$seed $T $F >/tmp/r/re 2>&1; echo "  replay plain $k: rc $?; $(grep -E 'rel_l2 [0-9.e+-]+$' /tmp/r/re | awk '$NF+0 > 2e-3' | head -2 | tr '\n' ' ')"; done
done
f=$(ls /tmp/r | grep '^r.*\.[0-9]' | head -1)
[ -n "$f" ] && { seed=$(grep -m1 -oE "^seed [0-9]+" /tmp/r/$f | cut -d' ' -f2)
  DMATTN_TEST_SEED=$seed compute-sanitizer --tool racecheck $T $F >/tmp/r/re_rc 2>&1; echo "replay $seed under racecheck: rc $?"; }
[ -n "${OUT:-}" ] && tar czf "$OUT/r.tgz" -C /tmp r; true
