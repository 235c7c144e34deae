"""The offload gather: which rows each query token of an offloaded layer attends to.

``contract`` (the one interface and its value types), ``layers`` (the per-layer state every
implementation works on: hot buffers, residency, row identity), one module per implementation
(``reference``, ``decode_step``, ``identity_step``, ``native_lane``; the fused path,
``offload_fused``, answers with attention output instead), and ``choose`` (the chain,
picked once at start).
"""
