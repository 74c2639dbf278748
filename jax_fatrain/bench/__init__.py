"""The benchmarks behind ``python -m jax_fatrain.benchmark`` (:mod:`jax_fatrain.benchmark`).

* :mod:`jax_fatrain.bench.cpu`: CPU timings against XLA, PyTorch and MLX, packed
  sequences, and the command line shared with ``--metal-model``;
* :mod:`jax_fatrain.bench.metal`: ``--metal-model``, our Metal kernels and MLX's
  counted by the MSL emulator and modelled on Apple GPUs;
* :mod:`jax_fatrain.bench.cuda`: ``--cuda``, one NVIDIA GPU against cuDNN and XLA.

None of them is imported by the package itself.
"""
