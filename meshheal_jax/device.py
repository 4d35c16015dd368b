"""Host values onto the device without eager `jnp` calls.

In JAX 0.10 an eager `jnp.asarray` or `jnp.stack` on host data compiles one small XLA program per
shape (~20 ms each: about a second per run when the compilation cache is off). Building the
engines' constant pytrees with numpy and copying them with `jax.device_put` compiles nothing.
"""

from __future__ import annotations

import jax
import numpy as np


def on_device(x, dtype) -> jax.Array:
    """A host value as a device array of `dtype`."""
    return jax.device_put(np.asarray(x, dtype=dtype))


def stack(trees):
    """Stack pytrees (host or device leaves) along a new leading axis, on the host."""
    return jax.tree_util.tree_map(lambda *xs: jax.device_put(np.stack([np.asarray(x) for x in xs])), *trees)
