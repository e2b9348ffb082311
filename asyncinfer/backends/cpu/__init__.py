from .backend import CPUBackend

__all__ = ["CPUBackend"]
