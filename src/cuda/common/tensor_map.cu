// Host side of TMA: tensor maps encoded through the driver's entry point (fetched via the runtime,
// so the library does not link libcuda itself).
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <string>

#include "cuda/ptx/tma.cuh"
#include "dmattn/error.hpp"

namespace dmattn::cuda {

CUtensorMap tensor_map_3d(const void* base, CUtensorMapDataType type, const uint64_t (&dims)[3],
                          const uint64_t (&strides)[2], const uint32_t (&box)[3], CUtensorMapSwizzle swizzle) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (!encode) throw Error("the CUDA driver has no cuTensorMapEncodeTiled (TMA needs CUDA 12+)");
  CUtensorMap map{};
  const cuuint64_t dim[3] = {dims[0], dims[1], dims[2]};
  const cuuint64_t stride[2] = {strides[0], strides[1]};
  const cuuint32_t boxd[3] = {box[0], box[1], box[2]}, unit[3] = {1, 1, 1};
  const CUresult r = encode(&map, type, 3, const_cast<void*>(base), dim, stride, boxd, unit,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) throw Error("cuTensorMapEncodeTiled failed (error " + std::to_string(int(r)) + ")");
  return map;
}

}  // namespace dmattn::cuda
