"""One module per implementation (xla, cpu, cuda, metal, metal_emulated).

Each ends with ``IMPLEMENTATION`` (an ``_registry.Implementation``, or None
with ``IMPORT_ERROR`` saying why it is unavailable here). ``_ffi`` is what the
FFI-backed ones share; ``_metal_common`` what the two Metal ones share.
"""
