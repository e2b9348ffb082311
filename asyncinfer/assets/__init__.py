"""The embedded default model: a small CNN trained on scikit-learn's digits (examples/train_digits_cnn.py)."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np


def default_model_path() -> Path:
    """Path of the shipped ``digits_cnn.onnx`` (input ``image`` [N,1,8,8] float32; outputs logits, probabilities)."""
    return Path(str(resources.files(__package__) / "digits_cnn.onnx"))


def default_samples() -> tuple[np.ndarray, np.ndarray]:
    """The held-out test images ([M,1,8,8] float32 in [0,1]) and their labels ([M] int64)."""
    with resources.as_file(resources.files(__package__) / "digits_samples.npz") as path:
        with np.load(path) as data:
            return data["images"], data["labels"]
