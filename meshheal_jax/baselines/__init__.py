"""The five baselines of spec/baselines.md in MeshHeal's world: agentnet, raps, autogen, sac, symphony.

Each is one module (its parameters as a frozen dataclass with the published defaults, its state,
its pure update functions and `task_step`) and runs through `run.run_baseline_frames`, one
compiled program per method: a scan over a stream's tasks, vmapped over streams.
"""

__all__ = ["METHODS", "BaselineSpec", "run_baseline_frames", "run_baseline_streams", "simulate"]


def __getattr__(name: str):  # lazy: importing the package compiles nothing and imports no jax
    if name in __all__:
        from meshheal_jax.baselines import run

        return getattr(run, name)
    raise AttributeError(name)
