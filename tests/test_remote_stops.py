"""Stopping while a download is in flight (issue 15): Ctrl-C and ``Loader.close`` do not wait
for it, and a store that accepts connections and never answers fails after s3fs's timeouts.

A download that nobody waits for any more is abandoned, not joined: it ends in its own thread
(or with the process) and never publishes a shard that was not checked. Servers here listen
on 127.0.0.1: a small HTTP server that answers ranged GETs from a local folder the way S3
answers a signed URL, holding back the shards' bodies while the test says so.
"""

from __future__ import annotations

import _thread
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from socketserver import BaseRequestHandler

import numpy as np
import pytest

import roxxel
from roxxel.format.manifest import MANIFEST_NAME
from roxxel.format.remote import FetchPolicy, RemoteStore

pytest.importorskip("fsspec")

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
NUM_RECORDS = 200
HELD_S = 60  # how long a held-back body waits at most (the test ends long before)


def _write(path: Path) -> Path:
    with roxxel.DatasetWriter(path, {"tokens": "int32[]"}, shard_bytes=1 << 12) as writer:
        for i in range(NUM_RECORDS):
            writer.write({"tokens": np.arange(i % 17, dtype=np.int32) + i})
    return path


@pytest.fixture
def local(tmp_path) -> Path:
    return _write(tmp_path / "bucket" / "ds")


@pytest.fixture
def stalled(monkeypatch) -> Iterator[tuple[threading.Event, threading.Event, threading.Event]]:
    """Downloads (reads outside the main thread) that hang until ``release``: the events
    (``started``, ``release``, ``finished``) of the first to start and to end."""
    started, release, finished = threading.Event(), threading.Event(), threading.Event()
    original = RemoteStore.read_into

    def read_into(self, *args):
        if threading.current_thread() is not threading.main_thread():
            started.set()
            release.wait(HELD_S)
        try:
            return original(self, *args)
        finally:
            finished.set()

    monkeypatch.setattr(RemoteStore, "read_into", read_into)
    try:
        yield started, release, finished
    finally:
        release.set()


# --- Loader.close and Ctrl-C in Python --------------------------------------------------------


def test_issue15_ctrl_c_while_the_loader_waits_for_a_download_stops_at_once(
    local, tmp_path, stalled, ctrl_c
):
    """The pipeline thread waits for the download of its batch's shard; Ctrl-C closes the
    loader (``with``), and the close returns while that download still hangs (it took 4 read
    timeouts before: minutes)."""
    from roxxel.loader.loader import Loader, LoaderConfig

    started, release, finished = stalled
    dataset = roxxel.open_dataset(f"file://{local}", cache_dir=tmp_path / "cache")
    config = LoaderConfig(max_len={"tokens": 32})
    ctrl_c = threading.Thread(target=lambda: started.wait(HELD_S) and _thread.interrupt_main())
    ctrl_c.start()
    try:
        with pytest.raises(KeyboardInterrupt), Loader(dataset, 8, config=config) as loader:
            next(iter(loader))
        assert started.is_set() and not finished.is_set()  # closed while the download hangs
    finally:
        release.set()
        ctrl_c.join()
    assert loader._prefetcher is None  # closed: its threads joined
    expected = [list(range(i, i + i % 17)) for i in range(NUM_RECORDS)]
    assert [dataset[i]["tokens"].tolist() for i in range(NUM_RECORDS)] == expected


# --- roxxel pull: Ctrl-C, and a store that never answers ------------------------------------


