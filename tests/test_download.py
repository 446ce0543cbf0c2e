"""Tests for the checked downloader and `mpipar data download`, against a loopback HTTP server.

Run: PYTHONPATH=. python -m pytest tests/test_download.py -q
"""

import functools
import hashlib
import os
import stat
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from click.testing import CliRunner

import mpipar.data.download as download_module
from mpipar.cli.data import data as data_cli
from mpipar.data.datasets import IDX_FILES
from mpipar.data.download import DOWNLOADS, DownloadSpec, download
from mpipar.data.idx import write_idx
from mpipar.errors import ConfigError, DataError

FILES = {
    "train-images-idx3-ubyte.gz": b"pretend images " * 1000,
    "train-labels-idx1-ubyte.gz": b"pretend labels",
}


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # keep pytest output clean
        pass

    def do_GET(self):
        # Under /dropped/ the connection dies mid-body, as an interrupted download does.
        if self.path.startswith("/dropped/"):
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b"x" * 10)
            self.close_connection = True
            return
        super().do_GET()


@pytest.fixture
def server(tmp_path):
    """Serve tmp_path/served over http://127.0.0.1:PORT/ for the length of one test."""
    root = tmp_path / "served"
    root.mkdir()
    handler = functools.partial(QuietHandler, directory=str(root))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


@pytest.fixture
def fake_spec(monkeypatch, server):
    """Register data set 'fake' whose files the server serves, with their true hashes."""
    root, url = server
    for name, content in FILES.items():
        (root / name).write_bytes(content)
    hashes = {name: hashlib.sha256(content).hexdigest() for name, content in FILES.items()}
    monkeypatch.setitem(DOWNLOADS, "fake", DownloadSpec(url, hashes))
    return root, url


def test_download_lands_files_and_skips_second_time(tmp_path, fake_spec, monkeypatch):
    dest = tmp_path / "dest" / "fake"
    paths = download("fake", dest)
    assert sorted(p.name for p in paths) == sorted(FILES)
    for path in paths:
        assert path.read_bytes() == FILES[path.name]
    assert sorted(p.name for p in dest.iterdir()) == sorted(FILES)

    def no_network(*args, **kwargs):
        raise AssertionError("a file with the right hash was downloaded again")

    monkeypatch.setattr(download_module, "_fetch", no_network)
    assert download("fake", dest) == paths


def test_download_replaces_a_file_with_the_wrong_hash(tmp_path, fake_spec):
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "train-labels-idx1-ubyte.gz").write_bytes(b"half-writ")
    download("fake", dest)
    assert (dest / "train-labels-idx1-ubyte.gz").read_bytes() == FILES["train-labels-idx1-ubyte.gz"]


def test_corrupt_download_raises_and_leaves_nothing(tmp_path, fake_spec):
    root, url = fake_spec
    corrupt = b"tampered labels"
    (root / "train-labels-idx1-ubyte.gz").write_bytes(corrupt)
    dest = tmp_path / "dest"
    with pytest.raises(DataError) as info:
        download("fake", dest)
    message = str(info.value)
    assert url + "train-labels-idx1-ubyte.gz" in message
    assert DOWNLOADS["fake"].sha256["train-labels-idx1-ubyte.gz"] in message
    assert hashlib.sha256(corrupt).hexdigest() in message
    # Only the good file that came before remains: no final name, no temporary file.
    assert [p.name for p in dest.iterdir()] == ["train-images-idx3-ubyte.gz"]


def test_missing_file_raises_naming_url(tmp_path, fake_spec):
    root, url = fake_spec
    (root / "train-images-idx3-ubyte.gz").unlink()
    dest = tmp_path / "dest"
    with pytest.raises(DataError) as info:
        download("fake", dest)
    assert url + "train-images-idx3-ubyte.gz" in str(info.value)
    assert "404" in str(info.value)
    assert list(dest.iterdir()) == []


def test_dropped_connection_raises_and_leaves_nothing(tmp_path, fake_spec):
    root, url = fake_spec
    dest = tmp_path / "dest"
    with pytest.raises(DataError, match="/dropped/train-images-idx3-ubyte.gz"):
        download("fake", dest, base_url=url + "dropped/")
    assert list(dest.iterdir()) == []


def test_unreachable_server_raises_naming_url(tmp_path, fake_spec):
    # Port 9 (discard) on loopback has nothing listening, so the connection is refused.
    with pytest.raises(DataError, match="127.0.0.1:9/"):
        download("fake", tmp_path / "dest", base_url="http://127.0.0.1:9/")


