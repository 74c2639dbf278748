"""The benchmarks' command: ``python -m jax_fatrain.benchmark [MODE] [FLAGS]``.

Modes (the code is in :mod:`jax_fatrain.bench`):

* none: CPU timings, ours against XLA, PyTorch and MLX, forward and
  forward+backward over a grid of shapes (:mod:`jax_fatrain.bench.cpu`);
* ``--packed``: packed sequences, ours with segment ids against ours dense
  causal on the same shape (:mod:`jax_fatrain.bench.cpu`);
* ``--metal-model``: our Metal kernels and MLX's steel attention counted by the
  MSL emulator, with modelled times on named Apple GPUs
  (:mod:`jax_fatrain.bench.metal`; with ``--packed``, a packed sequence);
* ``--cuda``: one NVIDIA GPU, ours against cuDNN and XLA
  (:mod:`jax_fatrain.bench.cuda`); it has flags of its own
  (``python -m jax_fatrain.benchmark --cuda --help``).

``python -m jax_fatrain.benchmark --help`` lists the flags of the other modes.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence


def main(argv: Sequence[str] | None = None) -> Any:
  """Runs the mode ``argv`` asks for; returns what that mode's ``main`` returns."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if "--cuda" in argv:
    argv.remove("--cuda")
    from jax_fatrain.bench import cuda  # pylint: disable=import-outside-toplevel
    return cuda.main(argv)
  from jax_fatrain.bench import cpu  # pylint: disable=import-outside-toplevel
  return cpu.main(argv)


if __name__ == "__main__":
  status = main()
  sys.exit(status if isinstance(status, int) else 0)
