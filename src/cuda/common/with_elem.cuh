// An element format chosen at run time, handed to code that takes it as a type: each format's
// encoder compiles without the others' branches (a page's K format in the appends, a slot's format
// in the quantize pass).
#pragma once
#include <type_traits>

#include "dmattn/mx_codec.hpp"

namespace dmattn::cuda {

// f(std::integral_constant<Elem, e>). E2M1 first: the default's low format, most pages'.
template <class F>
__device__ __forceinline__ void with_elem(Elem e, F&& f) {
  switch (e) {
    case Elem::e2m1: f(std::integral_constant<Elem, Elem::e2m1>{}); break;
    case Elem::e4m3: f(std::integral_constant<Elem, Elem::e4m3>{}); break;
    case Elem::e5m2: f(std::integral_constant<Elem, Elem::e5m2>{}); break;
    case Elem::e3m2: f(std::integral_constant<Elem, Elem::e3m2>{}); break;
    case Elem::e2m3: f(std::integral_constant<Elem, Elem::e2m3>{}); break;
  }
}

}  // namespace dmattn::cuda
