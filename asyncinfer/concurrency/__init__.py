"""The bottom layer: the task graph's future, the bridge to event loops, the device thread.

Nothing here knows about models, tensors or backends; every layer above builds on it.
"""
from .bridge import loop_dispatcher, wait_done
from .device_thread import DeviceThread
from .future import TaskFuture

__all__ = ["DeviceThread", "TaskFuture", "loop_dispatcher", "wait_done"]