class _Bucket(SimpleHTTPRequestHandler):
    """Ranged GETs of the files under its ``directory`` (``/<bucket>/<key>?<signature>``, as
    a signed S3 URL reads); a shard's body waits for ``release`` (the manifest's does not)."""

    protocol_version = "HTTP/1.1"
    release = threading.Event()
    asked = threading.Event()

    def do_GET(self) -> None:
        path = Path(self.translate_path(self.path.split("?", 1)[0]))
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        first, _, last = self.headers["Range"].removeprefix("bytes=").partition("-")
        data = data[int(first) : int(last) + 1]
        if path.name != MANIFEST_NAME:
            _Bucket.asked.set()
            if not _Bucket.release.wait(HELD_S):
                return
        self.send_response(206)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet."""


@pytest.fixture
def bucket(local) -> Iterator[int]:
    pytest.importorskip("s3fs")
    _Bucket.release, _Bucket.asked = threading.Event(), threading.Event()
    with serving(partial(_Bucket, directory=str(local.parent.parent))) as port:
        try:
            yield port
        finally:
            _Bucket.release.set()


@contextlib.contextmanager
def serving(handler: Callable[..., BaseRequestHandler]) -> Iterator[int]:
    """An HTTP server on 127.0.0.1 answering with ``handler``: its port, while inside."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_issue15_ctrl_c_stops_a_pull_whose_downloads_hang(bucket, tmp_path, ctrl_c):
    """SIGINT ends ``roxxel pull`` (exit 130, one line) while its downloads still wait for
    the store (read timeouts of minutes here): they are abandoned, not waited for."""
    options = {"endpoint_url": f"http://127.0.0.1:{bucket}", "config_kwargs": {"read_timeout": 600}}
    pull = [
        "pull",
        "s3://bucket/ds",
        str(tmp_path / "dir"),
        "--storage-options",
        json.dumps(options),
    ]
    child = subprocess.Popen(
        [sys.executable, "-m", "roxxel.cli", *pull],
        env={**os.environ, **CREDENTIALS},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert _Bucket.asked.wait(60)
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)  # the old pull: 4 x 600 s
    finally:
        child.kill()
    assert child.returncode == 130 and err.strip() == "roxxel pull: interrupted"
    assert not _Bucket.release.is_set()
    assert not [n for n in os.listdir(tmp_path / "dir") if not n.startswith(".")]


def test_issue15_a_store_that_never_answers_fails_after_s3fs_read_timeouts(
    bucket, local, tmp_path, monkeypatch
):
    """A shard GET whose answer never comes fails after ``attempts`` of s3fs's read timeout
    (``S3FileSystem.read_timeout``, what docs/remote.md says), not after roxxel's own 60 s."""
    import s3fs

    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(s3fs.S3FileSystem, "read_timeout", 0.5)
    dataset = roxxel.open_dataset(
        "s3://bucket/ds",
        cache_dir=tmp_path / "cache",
        storage_options={"endpoint_url": f"http://127.0.0.1:{bucket}"},
    )
    assert dataset.cache is not None and dataset.cache.store._direct is not None
    dataset.cache.store.policy = FetchPolicy(attempts=2, backoff_s=0.0)
    failed: list[BaseException] = []

    def read() -> None:
        try:
            dataset[0]
        except ConnectionError as exc:
            failed.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(30)  # the old reads: 2 x 60 s
    assert failed and str(failed[0]).startswith("s3://bucket/ds/shard-")
    # the kind and first line of the last failure, as docs/remote.md says, no URL in them
    assert "unreachable after 2 attempts (ReadTimeoutError: Read timed out." in str(failed[0])
    assert "Outage" not in str(failed[0]) and "X-Amz" not in str(failed[0])


def test_issue15_a_store_gone_after_open_names_the_refused_connection(local, tmp_path, monkeypatch):
    """The store goes away between the manifest and a shard: the error after the tries says
    what the last one met (the connection refused), in the words docs/remote.md shows."""
    pytest.importorskip("s3fs")
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    closing = type("Closing", (_Bucket,), {"protocol_version": "HTTP/1.0"})  # no kept socket
    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), partial(closing, directory=str(local.parent.parent))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Bucket.release.set()
    dataset = roxxel.open_dataset(
        "s3://bucket/ds",
        cache_dir=tmp_path / "cache",
        storage_options={"endpoint_url": f"http://127.0.0.1:{server.server_address[1]}"},
    )
    server.shutdown()
    server.server_close()
    assert dataset.cache is not None and dataset.cache.store._direct is not None
    dataset.cache.store.policy = FetchPolicy(attempts=2, backoff_s=0.0)
    with pytest.raises(ConnectionError) as failed:
        dataset[0]
    told = str(failed.value)
    assert told.startswith("s3://bucket/ds/shard-") and "Outage" not in told
    assert "unreachable after 2 attempts (NewConnectionError: Connection refused, expected" in told


