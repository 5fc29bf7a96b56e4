"""``roxxel push`` and the uploads under it (issue 15): a store that never answers, Ctrl-C,
a target that is the dataset itself, a shard that vanishes mid-push, URLs that name no place.

Servers here listen on 127.0.0.1: a small HTTP server that speaks enough S3 for s3fs (every
object missing) and takes PUTs without ever answering them, until the test ends. No test
waits on the clock: a hang before the fix is caught by a generous bound (a subprocess's or a
thread's timeout), never by a speed assertion.
"""

from __future__ import annotations

import _thread
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import ClassVar

import pytest

import roxxel
from roxxel.errors import ConfigError, FormatError
from roxxel.format import upload
from roxxel.format.manifest import MANIFEST_NAME
from roxxel.format.remote import FetchPolicy, RemoteStore
from roxxel.format.upload import put_files, upload_dataset
from tests.test_remote_stops import CREDENTIALS, HELD_S, _write, serving

pytest.importorskip("fsspec")


@pytest.fixture
def local(tmp_path) -> Path:
    return _write(tmp_path / "ds")


class _Silent(BaseHTTPRequestHandler):
    """An S3 endpoint where no object exists (HEAD, GET: 404) and a PUT is never answered,
    not even with the "100 Continue" a client that sends ``Expect`` waits for: it is held
    until ``release``, as by a store (or a proxy before it) that stopped answering."""

    protocol_version = "HTTP/1.1"
    release = threading.Event()
    asked = threading.Event()
    puts: ClassVar[list[str]] = []

    def do_HEAD(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        body = b"<Error><Code>NoSuchKey</Code><Message>none</Message></Error>"
        self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def handle_expect_100(self) -> bool:  # http.server would answer "100 Continue" at once
        return True

    def do_PUT(self) -> None:
        _Silent.puts.append(self.path)
        _Silent.asked.set()
        _Silent.release.wait(HELD_S)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet."""


@pytest.fixture
def silent() -> Iterator[int]:
    pytest.importorskip("s3fs")
    _Silent.release, _Silent.asked, _Silent.puts = threading.Event(), threading.Event(), []
    with serving(_Silent) as port:
        try:
            yield port
        finally:
            _Silent.release.set()


def _push(local: Path, url: str, options: dict) -> list[str]:
    args = [str(local), url, "--storage-options", json.dumps(options), "-q"]
    return [sys.executable, "-m", "roxxel.cli", "push", *args]


# --- 1. a store that never answers a PUT ----------------------------------------------------


def test_issue15_push_to_a_store_that_never_answers_fails_after_the_read_timeouts(silent, local):
    """botocore sends a PUT with ``Expect: 100-continue`` and aiohttp starts the read timeout
    only once the body is out, which waits for the "100 Continue" that never comes: the push
    hung without limit (150+ s). Now the body goes at once, the read timeout bounds the wait
    for the answer, and the push fails after ``attempts`` of them, naming the object's URL."""
    options = {
        "endpoint_url": f"http://127.0.0.1:{silent}",
        "config_kwargs": {"read_timeout": 0.5},
    }
    done = subprocess.run(
        _push(local, "s3://bucket/ds", options),
        env={**os.environ, **CREDENTIALS},
        capture_output=True,
        text=True,
        timeout=120,  # the old push: never ended
    )
    err = done.stderr.strip()
    assert done.returncode == 1 and len(err.splitlines()) == 1, err
    assert err.startswith("roxxel push: error: s3://bucket/ds/shard-")
    assert "unreachable after 4 attempts (ReadTimeoutError: " in err
    assert MANIFEST_NAME not in "".join(_Silent.puts)  # the manifest never went up


# --- 2. Ctrl-C while uploads hang -----------------------------------------------------------


def test_issue15_ctrl_c_stops_a_push_whose_uploads_hang(silent, local, ctrl_c):
    """SIGINT ends ``roxxel push`` (exit 130, one line) while its PUTs wait for the store
    (read timeouts of minutes here): they are abandoned, not waited for. The old push joined
    its upload threads first, and printed "interrupted" only once the store answered."""
    options = {
        "endpoint_url": f"http://127.0.0.1:{silent}",
        "config_kwargs": {"read_timeout": 600},
    }
    child = subprocess.Popen(
        _push(local, "s3://bucket/ds", options),
        env={**os.environ, **CREDENTIALS},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert _Silent.asked.wait(60)
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)  # the old push: until the PUTs are answered
    finally:
        child.kill()
    assert child.returncode == 130 and err.strip() == "roxxel push: interrupted"
    assert not _Silent.release.is_set()
    assert MANIFEST_NAME not in "".join(_Silent.puts)


def test_issue15_ctrl_c_stops_put_files_while_an_upload_hangs(local, tmp_path, monkeypatch, ctrl_c):
    """`put_files` (what ``push`` and ``pack -o URL`` upload through) raises KeyboardInterrupt
    while an upload still hangs; its ``with ThreadPoolExecutor`` waited for the upload first."""
    started, release, ended = threading.Event(), threading.Event(), threading.Event()
    original = upload._put
    names = [e.path for e in roxxel.open_dataset(local).manifest.shards]

    def stalled(store, path, name, num_bytes) -> None:  # the first upload goes, then a hang
        if name != names[0]:
            started.set()
            release.wait(HELD_S)
            ended.set()
        original(store, path, name, num_bytes)

    monkeypatch.setattr(upload, "_put", stalled)
    store = RemoteStore(f"file://{tmp_path}/up")
    (tmp_path / "up").mkdir()
    files = [(n, (local / n).stat().st_size) for n in names]
    interrupt = threading.Thread(target=lambda: started.wait(HELD_S) and _thread.interrupt_main())
    interrupt.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            put_files(store, local, files, workers=1)  # the old one: until the upload ended
        assert started.is_set() and not ended.is_set()  # returned while the upload hangs
    finally:
        release.set()
        interrupt.join()


# --- 3. the target is the dataset's own folder ----------------------------------------------


@pytest.mark.parametrize("spelling", ["same", "link", "dotdot", "slash"])
def test_issue15_push_into_its_own_folder_is_refused_before_touching_it(
    local, tmp_path, capsys, spelling
):
    """``roxxel push ds file:///.../ds`` removed the local manifest (the "old one at the
    URL"), then failed after 4 tries of shutil's SameFileError taken for an outage: the
    dataset no longer opened. Now it is refused first, in one line naming both."""
    from roxxel.cli import main

    (tmp_path / "link").symlink_to(local)
    target = {
        "same": local,
        "link": tmp_path / "link",
        "dotdot": local / ".." / local.name,
        "slash": f"{local}/",
    }[spelling]
    before = roxxel.open_dataset(local).fingerprint
    assert main(["push", str(local), f"file://{target}", "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("roxxel push: error: ")
    assert str(local) in err and f"file://{target}" in err and "own folder" in err
    assert roxxel.open_dataset(local).fingerprint == before


def test_issue15_push_onto_a_hard_link_of_a_shard_is_no_outage(local, tmp_path):
    """The object at the URL is the local shard itself (a hard link): shutil's SameFileError
    was retried as an outage ("unreachable after 4 attempts"). It is a ConfigError at once."""
    target = tmp_path / "linked"
    target.mkdir()
    name = roxxel.open_dataset(local).manifest.shards[0].path
    os.link(local / name, target / name)
    with pytest.raises(ConfigError) as caught:
        upload_dataset(local, f"file://{target}", policy=FetchPolicy(attempts=4, backoff_s=0))
    told = str(caught.value)
    assert told.startswith(f"file://{target}/{name}: ") and "same file" in told
    assert str(local / name) in told and "unreachable" not in told


# --- 4. a local shard vanishes mid-push -----------------------------------------------------


def test_issue15_a_shard_deleted_mid_push_is_named_not_taken_for_a_missing_bucket(
    local, tmp_path, monkeypatch
):
    """A shard file deleted from DIR after the push checked it: put_file's FileNotFoundError
    (the local file's) was reported as ``<url>: nowhere to write it (expected an existing
    bucket ...)``. Now the local file is named, as M7 of a local dataset."""
    victim = local / roxxel.open_dataset(local).manifest.shards[1].path
    original = upload._make_folder

    def then_delete(*args) -> None:  # after the local dataset was opened, before any upload
        original(*args)
        victim.unlink()

    monkeypatch.setattr(upload, "_make_folder", then_delete)
    with pytest.raises(FormatError) as caught:
        upload_dataset(local, f"file://{tmp_path}/up", workers=1)
    told = str(caught.value)
    assert caught.value.rule == "M7" and told.startswith(f"{victim}: ")
    assert "bucket" not in told and "nowhere" not in told
    assert not (tmp_path / "up" / MANIFEST_NAME).exists()


# --- 5. URLs that name no place --------------------------------------------------------------


def test_issue15_push_refuses_a_url_as_dir(tmp_path, monkeypatch, capsys):
    """``roxxel push s3://a/ds s3://b/copy`` took the first URL for a local path and said
    ``s3:/a/ds/manifest.json: no manifest``."""
    from roxxel.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["push", "s3://bucket1/ds", "s3://bucket2/copy"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'s3://bucket1/ds' is a URL" in err
    assert "roxxel pull" in err and "no manifest" not in err


@pytest.mark.parametrize("url", ["s3://", "s3:///", "file://", "file:///"])
def test_issue15_push_refuses_a_url_without_a_bucket_or_folder(local, url, capsys):
    """``roxxel push ds s3://`` tried to write ``s3:/part-...`` and failed with botocore's
    ParamValidationError (after the manifest "at the URL" was looked for); ``file:///``
    would publish into the root folder. Refused first, naming the rule."""
    from roxxel.cli import main

    options = json.dumps({"endpoint_url": "http://127.0.0.1:9"})  # nothing listens
    assert main(["push", str(local), url, "--storage-options", options, "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"URL: {url!r}" in err
    assert "bucket or folder" in err


# --- 6. file URLs with a host, and stores that live in this process ----------------------------


def test_issue15_push_to_file_localhost_writes_the_absolute_path(local, tmp_path, monkeypatch):
    """``roxxel push ds file://localhost/<abs>`` wrote into ``./localhost/<abs>`` and said it
    uploaded: localhost is this machine, the dataset goes to ``<abs>``."""
    from roxxel.cli import main

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["push", str(local), f"file://localhost{tmp_path}/up", "-q"]) == 0
    assert (
        roxxel.open_dataset(tmp_path / "up").fingerprint == roxxel.open_dataset(local).fingerprint
    )
    assert os.listdir(work) == []
    assert upload_dataset(local, f"file://localhost{tmp_path}/api") > 0
    assert (tmp_path / "api" / MANIFEST_NAME).is_file() and os.listdir(work) == []


@pytest.mark.parametrize("url", ["file://dsB", "file://otherhost/up"])
def test_issue15_push_to_a_relative_file_url_or_another_host_is_refused(
    local, tmp_path, monkeypatch, capsys, url
):
    """``file://dsB`` pushed into the folder ``dsB`` of the working directory."""
    from roxxel.cli import main

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["push", str(local), url, "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"roxxel push: error: {url}: ")
    assert "expected file:///absolute/path" in err and os.listdir(work) == []
    with pytest.raises(ConfigError, match="expected file:///absolute/path"):
        upload_dataset(local, url)
    assert os.listdir(work) == []


def test_issue15_push_to_a_store_in_this_process_is_refused(local, capsys):
    """``roxxel push ds memory://mm/ds`` said it uploaded: a memory:// store lives in the
    process, so the dataset was gone when the command ended. The CLI refuses it; the
    Python API, where such a store is of use, still takes it."""
    import fsspec

    from roxxel.cli import main

    url = "memory://me:PW@mm/ds"
    assert main(["push", str(local), url, "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "PW" not in err
    assert err.startswith("roxxel push: error: URL: 'memory://***@mm/ds'")
    assert "only in this process" in err
    memory = fsspec.filesystem("memory")
    assert not memory.exists("/me:PW@mm/ds") and not memory.exists("/mm/ds")
    assert upload_dataset(local, "memory://roxxel-push-api/ds") > 0
    opened = roxxel.open_dataset("memory://roxxel-push-api/ds", cache_dir=local.parent / "c")
    assert opened.fingerprint == roxxel.open_dataset(local).fingerprint
