"""``roxxel pack -o URL`` by several tasks, and ``--cache-dir`` for the commands that open a URL
(issue 15), against moto's S3 API server on 127.0.0.1 (through s3fs) and fsspec's ``file://``.

Tasks run as real processes, each with its own staging folder (machines that share no disk):
they agree on the plan at the URL, upload each unit's shards and then its marker, and the last
task to end writes the manifest, which matches a local one-task pack byte for byte. A task
killed mid-upload leaves nothing that opens; ``--finalize`` then names the missing units and
their task; a rerun completes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import roxxel
from roxxel.errors import ConfigError, FormatError
from roxxel.format.remote import RemoteStore
from roxxel.ingest.parts import PackSpec, finalize_remote
from tests.test_remote import CREDENTIALS, S3Server, _labels, _write

BUCKET = "roxxel-pack"
NUM_FILES = 4
NUM_LINES = 40  # per file
# not in name order: the manifests keep the order given, as the shards do
PACK_FLAGS = ["--field", "tokens:int32[]", "--field", "label:int64"]
SIZES = ["--unit-bytes", "1K", "--shard-bytes", "700"]  # several units, several shards each


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    with pytest.MonkeyPatch.context() as patch:
        for key, value in CREDENTIALS.items():
            patch.setenv(key, value)
        server = S3Server(moto_server)
        server.fs.mkdir(BUCKET)
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("inputs")
    paths = []
    for f in range(NUM_FILES):
        rows = [
            {"label": f * NUM_LINES + i, "tokens": list(range(i % 11))} for i in range(NUM_LINES)
        ]
        path = folder / f"part-{f}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def reference(inputs, tmp_path_factory) -> Path:
    """The same inputs packed by one local task: what every remote pack must equal."""
    from roxxel.cli import main

    out = tmp_path_factory.mktemp("reference") / "ds"
    assert main(["pack", *inputs, "-o", str(out), *PACK_FLAGS, *SIZES, "-q"]) == 0
    dataset = roxxel.open_dataset(out)
    assert len(dataset.manifest.shards) > 4
    # a local pack wrote its manifest's fields in name order (its plan.json sorted them),
    # unlike its shards and a remote pack: another fingerprint for the same data
    assert list(dataset.schema.to_json()) == ["tokens", "label"]
    assert list(dataset.shard(0).schema.to_json()) == ["tokens", "label"]
    return out


def _task_args(
    inputs, url, s3, task: int, num_tasks: int, stage: Path, workers: int = 1
) -> list[str]:
    return [
        "pack", *inputs, "-o", url, *PACK_FLAGS, *SIZES, "--num-tasks", str(num_tasks),
        "--task-index", str(task), "--storage-options", json.dumps(s3.options),
        "--cache-dir", str(stage), "--workers", str(workers),
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, **CREDENTIALS}


def _run_task(args: list[str], script: str = "") -> subprocess.Popen:
    code = script + "\nimport sys\nfrom roxxel.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )


def _cat(s3, path: str) -> bytes:
    s3.fs.invalidate_cache()  # s3fs answers sizes from its listing cache: the tasks wrote since
    return s3.fs.cat_file(path)


def _assert_equals_reference(s3, prefix: str, reference: Path, cache: Path) -> None:
    """The manifest and every shard at ``s3://prefix`` are the reference's bytes."""
    manifest = _cat(s3, f"{prefix}/manifest.json")
    assert manifest == (reference / "manifest.json").read_bytes()
    for shard in json.loads(manifest)["shards"]:
        assert _cat(s3, f"{prefix}/{shard['path']}") == (reference / shard["path"]).read_bytes()
    opened = roxxel.open_dataset(f"s3://{prefix}", cache_dir=cache, storage_options=s3.options)
    assert _labels(opened) == _labels(roxxel.open_dataset(reference))
    assert opened.fingerprint == roxxel.open_dataset(reference).fingerprint


def test_issue15_remote_pack_two_task_processes_equal_a_local_one_task_pack(
    s3, inputs, reference, tmp_path
):
    prefix = f"{BUCKET}/two-tasks"
    url = f"s3://{prefix}"
    tasks = [
        _run_task(_task_args(inputs, url, s3, task, 2, tmp_path / f"machine-{task}", 2 - task))
        for task in range(2)  # task 0 with a worker process beside it
    ]
    outputs = [t.communicate(timeout=120) for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], outputs
    assert any("manifest written" in out for out, _ in outputs)  # the last task to end
    _assert_equals_reference(s3, prefix, reference, tmp_path / "read")
    for task in range(2):  # each machine's staging folder is gone once its units are up
        assert not list((tmp_path / f"machine-{task}" / "staging").iterdir())
    # finalizing a finished pack again, or rerunning a task, changes nothing
    again = _run_task([*_task_args(inputs, url, s3, 0, 2, tmp_path / "x"), "--finalize"])
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0 and "already packed" in out, err


