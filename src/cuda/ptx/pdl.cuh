// Programmatic dependent launch (PTX griddepcontrol): a kernel launched as the programmatic dependent
// of the one before it in the stream (launch.hpp) may be placed on the SMs while that one finishes.
#pragma once

namespace dmattn::cuda {

// Blocks until the grids this one depends on have completed and their writes are visible: before
// any read of what they wrote (a no-op in a kernel launched without the dependency).
__device__ __forceinline__ void wait_prior_grids() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Lets the dependent grid launch once every CTA of this grid has called it (or exited). Called after
// wait_prior_grids, it keeps a chain of dependents in order: a kernel's dependent starts only after
// every kernel before it has completed.
__device__ __forceinline__ void allow_dependents() { asm volatile("griddepcontrol.launch_dependents;"); }

// A link of a chain of dependents: both of the above, before the kernel's first read.
__device__ __forceinline__ void follow_prior_grids() {
  wait_prior_grids();
  allow_dependents();
}

}  // namespace dmattn::cuda
