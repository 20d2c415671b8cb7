"""Several devices and several hosts.

* ``sharding`` -- meshes with named axes, logical-axis rules, :func:`shard_model`;
* ``distributed`` -- ``jax.distributed`` start-up from the environment.
"""
