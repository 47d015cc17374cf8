"""Hygiene for code that runs inside Spark's Python workers: cheap per-task GC, a worker
pool of its own for a model-backed stage, and the GPU a task may use.

Nothing here imports pyspark at module level: the generation core
(:mod:`udfs.captioner`) uses :func:`task_device` on a bare GPU box too.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "settle_imports",
    "POOL_ENV",
    "python_worker_pool",
    "GPU_SCHEDULING",
    "task_device",
]


def settle_imports() -> None:
    """Exempt what is alive now -- modules, classes, loaded models -- from Python's
    cyclic garbage collector; call it in a task after its heavy imports or model load.

    PySpark's daemon runs a full ``gc.collect()`` after every task of a reused worker,
    and a full collection walks every tracked object: ~0.05 s once pylance and pyarrow
    are imported, ~0.26 s once ``streaming`` (and with it torch) is, paid by every
    later task of that worker whatever it runs. Measured on the export: a 4-task write
    stage of 1,500 rows spent a third of its time there. ``gc.freeze`` moves the current
    objects to a permanent generation (cheap, idempotent); everything allocated later is
    collected as usual. Called between tasks, right after the daemon's collection, it
    freezes no garbage -- only what survived it."""
    gc.freeze()


# Set in the environment of the Python functions defined inside `python_worker_pool`.
POOL_ENV = "LAKESHARD_PYTHON_POOL"


@contextmanager
def python_worker_pool(spark, name: str) -> Iterator[None]:
    """Python functions (UDFs, ``mapInArrow``) defined inside this block run in a pool
    of Python workers of their own, named `name`.

    Each executor keeps one pool of reusable Python workers per distinct environment
    of the Python function (Spark's ``PythonWorkerFactory`` is keyed by it), and an
    idle worker is handed to whichever task asks next, whatever that task runs. A
    model-backed stage shares that pool with everything else -- the Lance read in the
    same task, earlier stages -- so a worker that served a read later gets a caption
    task and loads another model copy (measured: 3-4 loads on 2 task slots). A pool of
    its own holds exactly as many workers as the stage has concurrent tasks: one model
    copy per task slot, each reused for every later task of that slot. Its idle workers
    (and their models) are stopped by Spark about a minute after the pool's last task.

    The variable is read from ``SparkContext.environment`` when the function is
    wrapped, so only functions created inside the block get it."""
    env = spark.sparkContext.environment
    before = env.get(POOL_ENV)
    env[POOL_ENV] = name
    try:
        yield
    finally:
        if before is None:
            env.pop(POOL_ENV, None)
        else:
            env[POOL_ENV] = before


# What `device: cuda` needs from Spark; named in every error about it.
GPU_SCHEDULING = (
    "spark.executor.resource.gpu.amount (GPUs per executor), "
    "spark.task.resource.gpu.amount (GPUs per task, e.g. 0.5 for two tasks per GPU) and "
    "spark.executor.resource.gpu.discoveryScript (or the cluster's GPU discovery)"
)


def _task_context():
    try:
        from pyspark import TaskContext
    except ImportError:  # a bare box: not in Spark
        return None
    return TaskContext.get()


def task_device(device: str, field: str) -> str:
    """The torch device for configured `device` (`field` names the setting in errors).

    ``cpu`` and ``cuda:N`` are taken as they are (``cuda:N`` also outside Spark, e.g. on
    the driver's machine); in a Spark task that Spark assigned GPUs, ``cuda:N`` must be
    one of them. ``cuda`` is the GPU Spark assigned to the task -- a task without one
    fails with the settings to add, never a guess at ``cuda:0``."""
    ctx = _task_context()
    gpus = ctx.resources().get("gpu") if ctx is not None else None
    assigned = list(gpus.addresses) if gpus is not None else []
    if device == "cpu":
        return device
    if device.startswith("cuda:"):
        index = device.split(":", 1)[1]
        if assigned and index not in assigned:
            raise RuntimeError(
                f"{field} is {device!r} but Spark assigned this task GPU(s) "
                f"{', '.join(assigned)}: use device: cuda (the task's GPU)"
            )
        return device
    if device != "cuda":
        raise ValueError(f"{field}: unknown device {device!r} (cpu, cuda or cuda:N)")
    if ctx is None:
        raise RuntimeError(
            f"{field} is 'cuda', the GPU Spark assigns to each task, but this is not a "
            "Spark task: name a GPU (cuda:0) to run outside Spark"
        )
    if not assigned:
        raise RuntimeError(
            f"{field} is 'cuda' (the GPU Spark assigns to each task) but Spark assigned "
            f"this task no GPU (host {os.uname().nodename}): set {GPU_SCHEDULING} in "
            "spark.conf, or device: cuda:N for one fixed GPU"
        )
    return f"cuda:{assigned[0]}"
