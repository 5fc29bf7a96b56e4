"""No password of a URL and no storage option value shows in what roxxel raises or prints.

docs/remote.md promises that ``https://me:pw@host/ds`` reads ``https://***@host/ds`` in an
error's message, its ``path`` and the whole printed traceback (causes included), that storage
options never show in a repr or an error, and the CLI's lines follow. Servers here listen on
127.0.0.1 only: a small HTTP server that answers ranged GETs from a local folder, and a
socket that is bound but never listens (every connection to it is refused at once).
"""

from __future__ import annotations

import socket
import threading
import traceback
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

import roxxel
from roxxel.errors import FormatError, without_credentials
from roxxel.format.cache import CacheConfig, ShardCache
from roxxel.format.dataset import Dataset
from roxxel.format.remote import FetchPolicy, RemoteStore
from roxxel.format.upload import upload_dataset

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

PASSWORD = "SUPERSECRETPW"
FAST = FetchPolicy(attempts=2, backoff_s=0.0)


class _Folder(SimpleHTTPRequestHandler):
    """GET (with one ``Range: bytes=a-b``) and HEAD of the files of its ``directory``."""

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        status, ranged = 200, self.headers.get("Range")
        if ranged is not None:
            first, _, last = ranged.removeprefix("bytes=").partition("-")
            stop = len(data) if not last else int(last) + 1
            data, status = data[int(first) : stop], 206
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the test reads what roxxel prints."""


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """(URL of a dataset with a password in it, the local dataset) over HTTP on 127.0.0.1."""
    root = tmp_path_factory.mktemp("served")
    schema = {"tokens": "int32[]", "label": "int64"}
    with roxxel.DatasetWriter(root / "ds", schema, shard_bytes=1200) as writer:
        for i in range(60):
            writer.write({"tokens": np.arange(i % 23, dtype=np.int32), "label": i})
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Folder, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://me:{PASSWORD}@127.0.0.1:{server.server_address[1]}/ds", root / "ds"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A port on 127.0.0.1 bound and not listening: each connection is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def _shown(error: BaseException) -> str:
    """Everything a log gets of ``error``: the printed traceback (causes and contexts)."""
    return "".join(traceback.format_exception(error)) + repr(error)


def test_an_unreachable_url_raises_a_connection_error_without_its_password(refused_port, tmp_path):
    url = f"http://me:{PASSWORD}@127.0.0.1:{refused_port}/ds"
    config = CacheConfig(url, tmp_path, policy=FAST)
    with pytest.raises(ConnectionError) as caught:  # an OSError still: `except OSError` holds
        Dataset(url, cache=ShardCache(config))
    assert PASSWORD not in _shown(caught.value)
    text = str(caught.value)
    assert f"http://***@127.0.0.1:{refused_port}/ds/manifest.json: unreachable" in text
    assert "ClientConnectorError" in text  # what failed, still said


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ({}, "NewConnectionError: Connection refused"),  # a signed GET (roxxel.format.direct)
        ({"config_kwargs": {"proxies": {}}}, "EndpointConnectionError"),  # through s3fs
    ],
    ids=["signed-get", "s3fs"],
)
def test_an_unreachable_endpoint_in_storage_options_never_shows_in_the_traceback(
    refused_port, tmp_path, monkeypatch, extra, said
):
    """botocore's error (the cause) printed the endpoint, a storage option, in full."""
    pytest.importorskip("s3fs")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    options = {"endpoint_url": f"http://127.0.0.1:{refused_port}/SUPERSECRETPATH", **extra}
    config = CacheConfig("s3://bucket/ds", tmp_path, options, policy=FAST)
    with pytest.raises(ConnectionError) as caught:
        Dataset("s3://bucket/ds", cache=ShardCache(config))
    assert "SUPERSECRETPATH" not in _shown(caught.value)
    text = str(caught.value)
    assert "s3://bucket/ds/manifest.json: unreachable" in text
    assert said in text  # what failed, still said
    if not extra:  # nor the signed URL: its signature, its key id
        assert "Signature" not in _shown(caught.value) and "Credential" not in _shown(caught.value)
    else:
        assert "<storage_options endpoint_url>" in text


def test_a_failed_upload_raises_a_connection_error_without_the_password(served, refused_port):
    _, local = served
    url = f"http://me:{PASSWORD}@127.0.0.1:{refused_port}/up"
    with pytest.raises(ConnectionError) as caught:
        upload_dataset(local, url, policy=FAST)
    assert PASSWORD not in _shown(caught.value)
    assert f"http://***@127.0.0.1:{refused_port}/up" in str(caught.value)


