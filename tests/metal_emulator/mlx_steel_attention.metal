// MLX's steel attention forward (the `attention` kernel template of
// mlx/backend/metal/kernels/steel/attn/kernels/steel_attention.h), instantiated
// for the variants jax_fatrain compares its own forward against. MLX's
// headers are not part of this repository: jax_fatrain/emulator/mlx_reference.py
// fetches them from the pinned mlx-metal wheel and passes their root as an
// include directory; the MSL emulator then runs MLX's kernel unmodified.
//
// Names and tile sizes are the ones mlx-metal 0.32.4 uses for this kernel
// (its host picks the kernel by name):
//   steel_attention_<dtype>_bq<BQ>_bk<BK>_bd<D>_bv<D>_wm<WM>_wn<WN>_mask<mask dtype>
// with BQ = 32 query rows and WM = 4 simdgroups along them; BK = 32 keys per
// tile below D = 128, else 16 (32 at D = 256 on M*-Ultra GPUs, half and
// bfloat16); WN = 2 simdgroups splitting the head dimension at D = 256, else 1.
// These are exactly the steel_attention_* non-NAX names in the wheel's
// mlx.metallib for D = 64, 128, 256. The mask type is the input dtype (additive mask, also
// used when there is no mask) or bool.
#include "mlx/backend/metal/kernels/utils.h"
#include "mlx/backend/metal/kernels/steel/attn/kernels/steel_attention.h"

// The buffer layout jax_fatrain/emulator/mlx_reference.py writes (ctypes) must be the
// one these headers declare.
static_assert(sizeof(mlx::steel::AttnParams) == 152, "AttnParams layout changed");
static_assert(sizeof(mlx::steel::AttnMaskParams) == 24, "AttnMaskParams layout changed");

#define FATRAIN_MLX_ATTN(tname, type, bk, d, wn, mname, mtype)                       \
  instantiate_kernel(                                                                \
      "steel_attention_" #tname "_bq32_bk" #bk "_bd" #d "_bv" #d "_wm4_wn" #wn     \
      "_mask" #mname,                                                                \
      attention, type, 32, bk, d, d, 4, wn, mtype, float)

#define FATRAIN_MLX_ATTN_HEAD_DIMS(tname, type, mname, mtype) \
  FATRAIN_MLX_ATTN(tname, type, 32, 64, 1, mname, mtype)      \
  FATRAIN_MLX_ATTN(tname, type, 16, 128, 1, mname, mtype)     \
  FATRAIN_MLX_ATTN(tname, type, 16, 256, 2, mname, mtype)     \
  FATRAIN_MLX_ATTN(tname, type, 32, 256, 2, mname, mtype)

#define FATRAIN_MLX_ATTN_DTYPE(tname, type)                   \
  FATRAIN_MLX_ATTN_HEAD_DIMS(tname, type, tname, type)        \
  FATRAIN_MLX_ATTN_HEAD_DIMS(tname, type, bool_, bool)

FATRAIN_MLX_ATTN_DTYPE(float32, float)
FATRAIN_MLX_ATTN_DTYPE(float16, half)
FATRAIN_MLX_ATTN_DTYPE(bfloat16, bfloat16_t)
