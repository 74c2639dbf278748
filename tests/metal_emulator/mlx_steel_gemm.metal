// MLX's steel GEMM (the `gemm` kernel template of
// mlx/backend/metal/kernels/steel/gemm/kernels/steel_gemm_fused.h), instantiated
// under the host names mlx-metal 0.32.4 gives it, for the tile configurations its
// host chooses (jax_fatrain/emulator/mlx_reference.py, mlx_gemm_tiles):
//   steel_gemm_fused_<nn|nt|tn|tt>_<in dtype>_<out dtype>_bm<BM>_bn<BN>_bk<BK>_wm<WM>_wn<WN>
// MLX's headers are not part of this repository: jax_fatrain/emulator/mlx_reference.py
// fetches them from the pinned mlx-metal wheel; the MSL emulator runs the
// kernel unmodified. Used to calibrate jax_fatrain.emulator.model against
// published MLX GEMM timings.
#include "mlx/backend/metal/kernels/utils.h"
#include "mlx/backend/metal/kernels/steel/gemm/gemm.h"
#include "mlx/backend/metal/kernels/steel/gemm/kernels/steel_gemm_fused.h"

static_assert(sizeof(mlx::steel::GEMMParams) == 72, "GEMMParams layout changed");

#define FATRAIN_MLX_GEMM(layout, ta, tb, tname, type, bm, bn, bk, wm, wn)                \
  instantiate_kernel("steel_gemm_fused_" #layout "_" #tname "_" #tname "_bm" #bm "_bn" #bn \
                     "_bk" #bk "_wm" #wm "_wn" #wn,                                       \
                     gemm, type, bm, bn, bk, wm, wn, ta, tb, float)

#define FATRAIN_MLX_GEMM_LAYOUTS(tname, type, bm, bn, bk, wm, wn)          \
  FATRAIN_MLX_GEMM(nn, false, false, tname, type, bm, bn, bk, wm, wn)      \
  FATRAIN_MLX_GEMM(nt, false, true, tname, type, bm, bn, bk, wm, wn)

#define FATRAIN_MLX_GEMM_TILES(tname, type)                    \
  FATRAIN_MLX_GEMM_LAYOUTS(tname, type, 64, 64, 16, 2, 2)      \
  FATRAIN_MLX_GEMM_LAYOUTS(tname, type, 64, 64, 16, 1, 2)      \
  FATRAIN_MLX_GEMM_LAYOUTS(tname, type, 64, 32, 32, 2, 2)      \
  FATRAIN_MLX_GEMM_LAYOUTS(tname, type, 32, 64, 16, 1, 2)

FATRAIN_MLX_GEMM_TILES(float32, float)
FATRAIN_MLX_GEMM_TILES(float16, half)
FATRAIN_MLX_GEMM_TILES(bfloat16, bfloat16_t)
