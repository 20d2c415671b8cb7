"""Checkpoints in the Hugging Face / official DFlash layout.

* ``weights`` -- the table that maps each parameter to its safetensors name, shape and logical axes;
* ``safetensors`` -- reading single-file and sharded safetensors checkpoints lazily;
* ``digest`` -- the sha256 of a file, and the ``SHA256SUMS`` of a directory's files;
* ``files`` -- a file checked before it is opened (a directory or a FIFO is said to be one);
* ``atomic`` -- writing a checkpoint directory so that readers never see it half-written;
* ``checkpoints`` -- :func:`load_target`, :func:`load_drafter`, :func:`save_target`, :func:`save_drafter`.
"""
