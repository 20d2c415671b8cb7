"""Decoding: a whole generation as one compiled program.

* ``generation`` -- :func:`generate`, the public entry point (validation, bucketing, sharding);
* ``plain`` -- plain autoregressive decoding as one ``lax.while_loop``;
* ``speculative`` -- DFlash / ReTrace speculative decoding as one ``lax.while_loop``;
* ``verify`` -- the longest accepted prefix of a drafted block;
* ``sampling`` -- temperature, top-k and top-p, and the speculative sampling rules;
* ``commit`` -- writing accepted tokens into the output buffers, stop tokens;
* ``layer_loop`` -- scanned or unrolled target layers and the per-layer weight copies;
* ``programs`` -- the compiled programs' options and JAX's persistent compilation cache.
"""