def test_issue15_pull_into_a_file_is_one_line_saying_dir_is_not_a_folder(tmp_path, capsys):
    from roxxel.cli import main

    target = tmp_path / "afile"
    target.write_text("mine")
    assert main(["pull", "file:///nowhere/ds", str(target)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert str(target) in err and "not a folder" in err
    assert target.read_text() == "mine"


def test_issue15_a_child_forked_while_a_download_runs_fetches_that_shard_once_it_ends(
    local, tmp_path, monkeypatch
):
    """The download's fetch lock is the parent's: a child forked while it runs (one a
    stopped Loader left, say) waits for it like any process, then gets the shard; its copy
    of the lock's descriptor held the lock for ever before."""
    from roxxel.format.cache import CacheConfig, ShardCache

    parent, started, release = os.getpid(), threading.Event(), threading.Event()
    original = RemoteStore.read_into

    def stalled(self, *args):
        if os.getpid() == parent:
            started.set()
            release.wait(HELD_S)
        return original(self, *args)

    monkeypatch.setattr(RemoteStore, "read_into", stalled)
    cache = ShardCache(CacheConfig(f"file://{local}", tmp_path / "cache"))
    entry = cache.read_manifest().shards[0]
    cache.prefetch([entry])
    assert started.wait(HELD_S)
    pid = os.fork()
    if pid == 0:  # the child: fetches the shard once the parent's download let go of it
        signal.alarm(30)
        os._exit(0 if cache.fetch(entry).is_file() else 1)
    release.set()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    cache.wait()


def test_issue15_ctrl_c_stops_a_verify_whose_workers_download(bucket, tmp_path, ctrl_c):
    """SIGINT ends ``roxxel verify URL --workers 2`` (exit 130, one line) while its worker
    processes wait for the store: they are stopped with it, not waited for (the old verify
    ended only when their downloads did)."""
    options = {"endpoint_url": f"http://127.0.0.1:{bucket}", "config_kwargs": {"read_timeout": 600}}
    verify = ["verify", "s3://bucket/ds", "--workers", "2", "--cache-dir", str(tmp_path / "c")]
    child = subprocess.Popen(
        [sys.executable, "-m", "roxxel.cli", *verify, "--storage-options", json.dumps(options)],
        env={**os.environ, **CREDENTIALS},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert _Bucket.asked.wait(60)
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=60)  # the old verify: until the GETs end
    finally:
        child.kill()
    assert child.returncode == 130 and err.strip() == "roxxel verify: interrupted"
    assert out == "" and not _Bucket.release.is_set()
    _Bucket.release.set()  # the store answers again: the next verify checks every shard
    again = subprocess.run(
        [sys.executable, "-m", "roxxel.cli", *verify, "--storage-options", json.dumps(options)],
        env={**os.environ, **CREDENTIALS},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0 and again.stdout.strip().endswith("OK (200 records in 2 shards)")


def test_issue15_sigterm_while_fit_waits_for_a_download_saves_and_returns_at_once(
    local, tmp_path, stalled
):
    """A preemption notice (SIGTERM) gives a run seconds: `fit` waiting for a batch whose
    shard hangs on the store stops that wait, saves the step before it (model and loader
    together) and returns "preempted", while the download still hangs (it waited for the
    download before: up to the store's timeouts, past the notice)."""
    import jax.numpy as jnp

    from roxxel.loader.loader import Loader, LoaderConfig
    from roxxel.train.checkpoint import CheckpointConfig, Checkpointer
    from roxxel.train.loop import TrainConfig, fit

    started, release, finished = stalled
    dataset = roxxel.open_dataset(f"file://{local}", cache_dir=tmp_path / "cache")
    loader = Loader(dataset, 8, config=LoaderConfig(max_len={"tokens": 32}))

    def step(state, batch):
        return {"n": state["n"] + 1}, jnp.sum(batch["tokens"]).astype(jnp.float32)

    notice = threading.Thread(
        target=lambda: started.wait(HELD_S) and os.kill(os.getpid(), signal.SIGTERM)
    )
    notice.start()
    try:
        config = TrainConfig(num_steps=5, out_dir=tmp_path / "run", console=False)
        result = fit(step, {"n": jnp.zeros((), jnp.int32)}, loader, config=config)
        assert started.is_set() and not finished.is_set()  # returned while the GET hangs
    finally:
        release.set()
        notice.join()
        loader.close()
    assert (result.status, result.step) == ("preempted", 0)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with Checkpointer(CheckpointConfig(result.checkpoint_dir)) as saved:
        assert saved.latest_step() == 0
        restored = saved.restore({"n": jnp.zeros((), jnp.int32)})
    fresh = Loader(dataset, 8, config=LoaderConfig(max_len={"tokens": 32}))
    assert int(restored.state["n"]) == 0 and restored.loader_state == fresh.state()
