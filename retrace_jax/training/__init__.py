"""Training DFlash and ReTrace drafters (the library behind ``train.py``).

* ``config`` -- the typed training configuration (defaults, documentation, validation);
* ``data`` -- prompt files, tokenisation, prepared response shards;
* ``prepare`` -- data preparation: the target's own responses, in resumable shards;
* ``dflash_loss`` / ``retrace_loss`` -- the two objectives;
* ``step`` -- one sharded optimiser step (remat, accumulation, mixed precision);
* ``loop`` -- the training loop: mesh, checkpoints, exact resume;
* ``checkpoints`` -- Orbax checkpoints of the training state;
* ``evaluate`` -- τ on held-out prompts with real speculative decoding, export, metrics;
* ``feature_store`` -- target features cached on disk;
* ``self_distill`` -- one-call self-distillation of a drafter;
* ``memory`` -- estimates of a training step's memory.
"""
