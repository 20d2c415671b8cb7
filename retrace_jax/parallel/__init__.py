"""Several devices and several hosts.

* ``sharding`` -- meshes with named axes, logical-axis rules;
* ``placement`` -- :func:`shard_model`, placing a target or drafter on a mesh;
* ``distributed`` -- ``jax.distributed`` start-up from the environment.
"""
