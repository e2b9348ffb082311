#!/usr/bin/env python3
"""Train the small digits CNN that asyncinfer ships as its default model.

Everything is plain NumPy: hand-written forward/backward passes (im2col for
the convolutions) and an Adam optimiser, so the script runs anywhere the
engine itself runs -- no PyTorch or JAX needed.

Data: scikit-learn's ``load_digits`` (1797 grey-scale 8x8 images, values
0..16, 10 classes), split 80/20 stratified with a fixed seed.

Architecture (shapes for one image)::

    image [1,8,8]
      Conv 1->16, 3x3, pad 1  -> Relu   [16,8,8]
      Conv 16->32, 3x3, pad 1 -> Relu   [32,8,8]
      MaxPool 2x2, stride 2             [32,4,4]
      Flatten                           [512]
      Gemm 512->64 -> Relu              [64]
      Gemm 64->10                       [10]   = logits
      Softmax(axis=1)                   [10]   = probabilities

Outputs (default ``asyncinfer/assets``, change with ``--out-dir``):

* ``digits_cnn.onnx``     opset 17, ir_version 8, input ``image`` [N,1,8,8]
* ``digits_samples.npz``  the held-out test split: ``images`` float32
  [M,1,8,8] in [0,1] and ``labels`` int64 [M]

Usage::

    python3 examples/train_digits_cnn.py [--out-dir DIR] [--epochs 30] [--seed 0]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT_DIR = REPO_ROOT / "asyncinfer" / "assets"
MODEL_NAME = "digits_cnn.onnx"
SAMPLES_NAME = "digits_samples.npz"

# Opset 17 / IR 8 keeps the file loadable by onnxruntime releases back to 1.13.
OPSET = 17
IR_VERSION = 8


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------


def load_data(seed: int):
    """Return (x_train, y_train, x_test, y_test); x is float32 [N,1,8,8] in [0,1]."""
    digits = load_digits()
    # Pixel values are integers 0..16; dividing by 16 maps them exactly onto [0,1].
    x = (digits.images.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=0.2, stratify=y, random_state=seed
    )
    return (
        np.ascontiguousarray(x_tr),
        y_tr,
        np.ascontiguousarray(x_te),
        y_te,
    )


# --------------------------------------------------------------------------
# Layers: each forward returns (output, cache); backward consumes the cache.
# --------------------------------------------------------------------------


def im2col_3x3(x: np.ndarray) -> np.ndarray:
    """[N,C,H,W] -> [N*H*W, C*9] patches for a 3x3, pad-1, stride-1 convolution."""
    n, c, h, w = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    win = np.lib.stride_tricks.sliding_window_view(xp, (3, 3), axis=(2, 3))
    # win: [N,C,H,W,3,3]; put the spatial position first so each row is one patch
    # whose column order (c, kh, kw) matches weight.reshape(O, C*9).
    return win.transpose(0, 2, 3, 1, 4, 5).reshape(n * h * w, c * 9)


def col2im_3x3(dcols: np.ndarray, shape: tuple[int, int, int, int]) -> np.ndarray:
    """Adjoint of im2col_3x3: scatter-add patch gradients back onto the image."""
    n, c, h, w = shape
    d = dcols.reshape(n, h, w, c, 3, 3).transpose(0, 3, 4, 5, 1, 2)  # [N,C,3,3,H,W]
    dxp = np.zeros((n, c, h + 2, w + 2), dtype=dcols.dtype)
    for i in range(3):
        for j in range(3):
            dxp[:, :, i : i + h, j : j + w] += d[:, :, i, j]
    return dxp[:, :, 1:-1, 1:-1]


def conv_forward(x, weight, bias):
    n, _, h, w = x.shape
    o = weight.shape[0]
    cols = im2col_3x3(x)
    out = cols @ weight.reshape(o, -1).T + bias  # [N*H*W, O]
    out = out.reshape(n, h, w, o).transpose(0, 3, 1, 2)
    return np.ascontiguousarray(out), (cols, x.shape)


def conv_backward(dout, weight, cache):
    cols, x_shape = cache
    o = weight.shape[0]
    dflat = dout.transpose(0, 2, 3, 1).reshape(-1, o)  # [N*H*W, O]
    dweight = (dflat.T @ cols).reshape(weight.shape)
    dbias = dflat.sum(axis=0)
    dx = col2im_3x3(dflat @ weight.reshape(o, -1), x_shape)
    return dx, dweight, dbias


def relu_forward(x):
    return np.maximum(x, 0), x > 0


def relu_backward(dout, mask):
    return dout * mask


def maxpool2_forward(x):
    """2x2/stride-2 max pool; remembers the arg-max so ties route to one input only."""
    n, c, h, w = x.shape
    # [N,C,H/2,W/2,4]: the four values of each window on the last axis
    win = x.reshape(n, c, h // 2, 2, w // 2, 2).transpose(0, 1, 2, 4, 3, 5)
    win = win.reshape(n, c, h // 2, w // 2, 4)
    idx = win.argmax(axis=-1)
    out = np.take_along_axis(win, idx[..., None], axis=-1)[..., 0]
    return out, (idx, x.shape)


def maxpool2_backward(dout, cache):
    idx, (n, c, h, w) = cache
    dwin = np.zeros((n, c, h // 2, w // 2, 4), dtype=dout.dtype)
    np.put_along_axis(dwin, idx[..., None], dout[..., None], axis=-1)
    dx = dwin.reshape(n, c, h // 2, w // 2, 2, 2).transpose(0, 1, 2, 4, 3, 5)
    return dx.reshape(n, c, h, w)


def dense_forward(x, weight, bias):
    # weight is [out, in], the layout ONNX Gemm uses with transB=1
    return x @ weight.T + bias, x


def dense_backward(dout, weight, x):
    return dout @ weight, dout.T @ x, dout.sum(axis=0)


def softmax(z):
    z = z - z.max(axis=1, keepdims=True)  # shift for numerical stability
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------


def init_params(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """He-normal weights (suited to ReLU), zero biases, all float32."""

    def he(shape, fan_in):
        return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)

    return {
        "conv1.weight": he((16, 1, 3, 3), 1 * 9),
        "conv1.bias": np.zeros(16, np.float32),
        "conv2.weight": he((32, 16, 3, 3), 16 * 9),
        "conv2.bias": np.zeros(32, np.float32),
        "fc1.weight": he((64, 512), 512),
        "fc1.bias": np.zeros(64, np.float32),
        "fc2.weight": he((10, 64), 64),
        "fc2.bias": np.zeros(10, np.float32),
    }


def forward(p, x, keep_cache=False):
    """Logits for x [N,1,8,8]; with keep_cache also returns what backward needs."""
    h, c1 = conv_forward(x, p["conv1.weight"], p["conv1.bias"])
    h, r1 = relu_forward(h)
    h, c2 = conv_forward(h, p["conv2.weight"], p["conv2.bias"])
    h, r2 = relu_forward(h)
    h, mp = maxpool2_forward(h)
    pooled_shape = h.shape
    h = h.reshape(h.shape[0], -1)  # Flatten (C-order, same as ONNX Flatten axis=1)
    h, d1 = dense_forward(h, p["fc1.weight"], p["fc1.bias"])
    h, r3 = relu_forward(h)
    logits, d2 = dense_forward(h, p["fc2.weight"], p["fc2.bias"])
    if not keep_cache:
        return logits
    return logits, (c1, r1, c2, r2, mp, pooled_shape, d1, r3, d2)


def backward(p, dlogits, cache):
    c1, r1, c2, r2, mp, pooled_shape, d1, r3, d2 = cache
    g = {}
    dh, g["fc2.weight"], g["fc2.bias"] = dense_backward(dlogits, p["fc2.weight"], d2)
    dh = relu_backward(dh, r3)
    dh, g["fc1.weight"], g["fc1.bias"] = dense_backward(dh, p["fc1.weight"], d1)
    dh = maxpool2_backward(dh.reshape(pooled_shape), mp)
    dh = relu_backward(dh, r2)
    dh, g["conv2.weight"], g["conv2.bias"] = conv_backward(dh, p["conv2.weight"], c2)
    dh = relu_backward(dh, r1)
    # The input image needs no gradient, so the last col2im result is discarded.
    _, g["conv1.weight"], g["conv1.bias"] = conv_backward(dh, p["conv1.weight"], c1)
    return g


def loss_and_grads(p, x, y, weight_decay):
    """Mean softmax cross-entropy (+ L2 on weights) and its gradients."""
    logits, cache = forward(p, x, keep_cache=True)
    probs = softmax(logits)
    n = x.shape[0]
    loss = -np.log(probs[np.arange(n), y] + 1e-12).mean()
    dlogits = probs
    dlogits[np.arange(n), y] -= 1.0
    dlogits /= n
    grads = backward(p, dlogits, cache)
    for k in grads:
        if k.endswith(".weight"):  # decay weights only, not biases
            grads[k] += weight_decay * p[k]
            loss += 0.5 * weight_decay * float((p[k] ** 2).sum())
    return float(loss), grads


class Adam:
    def __init__(self, params, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8):
        self.lr, self.b1, self.b2, self.eps = lr, beta1, beta2, eps
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}
        self.t = 0

    def step(self, params, grads):
        self.t += 1
        # Bias correction folded into the step size, as in the Adam paper.
        lr_t = self.lr * np.sqrt(1 - self.b2**self.t) / (1 - self.b1**self.t)
        for k, g in grads.items():
            self.m[k] = self.b1 * self.m[k] + (1 - self.b1) * g
            self.v[k] = self.b2 * self.v[k] + (1 - self.b2) * g * g
            params[k] -= (lr_t * self.m[k] / (np.sqrt(self.v[k]) + self.eps)).astype(
                np.float32
            )


def predict(p, x, batch=512):
    return np.concatenate([forward(p, x[i : i + batch]) for i in range(0, len(x), batch)])


def accuracy(p, x, y):
    return float((predict(p, x).argmax(axis=1) == y).mean())


def train(x_tr, y_tr, x_te, y_te, *, epochs, batch_size, lr, weight_decay, seed):
    rng = np.random.default_rng(seed)
    params = init_params(rng)
    opt = Adam(params, lr=lr)
    n = len(x_tr)
    for epoch in range(1, epochs + 1):
        # Cosine decay: large steps early, fine convergence at the end.
        opt.lr = lr * 0.5 * (1 + np.cos(np.pi * (epoch - 1) / epochs))
        order = rng.permutation(n)
        total = 0.0
        for i in range(0, n, batch_size):
            idx = order[i : i + batch_size]
            loss, grads = loss_and_grads(params, x_tr[idx], y_tr[idx], weight_decay)
            opt.step(params, grads)
            total += loss * len(idx)
        if epoch == 1 or epoch % 5 == 0 or epoch == epochs:
            print(
                f"epoch {epoch:3d}  loss {total / n:.4f}  "
                f"train acc {accuracy(params, x_tr, y_tr):.4f}  "
                f"test acc {accuracy(params, x_te, y_te):.4f}"
            )
    return params


def check_gradients(seed: int = 0) -> None:
    """Compare analytic gradients with central differences on a tiny batch.

    Run in float64 so the finite differences are meaningful.
    """
    rng = np.random.default_rng(seed)
    p = {k: v.astype(np.float64) for k, v in init_params(rng).items()}
    for k in p:  # non-zero biases so their gradients are exercised too
        if k.endswith(".bias"):
            p[k] = rng.standard_normal(p[k].shape) * 0.1
    x = rng.random((3, 1, 8, 8))
    y = np.array([1, 4, 7])

    def f():
        logits = forward(p, x)
        return -np.log(softmax(logits)[np.arange(3), y]).mean()

    _, grads = loss_and_grads(p, x, y, weight_decay=0.0)
    eps = 1e-6
    for k, g in grads.items():
        flat = p[k].reshape(-1)
        for j in rng.choice(flat.size, size=min(5, flat.size), replace=False):
            old = flat[j]
            flat[j] = old + eps
            up = f()
            flat[j] = old - eps
            down = f()
            flat[j] = old
            num = (up - down) / (2 * eps)
            ana = g.reshape(-1)[j]
            if abs(num - ana) > 1e-5 * max(1.0, abs(num)):
                raise AssertionError(f"gradient check failed for {k}[{j}]: {ana} vs {num}")
    print("gradient check passed")


# --------------------------------------------------------------------------
# ONNX export
# --------------------------------------------------------------------------


def export_onnx(p, path: Path, doc: str) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(v.astype(np.float32), name=k) for k, v in p.items()]
    conv = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1])
    nodes = [
        helper.make_node("Conv", ["image", "conv1.weight", "conv1.bias"], ["conv1"], name="conv1", **conv),
        helper.make_node("Relu", ["conv1"], ["relu1"], name="relu1"),
        helper.make_node("Conv", ["relu1", "conv2.weight", "conv2.bias"], ["conv2"], name="conv2", **conv),
        helper.make_node("Relu", ["conv2"], ["relu2"], name="relu2"),
        helper.make_node("MaxPool", ["relu2"], ["pool"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["pool"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", "fc1.weight", "fc1.bias"], ["fc1"], name="fc1", transB=1),
        helper.make_node("Relu", ["fc1"], ["relu3"], name="relu3"),
        helper.make_node("Gemm", ["relu3", "fc2.weight", "fc2.bias"], ["logits"], name="fc2", transB=1),
        helper.make_node("Softmax", ["logits"], ["probabilities"], name="softmax", axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "digits_cnn",
        inputs=[helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 1, 8, 8])],
        outputs=[
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10]),
            helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["N", 10]),
        ],
        initializer=inits,
        doc_string="8x8 grey-scale digit in [0,1] -> 10 class scores",
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="asyncinfer/examples/train_digits_cnn.py",
        producer_version="1",
        doc_string=doc,
    )
    model.ir_version = IR_VERSION
    model.model_version = 1
    onnx.checker.check_model(model, full_check=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return model


def verify_with_onnxruntime(path: Path, p, x_te, y_te) -> None:
    try:
        import onnxruntime as ort
    except ImportError:
        print("onnxruntime not installed; skipping runtime verification")
        return
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    logits, probs = sess.run(["logits", "probabilities"], {"image": x_te})
    ref = predict(p, x_te)
    diff = float(np.abs(logits - ref).max())
    acc = float((logits.argmax(axis=1) == y_te).mean())
    print(f"onnxruntime {ort.__version__}: test acc {acc:.4f}, max |logits - numpy| = {diff:.2e}")
    assert diff < 1e-4, f"ONNX logits differ from the NumPy forward pass by {diff}"
    assert np.allclose(probs, softmax(ref), atol=1e-5), "ONNX probabilities differ"
    assert np.allclose(probs.sum(axis=1), 1.0, atol=1e-5)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-grad", action="store_true", help="run a finite-difference gradient check first")
    args = ap.parse_args(argv)

    if args.check_grad:
        check_gradients(args.seed)

    x_tr, y_tr, x_te, y_te = load_data(args.seed)
    print(f"train {x_tr.shape}, test {x_te.shape}")

    t0 = time.perf_counter()
    params = train(
        x_tr, y_tr, x_te, y_te,
        epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
        weight_decay=args.weight_decay, seed=args.seed,
    )
    train_s = time.perf_counter() - t0
    train_acc = accuracy(params, x_tr, y_tr)
    test_acc = accuracy(params, x_te, y_te)
    print(f"trained in {train_s:.1f}s: train acc {train_acc:.4f}, test acc {test_acc:.4f}")

    doc = (
        "Small CNN classifying scikit-learn's 8x8 digits (load_digits, 10 classes). "
        "Input 'image': float32 [N,1,8,8], pixel values divided by 16 so they lie in [0,1]. "
        "Outputs 'logits' [N,10] and 'probabilities' [N,10] (softmax over axis 1). "
        "Layers: Conv(1->16,3x3,pad1)-Relu-Conv(16->32,3x3,pad1)-Relu-MaxPool2x2-"
        "Flatten-Gemm(512->64)-Relu-Gemm(64->10). "
        f"Trained from scratch in NumPy by examples/train_digits_cnn.py: seed {args.seed}, "
        f"stratified 80/20 split (random_state={args.seed}), Adam lr {args.lr} with cosine decay, "
        f"batch {args.batch_size}, {args.epochs} epochs, L2 weight decay {args.weight_decay}. "
        f"Accuracy: train {train_acc:.4f}, held-out test {test_acc:.4f} "
        f"({len(y_te)} images, shipped as digits_samples.npz)."
    )
    model_path = args.out_dir / MODEL_NAME
    samples_path = args.out_dir / SAMPLES_NAME
    export_onnx(params, model_path, doc)
    np.savez_compressed(samples_path, images=x_te.astype(np.float32), labels=y_te.astype(np.int64))
    print(f"wrote {model_path} ({model_path.stat().st_size} bytes)")
    print(f"wrote {samples_path} ({samples_path.stat().st_size} bytes)")

    verify_with_onnxruntime(model_path, params, x_te, y_te)


if __name__ == "__main__":
    main()