_KILLED_AFTER_ONE_SHARD = """
import threading
from roxxel.format import upload

put = upload._put
def stalled(store, local, name, num_bytes):
    put(store, local, name, num_bytes)
    print("uploaded", flush=True)  # one shard of a unit is on the server: hang until killed
    threading.Event().wait()
upload._put = stalled
"""


def test_issue15_remote_pack_task_killed_mid_upload_never_opens_and_a_rerun_completes(
    s3, inputs, reference, tmp_path
):
    from roxxel.cli import build_parser, main
    from roxxel.cli.pack import cmd_pack

    prefix = f"{BUCKET}/killed"
    url = f"s3://{prefix}"
    stage0, stage1 = tmp_path / "machine-0", tmp_path / "machine-1"
    killed = _run_task([*_task_args(inputs, url, s3, 0, 2, stage0), "-q"], _KILLED_AFTER_ONE_SHARD)
    assert killed.stdout is not None and killed.stdout.readline() == "uploaded\n"
    os.kill(killed.pid, signal.SIGKILL)
    killed.communicate()
    assert s3.fs.ls(prefix)  # a shard and the plan are there, no marker of task 0, no manifest
    assert not s3.fs.exists(f"{prefix}/.roxxel-pack/unit-000000.json")
    with pytest.raises(FormatError) as caught:
        roxxel.open_dataset(url, cache_dir=tmp_path / "read", storage_options=s3.options)
    assert caught.value.rule == "M1"

    other = _run_task(_task_args(inputs, url, s3, 1, 2, stage1))
    out, err = other.communicate(timeout=120)
    assert other.returncode == 0 and "to come" in out, err
    s3.fs.invalidate_cache()
    assert not s3.fs.exists(f"{prefix}/manifest.json")  # task 0's units are missing

    finalize = [*_task_args(inputs, url, s3, 0, 2, tmp_path / "x"), "--finalize"]
    with pytest.raises(ConfigError) as refused:  # the library's error, as the CLI prints it
        cmd_pack(build_parser().parse_args(finalize))
    message = str(refused.value)
    assert refused.value.path == url
    assert "units 0, 2" in message and "of tasks 0 of --num-tasks 2" in message
    assert main(finalize) == 1
    s3.fs.invalidate_cache()
    assert not s3.fs.exists(f"{prefix}/manifest.json")

    rerun = _run_task(_task_args(inputs, url, s3, 0, 2, stage0))  # the same machine resumes
    out, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 0 and "manifest written" in out, err
    _assert_equals_reference(s3, prefix, reference, tmp_path / "read")


def test_issue15_remote_pack_finalize_refuses_a_damaged_shard_and_a_rerun_repacks_it(
    s3, inputs, reference, tmp_path
):
    from roxxel.cli import main

    prefix = f"{BUCKET}/damaged"
    url = f"s3://{prefix}"
    args = _task_args(inputs, url, s3, 0, 1, tmp_path / "stage")
    assert main([*args, "-q"]) == 0
    name = json.loads(_cat(s3, f"{prefix}/manifest.json"))["shards"][3]["path"]
    data = bytearray(_cat(s3, f"{prefix}/{name}"))
    data[-1] ^= 0xFF  # the trailer's magic: the shard no longer matches its unit's marker
    s3.fs.pipe_file(f"{prefix}/{name}", bytes(data))
    s3.fs.rm_file(f"{prefix}/manifest.json")
    store = RemoteStore(url, s3.options)
    plan_doc = json.loads(_cat(s3, f"{prefix}/.roxxel-pack/plan.json"))
    plan = PackSpec.from_json(plan_doc, Path("plan.json"))
    with pytest.raises(ConfigError, match=r"1 of \d+ work units not packed or damaged"):
        finalize_remote(store, plan)
    assert main([*args, "-q"]) == 0  # the unit is packed and uploaded again, then finalized
    _assert_equals_reference(s3, prefix, reference, tmp_path / "read")


def test_issue15_remote_pack_refuses_another_pack_at_the_url_unless_overwrite(
    s3, inputs, tmp_path, capsys
):
    from roxxel.cli import main

    url = f"s3://{BUCKET}/other"
    args = _task_args(inputs[:1], url, s3, 0, 1, tmp_path / "stage")
    assert main([*args, "-q"]) == 0
    more = _task_args(inputs, url, s3, 0, 1, tmp_path / "stage")
    assert main([*more, "-q"]) == 1
    assert "holds a dataset made otherwise" in capsys.readouterr().err
    assert main([*more, "-q", "--overwrite"]) == 0
    opened = roxxel.open_dataset(url, cache_dir=tmp_path / "read", storage_options=s3.options)
    assert len(opened) == NUM_FILES * NUM_LINES


