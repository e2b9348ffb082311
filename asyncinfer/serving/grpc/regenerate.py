"""Regenerate ``grpc_service_pb2.py`` and ``grpc_service_pb2_grpc.py`` from ``grpc_service.proto``.

    python -m asyncinfer.serving.grpc.regenerate [--any-version]

A development tool (it needs grpcio-tools, which is no runtime dependency). The generated code is
shipped, so what generates it decides which runtimes import it:

- protoc's Python code refuses a protobuf runtime older than the protoc that wrote it (from
  protobuf 5.27 on it calls ``ValidateProtobufRuntimeVersion``), and the gRPC plugin's code warns
  (from grpcio-tools 1.65 on: refuses) below its own grpcio version. The shipped code comes from
  grpcio-tools ``PINNED_TOOLS``: protoc 26.1, whose code (protobuf 5.26.1 gencode, no runtime
  check) imports on protobuf 5.26 onward, 6.x included, and a gRPC module that wants grpcio
  1.63.2 or newer; the ``serve`` extra's floors are these. A different grpcio-tools is refused
  unless ``--any-version`` is given (the floors must then rise to its versions). To run the
  pinned one beside a newer install::

      pip install --no-deps --target DIR grpcio-tools==1.63.2
      PYTHONPATH=DIR python -m asyncinfer.serving.grpc.regenerate

- The messages are built in a private descriptor pool instead of protobuf's default one: Triton's
  own client (``tritonclient.grpc``) registers the same ``inference.*`` names in the default pool,
  and a second registration of a name there is an error, so without this asyncinfer's server and
  Triton's client could not be imported in one process. protoc has no option for that, so the one
  line that names the default pool is rewritten here (and the rewrite checked). (With protobuf's
  pure-Python implementation, chosen by ``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python``, the
  message classes are still entered in the default symbol database, so there the two cannot be
  imported together; each alone works.)
"""
from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path

PINNED_TOOLS = "1.63.2"
PROTO = "grpc_service.proto"
_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parents[2]  # the folder holding the asyncinfer package: protoc's include path

_DEFAULT_POOL = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
_PRIVATE_POOL = (
    "# asyncinfer: a private pool, not the default one, so that another module registering the\n"
    "# same inference.* names (Triton's client does) can be imported beside this one\n"
    "# (asyncinfer.serving.grpc.regenerate rewrote this line).\n"
    "_POOL = _descriptor_pool.DescriptorPool()\n"
    "DESCRIPTOR = _POOL.AddSerializedFile("
)


def generate(out_dir: Path = _HERE) -> list[Path]:
    """Run protoc on ``grpc_service.proto``, write both modules into ``out_dir``, return their paths."""
    from grpc_tools import protoc  # a development dependency only

    proto = (_HERE / PROTO).relative_to(_ROOT)
    scratch = out_dir / "_protoc_out"
    scratch.mkdir(exist_ok=True)
    try:
        status = protoc.main(["grpc_tools.protoc", f"-I{_ROOT}", f"--python_out={scratch}",
                              f"--grpc_python_out={scratch}", str(proto)])
        if status != 0:
            raise SystemExit(f"protoc failed with status {status} on {proto}")
        generated = scratch / proto.parent
        written = []
        for name in ("grpc_service_pb2.py", "grpc_service_pb2_grpc.py"):
            text = (generated / name).read_text()
            if name == "grpc_service_pb2.py":
                text = _use_private_pool(text)
            target = out_dir / name
            target.write_text(text)
            written.append(target)
        return written
    finally:
        _remove_tree(scratch)


def _use_private_pool(text: str) -> str:
    count = text.count(_DEFAULT_POOL)
    if count != 1:
        raise SystemExit(f"expected protoc's code to register its file once with {_DEFAULT_POOL!r}, "
                         f"found {count} times: this protoc writes a form the rewrite does not know")
    return text.replace(_DEFAULT_POOL, _PRIVATE_POOL)


def _remove_tree(path: Path) -> None:
    if not path.exists():
        return
    for child in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        child.rmdir() if child.is_dir() else child.unlink()
    path.rmdir()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncinfer.serving.grpc.regenerate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--any-version", action="store_true",
                        help=f"use the installed grpcio-tools even if it is not {PINNED_TOOLS}")
    args = parser.parse_args(argv)
    try:
        installed = metadata.version("grpcio-tools")
    except metadata.PackageNotFoundError:
        print("grpcio-tools is not installed (pip install grpcio-tools==" + PINNED_TOOLS + ")", file=sys.stderr)
        return 2
    if installed != PINNED_TOOLS and not args.any_version:
        print(f"grpcio-tools {installed} is installed; the shipped code is generated with {PINNED_TOOLS} so that "
              f"it runs on the serve extra's oldest protobuf and grpcio (see this module's docstring), "
              f"or pass --any-version", file=sys.stderr)
        return 2
    for path in generate():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
