"""Peer virtual environments: pinned specs, created on first use under benchmarks/.venvs/.

Each peer runs in its own venv so that its dependencies (and, for the PyPI ``roxxel`` 0.9.14
release, its import name) never touch the project's. A failed install is recorded in
``<venv>/install-error.txt`` and reported as a table row, never raised.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

VENV_ROOT = Path(__file__).resolve().parent / ".venvs"

# mosaicml-streaming imports torchvision and transformers at module level for a few type
# checks; PyPI's torchvision does not load beside the local CPU torch 2.13.0 wheel, and MDS
# writing and reading need neither. These stand-ins define just the names it imports.
_STUB_CLASS = textwrap.dedent(
    """
    \"\"\"Stand-in installed by roxxel's benchmarks (streaming's MDS path needs none of it).\"\"\"
    __version__ = "0.0.0+benchstub"


    class _Stub(dict):
        pass


    BatchFeature = BatchEncoding = VisionDataset = CIFAR = AutoTokenizer = _Stub


    def to_tensor(*args, **kwargs):
        raise ImportError("stood in for by roxxel's benchmarks")
    """
)
STREAMING_STUBS: tuple[str, ...] = (
    "torchvision/__init__.py",
    "torchvision/datasets/__init__.py",
    "torchvision/transforms/__init__.py",
    "torchvision/transforms/functional.py",
    "transformers/__init__.py",
    "transformers/feature_extraction_utils.py",
    "transformers/tokenization_utils_base.py",
    "transformers/models/__init__.py",
    "transformers/models/auto/__init__.py",
    "transformers/models/auto/tokenization_auto.py",
)


@dataclasses.dataclass(frozen=True, slots=True)
class PeerEnv:
    """How to build one peer's venv: pip steps run in order (each a list of pip arguments)."""

    name: str
    steps: tuple[tuple[str, ...], ...]
    stubs: tuple[str, ...] = ()


PEER_ENVS: dict[str, PeerEnv] = {
    "grain": PeerEnv(
        "grain",
        (
            (
                "grain==0.2.18",
                "array-record==0.8.6",
                "numpy==2.4.6",
                "psutil==7.2.2",
                "absl-py==2.5.1",
                "protobuf==7.36.2",
                "etils==1.15.0",
            ),
        ),
    ),
    "roxxel09": PeerEnv(
        "roxxel09",
        (
            (
                "roxxel==0.9.14",
                "jax==0.10.2",
                "jaxlib==0.10.2",
                "numpy==2.4.6",
                "psutil==7.2.2",
                "flax==0.12.8",
                "optax==0.2.8",
                "orbax-checkpoint==0.12.8",
            ),
        ),
    ),
    "streaming": PeerEnv(
        "streaming",
        (
            ("torch==2.13.0", "numpy==2.1.3", "psutil==7.2.2"),
            ("--no-deps", "mosaicml-streaming==0.13.0"),
            (
                "xxhash==3.8.2",
                "zstd==1.5.7.2",
                "python-snappy==0.7.3",
                "cramjam==2.14.0",
                "Brotli==1.2.1",
                "tqdm==4.70.1",
                "catalogue==2.0.10",
                "filelock==4.3.1",
                "pillow==13.0.0",
            ),
            # its S3 client (benchmarks.remote reads MDS shards from a local S3 server)
            ("boto3==1.43.117", "botocore==1.43.117"),
        ),
        stubs=STREAMING_STUBS,
    ),
    "hf": PeerEnv(
        "hf",
        (
            (
                "datasets==5.2.0",
                "numpy==2.4.6",
                "psutil==7.2.2",
                "pyarrow==26.0.1",
                "huggingface_hub==2.4.0",
                "fsspec==2026.9.0",
                "pandas==3.1.1",
            ),
        ),
    ),
}


def venv_python(name: str) -> Path:
    """Path of the python executable of a peer's venv (it may not exist yet)."""
    return VENV_ROOT / name / "bin" / "python"


def install_error(name: str) -> str | None:
    """The recorded install error of a peer's venv, or None when it installed."""
    path = VENV_ROOT / name / "install-error.txt"
    return path.read_text().strip() or "install failed" if path.exists() else None


def ensure_venv(name: str, *, log=sys.stderr) -> str | None:
    """Create the venv of peer ``name`` if missing; return None when usable, else the error."""
    env = PEER_ENVS[name]
    root = VENV_ROOT / name
    if (root / "ok").exists():
        return None
    if (root / "install-error.txt").exists():
        return install_error(name)
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        _run([sys.executable, "-m", "venv", str(root)], log)
        for step in env.steps:
            _run([str(venv_python(name)), "-m", "pip", "install", "-q", *step], log)
        _write_stubs(name, env.stubs)
    except subprocess.CalledProcessError as e:
        tail = (e.stderr or "")[-1500:].strip() or f"exit code {e.returncode}"
        (root / "install-error.txt").write_text(f"{' '.join(e.cmd[-3:])}: {tail}\n")
        return install_error(name)
    freeze = subprocess.run(
        [str(venv_python(name)), "-m", "pip", "freeze"], capture_output=True, text=True
    ).stdout
    (root / "freeze.txt").write_text(freeze)
    (root / "ok").write_text("ok\n")
    return None


def _write_stubs(name: str, stubs: tuple[str, ...]) -> None:
    if not stubs:
        return
    site = subprocess.run(
        [str(venv_python(name)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    for rel in stubs:
        path = Path(site) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_STUB_CLASS)


def _run(cmd: list[str], log) -> None:
    print("[venv] " + " ".join(cmd), file=log, flush=True)
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)


def main() -> int:
    """Create every peer venv (or the ones named on the command line); print each status."""
    names = sys.argv[1:] or list(PEER_ENVS)
    for name in names:
        err = ensure_venv(name)
        print(f"{name}: {'ok' if err is None else 'FAILED: ' + err}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