def test_issue15_remote_pack_finalize_before_any_task_is_refused(inputs, tmp_path, capsys):
    from roxxel.cli import main

    url = f"file://{tmp_path}/nothing-yet"
    args = ["pack", *inputs, "-o", url, *PACK_FLAGS, "--num-tasks", "2", "--finalize"]
    assert main(args) == 1
    assert f"{url}: no pack plan" in capsys.readouterr().err
    assert not (tmp_path / "nothing-yet").exists()  # --finalize writes nothing


def test_issue15_remote_pack_storage_options_need_a_url(inputs, tmp_path, capsys):
    from roxxel.cli import main

    args = ["pack", inputs[0], "-o", str(tmp_path / "ds"), "--storage-options", "{}"]
    assert main(args) == 2
    assert "expected -o URL" in capsys.readouterr().err


# --- --cache-dir ------------------------------------------------------------------------------


def test_issue15_cache_dir_flag_puts_fetched_shards_where_the_user_says(
    tmp_path, monkeypatch, capsys
):
    from roxxel.cli import main

    local = _write(tmp_path / "ds")
    url = f"file://{local}"
    default, chosen = tmp_path / "default", tmp_path / "chosen"
    monkeypatch.setenv("ROXXEL_CACHE_DIR", str(default))
    num_shards = len(roxxel.open_dataset(local).manifest.shards)

    def cached() -> list[str]:
        return sorted(
            p.name for p in chosen.glob("*/*.rxs") if not p.name.startswith(".")
        )  # the dataset's folder in the cache

    assert main(["cat", url, "0", "--json", "--cache-dir", str(chosen)]) == 0
    assert json.loads(capsys.readouterr().out)["label"] == 0
    assert len(cached()) == 1
    assert main(["verify", url, "--workers", "2", "--cache-dir", str(chosen)]) == 0
    assert "OK" in capsys.readouterr().out
    assert len(cached()) == num_shards  # the worker processes fetched into it too
    assert main(["info", url, "--json", "--cache-dir", str(chosen)]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == url
    toml = tmp_path / "mix.toml"
    toml.write_text(
        f'batch_size = 4\n[sources.web]\npath = "{url}"\n[sources.here]\npath = "{local}"\n'
        "[[phases]]\nweights = { web = 1, here = 1 }\n"
    )
    assert main(["plan", str(toml), "--steps", "3", "--cache-dir", str(chosen)]) == 0
    assert "web" in capsys.readouterr().out
    peek = ["peek", url, "--step", "0", "--batch-size", "4", "--rows", "1", "--json"]
    assert main([*peek, "--cache-dir", str(chosen)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    assert not default.exists()  # nothing went to $ROXXEL_CACHE_DIR
    assert main(["info", str(local), "--cache-dir", str(chosen)]) == 0  # a local DIR: read in place


def test_issue15_remote_pack_rerun_counts_the_units_the_url_holds(tmp_path, capsys):
    """A rerun of a task whose units are at the URL says so (it once reported them as
    neither packed nor kept)."""
    from roxxel.cli import main

    src = tmp_path / "numbers.jsonl"
    src.write_text("".join(f'{{"label": {i}}}\n' for i in range(200)))
    url = f"file://{tmp_path / 'out'}"
    args = ["pack", str(src), "-o", url, "--unit-bytes", "512", "--num-tasks", "2"]
    args += ["--task-index", "0", "--cache-dir", str(tmp_path / "scratch")]
    assert main(args) == 0
    first = capsys.readouterr().out
    summary = next(line for line in first.splitlines() if line.startswith("packed "))
    units = int(summary.split(" from ")[1].split(" work units")[0])
    assert units > 1
    assert main(args) == 0
    assert f"; {units} more work units were at the URL already" in capsys.readouterr().out


@pytest.mark.parametrize("url", ["s3://", "s3:///", "file://"])
def test_issue15_remote_pack_to_a_url_naming_no_place_is_refused(
    inputs, url, tmp_path, monkeypatch, capsys
):
    """`pack -o s3://` asked for `s3:/.roxxel-pack/plan.json`; `-o file:///` packed into the
    root folder (`/part-000000-0000.rxs`, `/.roxxel-pack/`), `file://` into the working one."""
    from roxxel.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["pack", inputs[0], "-o", url, *PACK_FLAGS]) in (1, 2)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "names no bucket or folder" in err, err
    assert os.listdir(tmp_path) == []


def test_issue15_remote_pack_to_a_store_in_this_process_is_refused(
    inputs, tmp_path, monkeypatch, capsys
):
    """``roxxel pack numbers.jsonl -o memory://mm/n`` said it packed: the store lived in the
    process and was gone when the command ended."""
    import fsspec

    from roxxel.cli import main

    monkeypatch.chdir(tmp_path)
    cache = str(tmp_path / "cache")
    assert main(["pack", inputs[0], "-o", "memory://mm/n", *PACK_FLAGS, "--cache-dir", cache]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "only in this process" in err
    assert err.startswith("roxxel pack: error: -o 'memory://mm/n'")
    assert not fsspec.filesystem("memory").exists("/mm/n") and os.listdir(tmp_path) == []


def test_issue15_remote_pack_to_file_urls_with_a_host(inputs, tmp_path, monkeypatch, capsys):
    """``-o file://localhost/<abs>`` packed into ``./localhost/<abs>``, ``-o file://dsB`` into
    ``./dsB``: localhost is this machine, and a relative file URL is refused."""
    from roxxel.cli import main

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    cache = ["--cache-dir", str(tmp_path / "cache")]
    args = ["pack", inputs[0], *PACK_FLAGS, *cache, "-q"]
    assert main([*args, "-o", "file://dsB"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "file://dsB" in err
    assert "expected file:///absolute/path" in err and os.listdir(work) == []
    assert main([*args, "-o", f"file://localhost{tmp_path}/out"]) == 0
    assert len(roxxel.open_dataset(tmp_path / "out")) == NUM_LINES and os.listdir(work) == []


def test_issue15_remote_pack_stages_under_a_cache_dir_starting_with_a_tilde(
    inputs, tmp_path, monkeypatch
):
    """``pack -o URL --cache-dir '~/c'`` staged its shards in a folder named ``~`` of the
    working one, where ``open_dataset`` reads ``~/c`` as the home folder's ``c``."""
    from roxxel.cli import main

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    args = ["pack", inputs[0], *PACK_FLAGS, "--cache-dir", "~/c", "-q"]
    assert main([*args, "-o", f"file://{tmp_path}/out"]) == 0
    assert len(roxxel.open_dataset(tmp_path / "out")) == NUM_LINES
    assert os.listdir(work) == [] and (home / "c" / "staging").is_dir()


def _bpe(folder: Path) -> Path:
    pytest.importorskip("tokenizers")
    from tests.test_tokenize import train_bpe

    train_bpe([f"a quick brown fox {i}" for i in range(50)], 300).save(str(folder / "tok.json"))
    return folder / "tok.json"


def _photos(folder: Path) -> Path:
    image = pytest.importorskip("PIL.Image")
    for i, label in enumerate(["dog", "cat", "emu"]):  # labels from the sorted names
        (folder / label).mkdir(parents=True)
        pixels = bytes(range(i, i + 48)) * 4
        image.frombytes("RGB", (8, 8), pixels).save(folder / label / f"{i}.png")
    return folder


@pytest.mark.parametrize("kind", ["tokenizer", "images"])
def test_issue15_remote_pack_with_a_tokenizer_or_images_writes_the_local_manifest(kind, tmp_path):
    """A pack to a URL wrote the manifest's ``metadata`` (how tokens or pixels were made)
    with its keys in the order the code made them, a local pack in the order its plan.json
    keeps (sorted): the same shards, another manifest, so another fingerprint, and a
    checkpoint of a run on one did not restore on the other."""
    from roxxel.cli import main

    if kind == "tokenizer":
        text = tmp_path / "text.jsonl"
        text.write_text(
            "".join(json.dumps({"text": f"fox {i}", "url": "u"}) + "\n" for i in range(9))
        )
        flags = [str(text), "--tokenizer", str(_bpe(tmp_path)), "--keep-field", "url"]
        flags += ["--append-eos"]
    else:
        flags = [str(_photos(tmp_path / "photos")), "--image-size", "4x4"]
    local, remote = tmp_path / "local", tmp_path / "remote"
    assert main(["pack", *flags, "-o", str(local), "-q"]) == 0
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert main(["pack", *flags, "-o", f"file://{remote}", *cache, "-q"]) == 0
    assert (remote / "manifest.json").read_bytes() == (local / "manifest.json").read_bytes()
    assert roxxel.open_dataset(f"file://{remote}", cache_dir=tmp_path / "c").fingerprint == (
        roxxel.open_dataset(local).fingerprint
    )
