"""Generated gRPC code for `protos/fusion/v1/*.proto`, built on first import.

The generated modules are not committed: when `services/_generated/` is missing or was built from
other .proto sources (a hash of their bytes and the protoc version is kept beside them), they are
compiled with `grpc_tools.protoc` under a file lock, in a temporary folder, and moved into place
file by file with the stamp written last, so concurrent processes neither clash nor read half-built
code. Imports between the generated files are rewritten to `fusion.services._generated` (the proto package
`fusion.v1` would otherwise collide with the `fusion` Python package).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import os
import re
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent.parent / "protos"
PROTO_FILES = ("fusion/v1/expert.proto", "fusion/v1/fusion.proto")
GENERATED = Path(__file__).resolve().parent / "_generated"
_STAMP = GENERATED / "STAMP"
_MODULES = ("expert_pb2", "expert_pb2_grpc", "fusion_pb2", "fusion_pb2_grpc")
_REWRITE_VERSION = "3"  # bump when _compile rewrites the generated code differently


def _source_hash() -> str:
    from grpc_tools import grpc_version

    digest = hashlib.sha256(grpc_version.VERSION.encode() + _REWRITE_VERSION.encode())
    for name in PROTO_FILES:
        digest.update(name.encode())
        digest.update((PROTO_ROOT / name).read_bytes())
    return digest.hexdigest()


def _is_current(stamp: str) -> bool:
    return _STAMP.exists() and _STAMP.read_text() == stamp


def _compile(stamp: str) -> None:
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory(dir=GENERATED, prefix=".build-") as tmp:
        args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", *(str(PROTO_ROOT / f) for f in PROTO_FILES)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_FILES} under {PROTO_ROOT}")
        built = Path(tmp) / "fusion" / "v1"
        for path in sorted(built.iterdir()):
            text = re.sub(r"^from fusion\.v1 import", "from fusion.services._generated import", path.read_text(),
                          flags=re.MULTILINE)
            # The messages' module name, used by pickle (Ray handles, multiprocessing), must be importable.
            text = re.sub(r"'fusion\.v1\.(\w+_pb2)'", r"'fusion.services._generated.\1'", text)
            staged = Path(tmp) / path.name
            staged.write_text(text)
            os.replace(staged, GENERATED / path.name)
    (GENERATED / "__init__.py").touch()
    staged_stamp = GENERATED / ".STAMP.tmp"
    staged_stamp.write_text(stamp)
    os.replace(staged_stamp, _STAMP)


def ensure_generated() -> None:
    """Build the generated modules if they are missing or stale."""
    stamp = _source_hash()
    if _is_current(stamp):
        return
    GENERATED.mkdir(exist_ok=True)
    with open(GENERATED / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not _is_current(stamp):  # another process may have built them while we waited
                _compile(stamp)
                importlib.invalidate_caches()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


ensure_generated()
expert_pb2, expert_pb2_grpc, fusion_pb2, fusion_pb2_grpc = (
    importlib.import_module(f"fusion.services._generated.{name}") for name in _MODULES
)

EXPERT_SERVICE = expert_pb2.DESCRIPTOR.services_by_name["Expert"].full_name
FUSION_SERVICE = fusion_pb2.DESCRIPTOR.services_by_name["Fusion"].full_name

__all__ = ["expert_pb2", "expert_pb2_grpc", "fusion_pb2", "fusion_pb2_grpc", "EXPERT_SERVICE", "FUSION_SERVICE",
           "ensure_generated"]