def test_a_missing_object_is_a_file_not_found_error_without_the_password(served):
    url, _ = served
    with pytest.raises(FileNotFoundError) as caught:
        RemoteStore(url, policy=FAST).read("no-such-object")
    assert PASSWORD not in _shown(caught.value)
    assert "http://***@127.0.0.1" in str(caught.value)


def test_a_missing_shard_is_m7_and_no_error_in_its_chain_holds_the_password(served, tmp_path):
    url, local = served
    broken = local.parent / "broken"
    broken.mkdir()
    for item in local.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    victim = roxxel.open_dataset(local).manifest.shards[1].path
    (broken / victim).unlink()
    dataset = roxxel.open_dataset(url.replace("/ds", "/broken"), cache_dir=tmp_path)
    with pytest.raises(FormatError) as caught:
        dataset[int(dataset.shard_starts[1])]
    assert caught.value.rule == "M7"
    error: BaseException | None = caught.value
    while error is not None:  # a logger may walk __context__ even when it is not printed
        assert PASSWORD not in str(error) and PASSWORD not in repr(error)
        error = error.__cause__ or error.__context__


def test_the_repr_of_a_dataset_and_its_store_mask_the_password(served, tmp_path):
    url, _ = served
    dataset = roxxel.open_dataset(url, cache_dir=tmp_path)
    assert dataset.url == url  # the caller's own value, as given
    assert PASSWORD not in repr(dataset) and "http://***@127.0.0.1" in repr(dataset)
    store = RemoteStore(url, {"secret": "hunter22"})
    assert PASSWORD not in repr(store) and "hunter22" not in repr(store)
    assert dataset.cache is not None
    shown = repr(dataset.cache) + repr(dataset.cache.config)
    assert PASSWORD not in shown and "http://***@127.0.0.1" in shown


def test_an_index_out_of_range_names_the_url_without_its_password(served, tmp_path):
    url, _ = served
    dataset = roxxel.open_dataset(url, cache_dir=tmp_path)
    with pytest.raises(IndexError) as caught:
        dataset[len(dataset)]
    assert PASSWORD not in _shown(caught.value) and "http://***@127.0.0.1" in str(caught.value)


@pytest.mark.parametrize("command", [["info"], ["info", "--json"], ["verify", "--workers", "1"]])
def test_the_cli_prints_no_password_of_a_url_it_read(served, tmp_path, capsys, command):
    from roxxel.cli import main

    url, _ = served
    assert main([command[0], url, "--cache-dir", str(tmp_path), *command[1:]]) == 0
    out, err = capsys.readouterr()
    assert PASSWORD not in out + err and "http://***@127.0.0.1" in out


def test_an_upload_the_server_holds_short_raises_without_the_password(served, monkeypatch):
    _, local = served
    monkeypatch.setattr(RemoteStore, "size", lambda self, name: 1)  # the server lost bytes
    with pytest.raises(ConnectionError) as caught:
        upload_dataset(local, f"memory://me:{PASSWORD}@host/short", workers=1, policy=FAST)
    assert PASSWORD not in _shown(caught.value)
    assert "memory://***@host/short/" in str(caught.value) and "holds 1 bytes" in str(caught.value)


def test_push_prints_no_password_of_its_url(served, capsys):
    from roxxel.cli import main

    _, local = served
    # refused (a memory:// store dies with the command), naming the URL without its password
    assert main(["push", str(local), f"memory://me:{PASSWORD}@host/pushed", "-q"]) == 1
    out, err = capsys.readouterr()
    assert PASSWORD not in out + err and "memory://***@host/pushed" in err


@pytest.mark.parametrize(
    ("url", "secret"),
    [
        ("http://me:PW@SECRET@127.0.0.1:5555/bucket1/ds", "SECRET"),  # a raw '@' in it
        ("http://me:SEC/RET@127.0.0.1:1/ds/manifest.json", "RET"),  # a raw '/' in it
        ("http://TO@KEN@127.0.0.1/ds", "KEN"),  # a token as the user, with an '@'
        ("https://me:s3cret@host/ds", "s3cret"),
    ],
)
def test_issue15_no_part_of_a_password_with_an_at_or_a_slash_is_shown(url, secret):
    """A password holding a raw '@' showed from it on (`http://***@SECRET@...`): URL
    parsers end the user part at the last '@'; one holding a '/' showed whole."""
    shown = without_credentials(f"{url}: unreachable after 4 attempts")
    assert (
        secret not in shown and "***@" in shown and shown.endswith(": unreachable after 4 attempts")
    )
    assert repr(RemoteStore(url)).count(secret) == 0


def test_issue15_an_at_in_a_path_is_not_taken_for_a_password():
    assert without_credentials("s3://bucket/key@v1.rxs: M7") == "s3://bucket/key@v1.rxs: M7"
