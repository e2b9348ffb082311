"""Benchmarks of asyncinfer against ONNX Runtime; see bench/README.md."""