def test_mirror_overrides_registry_url(tmp_path, fake_spec, monkeypatch):
    root, url = fake_spec
    monkeypatch.setitem(DOWNLOADS, "fake", DownloadSpec("http://127.0.0.1:9/", DOWNLOADS["fake"].sha256))
    paths = download("fake", tmp_path / "dest", base_url=url.rstrip("/"))
    assert all(p.read_bytes() == FILES[p.name] for p in paths)


def test_unknown_download_name(tmp_path):
    with pytest.raises(ConfigError, match="nosuch"):
        download("nosuch", tmp_path)


def test_registry_has_a_sha256_for_every_upstream_file():
    assert set(DOWNLOADS) >= {"mnist", "fashion-mnist", "kmnist"}
    for name in ("mnist", "fashion-mnist", "kmnist"):
        hashes = DOWNLOADS[name].sha256
        assert len(hashes) == 4 and all(file.endswith(".gz") for file in hashes)
        assert all(len(h) == 64 and int(h, 16) >= 0 for h in hashes.values())


def test_cli_download_with_mirror_into_data_dir_name(tmp_path, fake_spec, monkeypatch):
    root, url = fake_spec
    monkeypatch.setitem(DOWNLOADS, "fake", DownloadSpec("http://127.0.0.1:9/", DOWNLOADS["fake"].sha256))
    data_dir = tmp_path / "datasets"
    result = CliRunner().invoke(data_cli, ["download", "fake", "--data-dir", str(data_dir), "--mirror", url])
    assert result.exit_code == 0, result.output
    # --data-dir names the directory of data sets, as in `mpipar train`: the files go to DIR/NAME.
    assert all((data_dir / "fake" / name).read_bytes() == content for name, content in FILES.items())
    assert str(data_dir / "fake" / "train-images-idx3-ubyte.gz") in result.output
    assert f"--data-dir {data_dir}" in result.output


def test_cli_download_defaults_to_the_environment_then_dot_data(tmp_path, fake_spec, monkeypatch):
    monkeypatch.setenv("MPIPAR_DATA", str(tmp_path / "env"))
    assert CliRunner().invoke(data_cli, ["download", "fake"]).exit_code == 0
    assert sorted(p.name for p in (tmp_path / "env" / "fake").iterdir()) == sorted(FILES)
    monkeypatch.delenv("MPIPAR_DATA")
    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(data_cli, ["download", "fake"]).exit_code == 0
    assert sorted(p.name for p in (tmp_path / "data" / "fake").iterdir()) == sorted(FILES)


def test_cli_download_has_no_dest_option_any_more(tmp_path, fake_spec):
    result = CliRunner().invoke(data_cli, ["download", "fake", "--dest", str(tmp_path)])
    assert result.exit_code == 2 and "--dest" in result.output


def test_cli_download_failure_is_a_clean_error(tmp_path, fake_spec):
    root, url = fake_spec
    (root / "train-labels-idx1-ubyte.gz").write_bytes(b"tampered")
    result = CliRunner().invoke(data_cli, ["download", "fake", "--data-dir", str(tmp_path / "d")])
    assert result.exit_code == 1
    assert "checksum mismatch" in result.output and "Traceback" not in result.output


def test_cli_list_shows_a_data_dir_set(tmp_path, monkeypatch):
    monkeypatch.delenv("MPIPAR_DATA", raising=False)
    (tmp_path / "kmnist").mkdir()
    for stem in IDX_FILES.values():
        write_idx(tmp_path / "kmnist" / stem, np.zeros(3, dtype=np.uint8))
    result = CliRunner().invoke(data_cli, ["list", "--data-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    kmnist_line = next(line for line in result.output.splitlines() if line.startswith("kmnist"))
    assert f"present in {tmp_path / 'kmnist'}" in kmnist_line
    assert "digits" in result.output and "text" in result.output


def test_downloaded_files_are_readable_by_group_and_others_under_umask_022(tmp_path, fake_spec):
    original = os.umask(0o022)
    try:
        paths = download("fake", tmp_path / "dest")
    finally:
        os.umask(original)
    assert {oct(stat.S_IMODE(path.stat().st_mode)) for path in paths} == {oct(0o644)}


def test_a_download_that_cannot_be_written_is_one_sentence_naming_the_file(tmp_path, fake_spec):
    dest = tmp_path / "dest"
    (dest / "train-labels-idx1-ubyte.gz").mkdir(parents=True)  # the rename onto it fails
    with pytest.raises(DataError) as info:
        download("fake", dest)
    assert str(info.value).startswith(f"cannot write {dest / 'train-labels-idx1-ubyte.gz'}: ")
    assert sorted(p.name for p in dest.iterdir()) == sorted(FILES)  # no temporary file left
