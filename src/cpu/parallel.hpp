#pragma once
#include <cstdint>
#include <functional>

namespace dmattn::cpu {
// Runs f(i) for i in [0, n) on `threads` workers (0 = all hardware threads). Items are taken in
// order from a shared counter; each item runs on exactly one thread, so results that depend only
// on the item are identical for any thread count. The first exception thrown is rethrown.
void parallel_for(int64_t n, int threads, const std::function<void(int64_t)>& f);
int resolve_threads(int threads);
}  // namespace dmattn::cpu
