"""The MSL emulator as a measuring instrument for the Metal kernels.

* :mod:`jax_fatrain.emulator.profile`: cost counters of every dispatch the
  ``metal_emulated`` implementation runs;
* :mod:`jax_fatrain.emulator.model`: a cost model of named Apple GPUs over those
  counters, and :mod:`jax_fatrain.emulator.calibration` its calibration on
  published MLX timings (the data: ``calibration.json`` here);
* :mod:`jax_fatrain.emulator.msl_standalone`: run-time builds of other .metal
  files for the emulator, and :mod:`jax_fatrain.emulator.mlx_reference` MLX's
  steel kernels run through them (both need a source checkout and a C++
  compiler).

Used by ``python -m jax_fatrain.benchmark --metal-model`` and the tests; the
package itself imports none of them.
"""
